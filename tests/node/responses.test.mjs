// The official `openai` Node client's `responses` calls against a running `baton serve`
// (started by tests/server.rs with BATON_URL, BATON_API_KEY and BATON_MODEL set): text
// as chat gives it, the streamed events, a function call and its output, json_schema
// output that validates (ajv).
import assert from "node:assert/strict";
import { test } from "node:test";

import Ajv from "ajv";
import OpenAI from "openai";

const { BATON_URL, BATON_API_KEY, BATON_MODEL } = process.env;
if (!BATON_URL || !BATON_API_KEY || !BATON_MODEL) {
  throw new Error("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (cargo test --test server sets them)");
}
const client = new OpenAI({ baseURL: BATON_URL + "/v1", apiKey: BATON_API_KEY, maxRetries: 0, timeout: 300_000 });
const respond = (input, extra = {}) =>
  client.responses.create({ model: BATON_MODEL, input, temperature: 0, max_output_tokens: 24, ...extra });
const WEATHER = {
  type: "function",
  name: "get_weather",
  description: "The current weather in a city.",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
};

test("text, whole and streamed, is what chat gives", async () => {
  const question = "What is the capital of France? One word.";
  const whole = await respond(question);
  assert.equal(whole.status, "completed");
  const chat = await client.chat.completions.create({
    model: BATON_MODEL,
    messages: [{ role: "user", content: question }],
    temperature: 0,
    max_tokens: 24,
  });
  assert.equal(whole.output_text, chat.choices[0].message.content);
  const events = [];
  for await (const event of await respond(question, { stream: true })) events.push(event);
  assert.equal(events[0].type, "response.created");
  assert.equal(events.at(-1).type, "response.completed");
  const text = events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join("");
  assert.equal(text, whole.output_text);
});

test("a function call and its output", async () => {
  const question = "What is the weather in Paris?";
  const called = await respond(question, { tools: [WEATHER], tool_choice: "required", max_output_tokens: 60 });
  const call = called.output.find((item) => item.type === "function_call");
  assert.ok(call, JSON.stringify(called.output));
  assert.equal(call.name, "get_weather");
  assert.equal(typeof JSON.parse(call.arguments).city, "string");
  const answer = await respond(
    [
      { role: "user", content: question },
      { type: "function_call", call_id: call.call_id, name: call.name, arguments: call.arguments },
      { type: "function_call_output", call_id: call.call_id, output: "18 C and sunny" },
    ],
    { tools: [WEATHER], max_output_tokens: 40 },
  );
  assert.ok(answer.output_text.length > 0);
});

test("json_schema output validates", async () => {
  const schema = {
    type: "object",
    properties: { name: { type: "string", maxLength: 24 }, age: { type: "integer" } },
    required: ["name", "age"],
    additionalProperties: false,
  };
  const response = await respond("Invent a programmer.", {
    max_output_tokens: 60,
    text: { format: { type: "json_schema", name: "person", schema, strict: true } },
  });
  assert.ok(new Ajv().validate(schema, JSON.parse(response.output_text)), response.output_text);
});
