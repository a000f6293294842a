// `parallel_tool_calls: false` under `tool_choice: auto`, through the official `openai`
// Node client: at most one tool call comes back, whole or streamed, and generation ends
// with it. Run by tests/server.rs against `baton serve` on gemma-3-270m (why gemma: see
// tests/openai/one_tool_call.py), with BATON_URL, BATON_API_KEY and BATON_MODEL set:
// `node --test one_tool_call.mjs`. Not named *.test.mjs, so a bare `node --test` (the
// Qwen server's files) leaves it out.
import assert from "node:assert/strict";
import { test } from "node:test";

import OpenAI from "openai";

import { WEATHER } from "./weather.mjs";

const { BATON_URL, BATON_API_KEY, BATON_MODEL } = process.env;
if (!BATON_URL || !BATON_API_KEY || !BATON_MODEL) {
  throw new Error("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (cargo test --test server sets them)");
}
const client = new OpenAI({ baseURL: BATON_URL + "/v1", apiKey: BATON_API_KEY, maxRetries: 0, timeout: 300_000 });

// Two calls as the model writes them (text: the default template renders no `tool_calls`).
const calls = (...cities) =>
  cities
    .map((city) => `<tool_call>\n{"name": "get_weather", "arguments": {"city": "${city}", "unit": "celsius"}}\n</tool_call>`)
    .join("\n");
const MESSAGES = [
  { role: "user", content: "What is the weather in Paris and in London? Use celsius." },
  { role: "assistant", content: calls("Paris", "London") },
  { role: "user", content: "What is the weather in Oslo and in Lima? Use celsius." },
  { role: "assistant", content: calls("Oslo", "Lima") },
  { role: "user", content: "What is the weather in Rome and in Berlin? Use celsius." },
];
const chat = (extra = {}) =>
  client.chat.completions.create({
    model: BATON_MODEL,
    messages: MESSAGES,
    tools: [WEATHER],
    temperature: 0,
    seed: 1234,
    max_tokens: 80,
    ...extra,
  });
const named = (call) => [call.function.name, JSON.parse(call.function.arguments)];

test("without parallel calls one call ends the answer, whole and streamed", async () => {
  const parallel = await chat();
  assert.deepEqual(parallel.choices[0].message.tool_calls.slice(0, 2).map(named), [
    ["get_weather", { city: "Rome", unit: "celsius" }],
    ["get_weather", { city: "Berlin", unit: "celsius" }],
  ]);

  const whole = await chat({ parallel_tool_calls: false });
  const choice = whole.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  assert.deepEqual(choice.message.tool_calls.map(named), [named(parallel.choices[0].message.tool_calls[0])]);
  assert.equal(choice.message.content, null);
  assert.ok(whole.usage.completion_tokens < parallel.usage.completion_tokens);

  const chunks = [];
  for await (const chunk of await chat({ parallel_tool_calls: false, stream: true, stream_options: { include_usage: true } })) {
    chunks.push(chunk);
  }
  const deltas = chunks.flatMap((c) => c.choices[0]?.delta?.tool_calls ?? []);
  assert.deepEqual(deltas.map((d) => d.index), [0]);
  assert.deepEqual(named(deltas[0]), named(choice.message.tool_calls[0]));
  assert.equal(chunks.map((c) => c.choices[0]?.delta?.content ?? "").join(""), "");
  assert.deepEqual(chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean), ["tool_calls"]);
  assert.equal(chunks.at(-1).usage.completion_tokens, whole.usage.completion_tokens);
});
