// The official `openai` Node client against a running `baton serve` (started by
// tests/server.rs with BATON_URL, BATON_API_KEY and BATON_MODEL set): chat whole and
// streamed, a tool-call round trip, json_schema output that validates (ajv), and
// /metrics growing with traffic. (The Python tests parse /metrics with Prometheus' own
// parser; npm's parse-prometheus-text-format fails on OpenMetrics histograms whose
// _sum and _count precede the buckets, which the format allows, so samples are read
// line by line here.)
import assert from "node:assert/strict";
import { test } from "node:test";

import Ajv from "ajv";
import OpenAI from "openai";

import { WEATHER } from "./weather.mjs";

const { BATON_URL, BATON_API_KEY, BATON_MODEL } = process.env;
if (!BATON_URL || !BATON_API_KEY || !BATON_MODEL) {
  throw new Error("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (cargo test --test server sets them)");
}
const client = new OpenAI({ baseURL: BATON_URL + "/v1", apiKey: BATON_API_KEY, maxRetries: 0, timeout: 300_000 });
const chat = (messages, extra = {}) =>
  client.chat.completions.create({ model: BATON_MODEL, messages, temperature: 0, seed: 1234, ...extra });

const QUESTION = [{ role: "user", content: "What is the weather in Paris right now? Use celsius." }];
const ajv = new Ajv();

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

test("chat, whole and streamed, say the same", async () => {
  const messages = [{ role: "user", content: "What is the capital of France? One word." }];
  const whole = await chat(messages, { max_tokens: 12 });
  assert.ok(whole.choices[0].message.content.length > 0);
  const chunks = await collect(await chat(messages, { max_tokens: 12, stream: true }));
  const text = chunks.map((c) => c.choices[0]?.delta?.content ?? "").join("");
  assert.equal(text, whole.choices[0].message.content);
});

test("a tool call round trip, whole and streamed", async () => {
  const whole = await chat(QUESTION, { tools: [WEATHER], tool_choice: "required", max_tokens: 64 });
  const choice = whole.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  const [call] = choice.message.tool_calls;
  assert.equal(call.function.name, "get_weather");
  const args = JSON.parse(call.function.arguments);
  assert.ok(ajv.validate(WEATHER.function.parameters, args), JSON.stringify(ajv.errors));

  const chunks = await collect(await chat(QUESTION, { tools: [WEATHER], tool_choice: "required", max_tokens: 64, stream: true }));
  let streamed = { name: "", arguments: "" };
  for (const chunk of chunks) {
    for (const delta of chunk.choices[0]?.delta?.tool_calls ?? []) {
      assert.equal(delta.index, 0);
      streamed.name += delta.function?.name ?? "";
      streamed.arguments += delta.function?.arguments ?? "";
    }
  }
  assert.equal(streamed.name, "get_weather");
  assert.deepEqual(JSON.parse(streamed.arguments), args);
  assert.deepEqual(chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean), ["tool_calls"]);

  const answer = await chat(
    [
      ...QUESTION,
      { role: "assistant", content: null, tool_calls: [call] },
      { role: "tool", tool_call_id: call.id, content: JSON.stringify({ temperature: 21, unit: args.unit }) },
    ],
    { tools: [WEATHER], tool_choice: "none", max_tokens: 32 },
  );
  assert.ok(answer.choices[0].message.content.trim().length > 0);
  const without = await chat(QUESTION, { tools: [WEATHER], tool_choice: "none", max_tokens: 1 });
  assert.ok(answer.usage.prompt_tokens > without.usage.prompt_tokens + 20, "the call and its result are in the prompt");
});

test("json_schema output parses and validates, whole and streamed", async () => {
  const schema = {
    type: "object",
    properties: {
      title: { type: "string", maxLength: 30 },
      year: { type: "integer" },
      tags: { type: "array", items: { type: "string", maxLength: 12 }, minItems: 1, maxItems: 3 },
    },
    required: ["title", "year", "tags"],
    additionalProperties: false,
  };
  const messages = [{ role: "user", content: "Describe a classic film." }];
  const response_format = { type: "json_schema", json_schema: { name: "film", strict: true, schema } };
  const whole = await chat(messages, { response_format, max_tokens: 100 });
  assert.equal(whole.choices[0].finish_reason, "stop");
  const value = JSON.parse(whole.choices[0].message.content);
  assert.ok(ajv.validate(schema, value), JSON.stringify(ajv.errors));
  const chunks = await collect(await chat(messages, { response_format, max_tokens: 100, stream: true }));
  assert.deepEqual(JSON.parse(chunks.map((c) => c.choices[0]?.delta?.content ?? "").join("")), value);
});

async function scrape() {
  const response = await fetch(BATON_URL + "/metrics", { headers: { Authorization: "Bearer " + BATON_API_KEY } });
  assert.equal(response.status, 200);
  const text = await response.text();
  assert.ok(text.trimEnd().endsWith("# EOF"), "OpenMetrics ends with # EOF");
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$/.exec(line);
    assert.ok(match, `not a sample line: ${line}`);
    samples.set(match[1] + (match[2] ?? ""), Number(match[3]));
  }
  const value = (name, labels = {}) => {
    const rendered = Object.entries(labels).map(([k, v]) => `${k}="${v}"`).join(",");
    return samples.get(rendered ? `${name}{${rendered}}` : name) ?? 0;
  };
  return value;
}

test("metrics grow with traffic", async () => {
  const before = await scrape();
  const whole = await chat([{ role: "user", content: "Say hi." }], { max_tokens: 6 });
  await collect(await chat([{ role: "user", content: "Say hi." }], { max_tokens: 6, stream: true }));
  const after = await scrape();
  const ok = { endpoint: "chat", outcome: "ok" };
  assert.equal(after("baton_requests_total", ok) - before("baton_requests_total", ok), 2);
  assert.ok(after("baton_generated_tokens_total") - before("baton_generated_tokens_total") >= whole.usage.completion_tokens);
  const ttft = "baton_time_to_first_token_seconds_count";
  assert.equal(after(ttft) - before(ttft), 2);
});
