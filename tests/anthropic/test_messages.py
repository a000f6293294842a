"""The official `anthropic` Python client against `baton serve`'s `/v1/messages`.

Run by the Rust integration test `tests/server.rs`
(`the_anthropic_python_client_works_against_the_server`), which starts `baton serve` on
Qwen2.5-Coder-0.5B-Instruct with an API key and sets BATON_URL, BATON_API_KEY and
BATON_MODEL (see tests/openai/test_client.py). Every request is greedy (`temperature: 0`, sent as an extra field)
and short, so the answers are deterministic; where the same request goes through
`/v1/chat/completions` the text must be the same.
"""

import json
import os
import urllib.request

import anthropic
import pytest

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not (BATON_URL and BATON_API_KEY and BATON_MODEL):
    pytest.fail("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (`cargo test --test server` sets them)", pytrace=False)

# The client (2.x) has no sampling parameters of its own; the server reads
# `temperature`, `top_p` and `top_k` when they are sent.
GREEDY = {"temperature": 0}
CAPITAL = "What is the capital of France? Answer in one word."
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client():
    c = anthropic.Anthropic(base_url=BATON_URL, api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def ask(client, content, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("extra_body", GREEDY)
    return client.messages.create(model=BATON_MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def chat_text(messages, **kwargs):
    body = {"model": BATON_MODEL, "messages": messages, "temperature": 0, **kwargs}
    request = urllib.request.Request(
        BATON_URL + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + BATON_API_KEY},
    )
    return json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"]


def text_of(message):
    return "".join(block.text for block in message.content if block.type == "text")


def test_text_answers_as_chat_does(client):
    message = ask(client, CAPITAL, system="You are a helpful assistant.")
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg")
    assert message.model == BATON_MODEL
    assert "Paris" in text_of(message)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 5 and message.usage.output_tokens > 0
    same = chat_text(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": CAPITAL}],
        max_tokens=24,
    )
    assert text_of(message) == same


def test_streaming_gives_the_same_message_in_anthropics_events(client):
    whole = ask(client, "Count from 1 to 8, separated by commas.", max_tokens=30)
    events = []
    with client.messages.stream(
        model=BATON_MODEL,
        max_tokens=30,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count from 1 to 8, separated by commas."}],
    ) as stream:
        pieces = []
        for event in stream:
            events.append(event.type)
            if event.type == "content_block_delta":
                pieces.append(event.delta.text)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(whole) == text_of(final)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_tokens_and_stop_sequences_end_the_message_as_anthropic_says(client):
    short = ask(client, "Count from 1 to 20, separated by commas.", max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    whole = ask(client, "Count from 1 to 20, separated by commas.", max_tokens=40)
    text = text_of(whole)
    assert "5" in text, text
    cut = ask(client, "Count from 1 to 20, separated by commas.", max_tokens=40, stop_sequences=["5"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "5"
    assert text_of(cut) == text[: text.index("5")]


def test_a_forced_tool_call_and_its_result(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(
        model=BATON_MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and len(uses) == 1, called
    assert uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
    assert uses[0].id.startswith("toolu_")
    # The same call streamed: one tool_use block whose input arrives as JSON deltas.
    with client.messages.stream(
        model=BATON_MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", uses[0].input)
    ]
    # The result goes back as a tool_result block; the model answers in text.
    answer = client.messages.create(
        model=BATON_MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=messages
        + [
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C and sunny"}]},
        ],
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and text_of(answer)


def test_errors_arrive_as_the_clients_exceptions(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}])
    assert "image" in caught.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    wrong = anthropic.Anthropic(base_url=BATON_URL, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=BATON_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
