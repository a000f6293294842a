"""`parallel_tool_calls: false` under `tool_choice: auto`, through the official `openai`
Python client: at most one tool call comes back, and generation ends with it.

Run by `tests/server.rs` (`parallel_tool_calls_false_gives_one_call_under_auto`) against
`baton serve` on gemma-3-270m, with the same variables as test_client.py (BATON_URL,
BATON_API_KEY, BATON_MODEL):

    python3 -m pytest tests/openai/one_tool_call.py -q -x

Not named test_*.py, so `pytest tests/openai` (the Qwen server's run) leaves it out. Why
gemma: the Qwen2.5-Coder-0.5B of test_client.py writes calls as bare JSON lines, never in
the `<tool_call>` tags its template asks for, so under `auto` it never calls a tool. The
gemma base model has no chat template (the server gives it ChatML and describes the tools
in Hermes style) and continues a pattern faithfully: after two answers that each call
`get_weather` twice, it calls it twice again. Greedy, so the tests are deterministic.
"""

import json
import os

import openai
import pytest

# The tool of test_client.py (run with the same variables, so importing it is safe).
from test_client import WEATHER

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not (BATON_URL and BATON_API_KEY and BATON_MODEL):
    pytest.fail(
        "BATON_URL, BATON_API_KEY and BATON_MODEL must be set: `cargo test --test server` sets them",
        pytrace=False,
    )

def calls(*cities):
    """Two calls as the model writes them (text: the default template renders no `tool_calls`)."""
    return "\n".join(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius"}}\n</tool_call>' % city
        for city in cities
    )


MESSAGES = [
    {"role": "user", "content": "What is the weather in Paris and in London? Use celsius."},
    {"role": "assistant", "content": calls("Paris", "London")},
    {"role": "user", "content": "What is the weather in Oslo and in Lima? Use celsius."},
    {"role": "assistant", "content": calls("Oslo", "Lima")},
    {"role": "user", "content": "What is the weather in Rome and in Berlin? Use celsius."},
]


@pytest.fixture(scope="module")
def client():
    c = openai.OpenAI(base_url=BATON_URL + "/v1", api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=BATON_MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0, seed=1234, max_tokens=80, **kwargs
    )


def named(call):
    return call.function.name, json.loads(call.function.arguments)


def test_with_parallel_calls_the_model_calls_twice(client):
    # What the other tests take away from: the model, left alone, writes two calls.
    r = chat(client)
    assert [named(c) for c in r.choices[0].message.tool_calls[:2]] == [
        ("get_weather", {"city": "Rome", "unit": "celsius"}),
        ("get_weather", {"city": "Berlin", "unit": "celsius"}),
    ], r.choices[0].message


def test_without_parallel_calls_one_call_ends_the_answer(client):
    parallel = chat(client)
    r = chat(client, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [named(c) for c in choice.message.tool_calls] == [named(parallel.choices[0].message.tool_calls[0])]
    assert choice.message.tool_calls[0].id
    # Nothing was generated after the call: no text, and fewer tokens than two calls took.
    assert choice.message.content is None, choice.message
    assert r.usage.completion_tokens < parallel.usage.completion_tokens, (r.usage, parallel.usage)


def test_without_parallel_calls_the_stream_carries_the_same_one_call(client):
    whole = chat(client, parallel_tool_calls=False)
    chunks = list(chat(client, parallel_tool_calls=False, stream=True, stream_options={"include_usage": True}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0], deltas
    assert (deltas[0].function.name, json.loads(deltas[0].function.arguments)) == named(whole.choices[0].message.tool_calls[0])
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "", content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
