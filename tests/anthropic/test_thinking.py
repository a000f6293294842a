"""Thinking as `thinking` blocks through the official `anthropic` Python client (run
with tests/anthropic/test_messages.py by tests/server.rs; same variables). The test
model does not think, so llama.cpp's `grammar` extension makes it write what a
thinking model writes (see tests/openai/test_reasoning.py)."""

import os

import anthropic
import pytest

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not (BATON_URL and BATON_API_KEY and BATON_MODEL):
    pytest.fail("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (`cargo test --test server` sets them)", pytrace=False)

THINKING = "I should greet them back."
ANSWER = "Hello there."
GRAMMAR = 'root ::= "<think>\\n' + THINKING + '\\n</think>" "\\n\\n' + ANSWER + '"'
EXTRA = {"temperature": 0, "grammar": GRAMMAR}


@pytest.fixture(scope="module")
def client():
    c = anthropic.Anthropic(base_url=BATON_URL, api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def ask(client, **kwargs):
    return client.messages.create(
        model=BATON_MODEL, max_tokens=60, messages=[{"role": "user", "content": "Hi"}], extra_body=EXTRA, **kwargs
    )


def test_thinking_is_a_block_before_the_text(client):
    for thinking in (None, {"type": "enabled", "budget_tokens": 1024}):
        message = ask(client, **({"thinking": thinking} if thinking else {}))
        assert [block.type for block in message.content] == ["thinking", "text"], thinking
        assert message.content[0].thinking == THINKING
        assert message.content[1].text == ANSWER
        assert message.stop_reason == "end_turn"


def test_disabled_thinking_is_not_sent(client):
    message = ask(client, thinking={"type": "disabled"})
    assert [(block.type, block.text) for block in message.content] == [("text", ANSWER)]


def test_streamed_thinking_comes_as_thinking_deltas_then_the_text(client):
    with client.messages.stream(
        model=BATON_MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=EXTRA,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thinking = [d.thinking for d in deltas if d.type == "thinking_delta"]
    assert len(thinking) > 1 and "".join(thinking) == THINKING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THINKING and final.content[1].text == ANSWER


def test_earlier_thinking_sent_back_is_accepted(client):
    message = client.messages.create(
        model=BATON_MODEL,
        max_tokens=60,
        extra_body=EXTRA,
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": THINKING, "signature": ""},
                    {"type": "text", "text": ANSWER},
                ],
            },
            {"role": "user", "content": "Hi again"},
        ],
    )
    assert message.content[-1].text == ANSWER
