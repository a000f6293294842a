"""The official `openai` Python client's `responses` calls against `baton serve`'s
`/v1/responses` (run with tests/openai/test_client.py by tests/server.rs; same
variables). Greedy and short: the text must be what `/v1/chat/completions` gives."""

import json
import os

import jsonschema
import openai
import pytest

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not (BATON_URL and BATON_API_KEY and BATON_MODEL):
    pytest.fail("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (`cargo test --test server` sets them)", pytrace=False)

CAPITAL = "What is the capital of France? Answer in one word."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client():
    c = openai.OpenAI(base_url=BATON_URL + "/v1", api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def respond(client, input, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 24)
    return client.responses.create(model=BATON_MODEL, input=input, **kwargs)


def test_text_is_what_chat_gives(client):
    response = respond(client, CAPITAL, instructions="You are a helpful assistant.")
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp")
    assert "Paris" in response.output_text
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert response.usage.input_tokens > 5 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    chat = client.chat.completions.create(
        model=BATON_MODEL,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": CAPITAL}],
    )
    assert response.output_text == chat.choices[0].message.content
    # Input items say the same.
    items = respond(client, [{"role": "user", "content": [{"type": "input_text", "text": CAPITAL}]}],
                    instructions="You are a helpful assistant.")
    assert items.output_text == response.output_text


def test_streaming_events_build_the_same_response(client):
    whole = respond(client, "Count from 1 to 8, separated by commas.", max_output_tokens=30)
    stream = respond(client, "Count from 1 to 8, separated by commas.", max_output_tokens=30, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    # The stream helper accumulates the same.
    with client.responses.stream(model=BATON_MODEL, input="Count from 1 to 8, separated by commas.",
                                 temperature=0, max_output_tokens=30) as helper:
        final = helper.get_final_response()
    assert final.output_text == whole.output_text


def test_max_output_tokens_makes_it_incomplete(client):
    short = respond(client, "Count from 1 to 20, separated by commas.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3


def test_a_function_call_and_its_output(client):
    called = respond(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                     max_output_tokens=60)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather", called
    assert isinstance(json.loads(calls[0].arguments).get("city"), str)
    answer = respond(
        client,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=40,
    )
    assert answer.output_text
    # Streamed: the call arrives whole in its argument events.
    events = list(respond(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                          max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done][:1] == [calls[0].arguments]


def test_json_schema_output_validates(client):
    response = respond(
        client,
        "Invent a programmer.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_what_the_server_cannot_do_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, "hi", previous_response_id="resp_123")
    assert "previous_response_id" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        respond(client, [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/x.png"}]}])
