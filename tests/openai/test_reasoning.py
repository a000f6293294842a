"""Thinking split out of the answer, through the official `openai` Python client:
`reasoning_content` in chat completions (whole and streamed) and a `reasoning` item
in responses (run with tests/openai/test_client.py by tests/server.rs; same
variables). The test model (Qwen2.5-Coder) does not think, so llama.cpp's `grammar`
extension makes it write what a thinking model writes; the split does not depend on
the template: a `<think>` that opens the output is thinking, as in llama.cpp."""

import json
import os

import openai
import pytest

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not (BATON_URL and BATON_API_KEY and BATON_MODEL):
    pytest.fail("BATON_URL, BATON_API_KEY and BATON_MODEL must be set (`cargo test --test server` sets them)", pytrace=False)

THINKING = "I should greet them back."
ANSWER = "Hello there."
# The tags arrive split across tokens: this vocabulary has no `<think>` token.
GRAMMAR = 'root ::= "<think>\\n' + THINKING + '\\n</think>" "\\n\\n' + ANSWER + '"'
CALL_GRAMMAR = (
    'root ::= "<think>\\nThe weather tool knows.\\n</think>\\n\\n'
    '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"'
)
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client():
    c = openai.OpenAI(base_url=BATON_URL + "/v1", api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def chat(client, grammar=GRAMMAR, **kwargs):
    kwargs.setdefault("messages", HI)
    extra = {"grammar": grammar, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model=BATON_MODEL, temperature=0, max_tokens=60, extra_body=extra, **kwargs)


def test_chat_sends_the_thinking_as_reasoning_content(client):
    message = chat(client).choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == THINKING


def test_streamed_chat_sends_reasoning_deltas_before_the_answer(client):
    chunks = list(chat(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [
        "reasoning" if getattr(d, "reasoning_content", None) else "content"
        for d in deltas
        if getattr(d, "reasoning_content", None) or d.content
    ]
    # All thinking first, in more than one delta, then all answer.
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and kinds.count("reasoning") > 1, kinds
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THINKING
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_reasoning_format_none_keeps_the_thinking_in_the_content(client):
    message = chat(client, extra_body={"reasoning_format": "none"}).choices[0].message
    assert message.content == f"<think>\n{THINKING}\n</think>\n\n{ANSWER}"
    assert getattr(message, "reasoning_content", None) is None
    streamed = chat(client, stream=True, extra_body={"reasoning_format": "none"})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message.content


def test_switches_are_accepted_and_checked(client):
    message = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, THINKING)
    message = chat(client, reasoning_effort="low").choices[0].message
    assert message.content == ANSWER
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, extra_body={"reasoning_format": "sometimes"})
    assert refused.value.body["param"] == "reasoning_format"


def test_a_tool_call_after_the_thinking_is_parsed(client):
    for stream in (False, True):
        response = chat(client, grammar=CALL_GRAMMAR, tools=[WEATHER], stream=stream)
        if stream:
            chunks = [c for c in response if c.choices]
            reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            choice = response.choices[0]
            reasoning, calls = choice.message.reasoning_content, choice.message.tool_calls
            finish, content = [choice.finish_reason], choice.message.content or ""
        assert reasoning == "The weather tool knows.", stream
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ], stream
        assert finish == ["tool_calls"] and content == "", stream


def respond(client, **kwargs):
    return client.responses.create(
        model=BATON_MODEL, input="Hi", temperature=0, max_output_tokens=60, extra_body={"grammar": GRAMMAR}, **kwargs
    )


def test_responses_put_a_reasoning_item_before_the_message(client):
    response = respond(client)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THINKING)]
    assert response.output_text == ANSWER
    assert respond(client, reasoning={"effort": "minimal"}).output_text == ANSWER


def test_streamed_responses_send_reasoning_text_events(client):
    with client.responses.stream(
        model=BATON_MODEL, input="Hi", temperature=0, max_output_tokens=60, extra_body={"grammar": GRAMMAR}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THINKING
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert done == [THINKING]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THINKING and final.output_text == ANSWER
