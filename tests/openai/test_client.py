"""The official `openai` Python client against a running `baton serve`.

These tests are run by the Rust integration test `tests/server.rs`
(`the_openai_python_client_works_against_the_server`): it starts
`baton serve --local-workers 2 --api-key KEY ...` on Qwen2.5-Coder-0.5B-Instruct and runs

    python3 -m pytest tests/openai -q -x

from the repository root with these variables set:

    BATON_URL      the server's address, e.g. http://127.0.0.1:41234 (no /v1)
    BATON_API_KEY  the key the server requires as `Authorization: Bearer KEY`
    BATON_MODEL    the model id the server serves

They can also be run by hand against any baton server with those variables set.
Install the client first: `python3 -m pip install -r tests/openai/requirements.txt`.

Every request is greedy (temperature 0, fixed seed) and short (at most 24 tokens), so
the tests are deterministic and fast on a 2-core CI machine. Without BATON_URL the module
fails rather than skips: a test run that silently checks nothing would hide a broken
setup.
"""

import json
import math
import os
import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not BATON_URL:
    pytest.fail(
        "BATON_URL is not set: these tests need a running `baton serve` "
        "(BATON_URL=http://HOST:PORT, BATON_API_KEY=KEY, BATON_MODEL=ID); "
        "`cargo test --test server` starts one and sets them",
        pytrace=False,
    )
if not BATON_API_KEY or not BATON_MODEL:
    pytest.fail(
        "BATON_API_KEY and BATON_MODEL must be set along with BATON_URL "
        f"(got BATON_API_KEY={'set' if BATON_API_KEY else 'unset'}, BATON_MODEL={BATON_MODEL!r})",
        pytrace=False,
    )

SEED = 1234
SYSTEM = "You are a helpful assistant."
CAPITAL = "What is the capital of France? Answer in one word."
STORY = "Write a long story about a dragon."
LOGPROB_TOLERANCE = 1e-4


def make_client(api_key=BATON_API_KEY):
    # No retries: an error must surface as the status the server sent, at once.
    return openai.OpenAI(base_url=BATON_URL + "/v1", api_key=api_key, max_retries=0, timeout=300.0)


@pytest.fixture(scope="module")
def client():
    c = make_client()
    yield c
    c.close()


def chat(client, messages, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("seed", SEED)
    return client.chat.completions.create(model=BATON_MODEL, messages=messages, **kwargs)


def complete(client, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("seed", SEED)
    return client.completions.create(model=BATON_MODEL, prompt=prompt, **kwargs)


def capital_messages():
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CAPITAL}]


def finish_reasons(chunks):
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason is not None]


def chat_stream_text(chunks):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion_stream_text(chunks):
    return "".join(c.choices[0].text or "" for c in chunks if c.choices)


def check_usage(usage, max_tokens):
    assert usage is not None, "no usage reported"
    assert usage.prompt_tokens > 0, usage
    assert 1 <= usage.completion_tokens <= max_tokens, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage


def check_usage_chunk(chunks, expected_completion_tokens):
    """The last chunk of an `include_usage` stream: no choices, the token counts."""
    assert chunks, "the stream sent no chunks"
    last = chunks[-1]
    assert last.choices == [], f"the last chunk has choices: {last}"
    assert last.usage is not None, f"the last chunk has no usage: {last}"
    assert last.usage.completion_tokens == expected_completion_tokens, (last.usage, expected_completion_tokens)
    assert last.usage.prompt_tokens > 0, last.usage
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens, last.usage
    assert all(c.usage is None for c in chunks[:-1]), "usage on a chunk other than the last"


def get(path):
    """GET a path of the server with the key; the body's text."""
    request = urllib.request.Request(BATON_URL + path, headers={"Authorization": f"Bearer {BATON_API_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def slot_ctx():
    """Tokens one request may hold, from /v1/models (None if it does not say)."""
    try:
        value = json.loads(get("/v1/models"))["data"][0].get("context_length")
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return value if isinstance(value, int) and value > 0 else None


# 1. models


def test_models_lists_the_served_model(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert BATON_MODEL in ids, ids
    assert all(m.object == "model" for m in models.data)


# 2. chat, whole


def test_chat_completion(client):
    r = chat(client, capital_messages(), max_tokens=16)
    assert r.id.startswith("chatcmpl"), r.id
    assert r.object == "chat.completion"
    assert r.model == BATON_MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip(), choice.message
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    check_usage(r.usage, 16)
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 16, r.usage


# 3. chat, streamed


def test_chat_stream_matches_whole(client):
    whole = chat(client, capital_messages(), max_tokens=16)
    stream = chat(client, capital_messages(), max_tokens=16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "the stream sent no chunks"
    assert all(c.object == "chat.completion.chunk" for c in chunks), {c.object for c in chunks}
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl"), ids
    assert any(c.choices and c.choices[0].delta.role == "assistant" for c in chunks), "no chunk gives the role"

    assert chat_stream_text(chunks) == whole.choices[0].message.content
    reasons = finish_reasons(chunks)
    assert len(reasons) == 1, f"finish_reason on {len(reasons)} chunks: {reasons}"
    assert reasons[0] == whole.choices[0].finish_reason
    check_usage_chunk(chunks, whole.usage.completion_tokens)


# 4. completions


def test_completion_whole_and_streamed(client):
    whole = complete(client, "def add(a, b):", max_tokens=16)
    assert whole.id.startswith("cmpl"), whole.id
    assert whole.object == "text_completion"
    assert whole.model == BATON_MODEL
    assert len(whole.choices) == 1
    text = whole.choices[0].text
    assert isinstance(text, str) and text, whole.choices[0]
    assert whole.choices[0].finish_reason in ("stop", "length")
    check_usage(whole.usage, 16)

    chunks = list(
        complete(client, "def add(a, b):", max_tokens=16, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "text_completion" for c in chunks), {c.object for c in chunks}
    assert completion_stream_text(chunks) == text
    reasons = finish_reasons(chunks)
    assert reasons == [whole.choices[0].finish_reason], reasons
    check_usage_chunk(chunks, whole.usage.completion_tokens)


# 5. stop strings


def pick_stop(text):
    """A 2-3 character piece of `text` whose first occurrence starts at index 3 or later,
    preferring one near the middle and not only whitespace."""
    middle = len(text) // 2
    for i in sorted(range(3, len(text) - 1), key=lambda i: abs(i - middle)):
        for length in (3, 2):
            piece = text[i : i + length]
            if len(piece) == length and piece.strip() and "\ufffd" not in piece and text.index(piece) >= 3:
                return piece
    return None


def test_stop_strings(client):
    prompt = "Count: 1, 2, 3, 4,"
    full = complete(client, prompt, max_tokens=20)
    text = full.choices[0].text
    stop = pick_stop(text)
    assert stop is not None, f"no usable stop string in the greedy completion {text!r}"
    expected = text[: text.index(stop)]
    assert len(expected) >= 3

    stopped = complete(client, prompt, max_tokens=20, stop=[stop])
    got = stopped.choices[0].text
    assert got == expected, f"stop={stop!r} in {text!r}: got {got!r}, want {expected!r}"
    assert stop not in got
    assert stopped.choices[0].finish_reason == "stop"
    assert 1 <= stopped.usage.completion_tokens <= full.usage.completion_tokens, (stopped.usage, full.usage)

    chunks = list(
        complete(client, prompt, max_tokens=20, stop=[stop], stream=True, stream_options={"include_usage": True})
    )
    streamed = completion_stream_text(chunks)
    assert streamed == expected, f"stop={stop!r} in {text!r}: streamed {streamed!r}, want {expected!r}"
    assert finish_reasons(chunks) == ["stop"]
    check_usage_chunk(chunks, stopped.usage.completion_tokens)


# 6. log-probabilities


def test_chat_logprobs(client):
    r = chat(client, [{"role": "user", "content": STORY}], max_tokens=8, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None, choice
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    assert len(content) >= 1
    for entry in content:
        assert isinstance(entry.token, str)
        assert math.isfinite(entry.logprob) and entry.logprob <= 0, entry
        assert entry.bytes is not None and bytes(entry.bytes) == entry.token.encode("utf-8"), entry
        top = entry.top_logprobs
        assert len(top) == 3, entry
        values = [t.logprob for t in top]
        assert all(v <= 0 for v in values), entry
        assert values == sorted(values, reverse=True), f"top_logprobs not sorted: {values}"
        # Greedy: the chosen token is the most likely one.
        assert abs(entry.logprob - values[0]) <= LOGPROB_TOLERANCE, entry
        assert entry.token == top[0].token or abs(values[0] - values[1]) <= LOGPROB_TOLERANCE, entry
    tokens = [e.token for e in content]
    if not any("\ufffd" in t for t in tokens):
        assert "".join(tokens) == choice.message.content


def test_completion_logprobs(client):
    r = complete(client, "def add(a, b):", max_tokens=8, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None, r.choices[0]
    n = r.usage.completion_tokens
    assert len(lp.tokens) == n, (lp.tokens, r.usage)
    assert len(lp.token_logprobs) == n
    assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs), lp.token_logprobs
    assert len(lp.top_logprobs) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Two alternatives keyed by their text: fewer only if two read the same.
        assert 1 <= len(top) <= 2, top
        assert all(v <= 0 for v in top.values()), top
        if len(top) == 2:
            # Greedy: the chosen token is the most likely one. (With one entry, two
            # alternatives read the same and one hid the other.)
            assert abs(chosen - max(top.values())) <= LOGPROB_TOLERANCE, (chosen, top)
    assert len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset)
    if n:
        assert lp.text_offset[0] == 0


# 7. errors


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
    assert caught.value.status_code == 404
    assert "no-such-model" in caught.value.message, caught.value.message


def test_n_above_one_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    assert caught.value.status_code == 400


def test_empty_messages_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [], max_tokens=4)
    assert caught.value.status_code == 400


def test_wrong_api_key_is_401():
    wrong = make_client(api_key="wrong")
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(wrong, [{"role": "user", "content": "hi"}], max_tokens=4)
        assert caught.value.status_code == 401
    finally:
        wrong.close()


def error_code(error):
    if error.code is not None:
        return error.code
    body = error.body if isinstance(error.body, dict) else {}
    return body.get("code") or (body.get("error") or {}).get("code")


def test_prompt_longer_than_the_context_is_400(client):
    # "hello " is about one token; make sure the prompt is well past one request's share
    # of the KV cache, whatever --ctx-size and --parallel the server was started with.
    words = max(5000, 2 * (slot_ctx() or 0))
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "hello " * words}], max_tokens=4)
    assert caught.value.status_code == 400
    assert error_code(caught.value) == "context_length_exceeded", (caught.value.code, caught.value.body)


# 8. max_tokens = 1


def test_max_tokens_one(client):
    r = chat(client, [{"role": "user", "content": STORY}], max_tokens=1)
    assert r.usage.completion_tokens == 1, r.usage
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str)


# 9. tools


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}, "required": ["zone"]},
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris right now? Use celsius."}]


def check_weather_call(call):
    assert call.type == "function", call
    assert call.id, call
    assert call.function.name == "get_weather", call
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_tool_call_round_trip(client):
    r = chat(client, WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    arguments = check_weather_call(choice.message.tool_calls[0])
    call = choice.message.tool_calls[0]
    # The result goes back as a `tool` message; the answer is text.
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "unit": arguments["unit"]})},
    ]
    answer = chat(client, messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=32)
    text = answer.choices[0].message.content
    assert isinstance(text, str) and text.strip(), answer
    assert not answer.choices[0].message.tool_calls
    # The call and its result reached the model: they are in the prompt.
    without = chat(client, WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20, (answer.usage, without.usage)


def test_tool_call_streamed_matches_whole(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice=named, max_tokens=64)
    assert whole.choices[0].finish_reason == "tool_calls"
    [call] = whole.choices[0].message.tool_calls
    check_weather_call(call)
    chunks = list(chat(client, WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice=named, max_tokens=64, stream=True))
    calls = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert list(calls) == [0], calls
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    assert finish_reasons(chunks) == ["tool_calls"]


# 10. structured output


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(client):
    messages = [{"role": "user", "content": "Invent a programmer and describe them."}]
    form = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    whole = chat(client, messages, response_format=form, max_tokens=120)
    assert whole.choices[0].finish_reason == "stop", whole
    value = json.loads(whole.choices[0].message.content)
    jsonschema.validate(value, PERSON)
    chunks = list(chat(client, messages, response_format=form, max_tokens=120, stream=True))
    assert json.loads(chat_stream_text(chunks)) == value
    # With drafted tokens verified on the last stage, the grammar follows only the kept
    # ones: greedy, the same text.
    drafted = chat(client, messages, response_format=form, max_tokens=120, extra_body={"draft": "ngram", "draft_max": 4})
    assert drafted.choices[0].message.content == whole.choices[0].message.content
    # Sampled, not greedy: still valid.
    sampled = chat(client, messages, response_format=form, max_tokens=120, temperature=1.0, seed=7)
    if sampled.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)


def test_json_object_output_is_an_object(client):
    messages = [{"role": "user", "content": "List three colors."}]
    r = chat(client, messages, response_format={"type": "json_object"}, max_tokens=60)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_unenforceable_schema_is_400(client):
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a+$"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "hi"}], response_format=form, max_tokens=4)
    assert "pattern" in caught.value.message


# 11. metrics


def scrape():
    """The server's /metrics through Prometheus' own OpenMetrics parser: {(name, labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(get("/metrics")):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def test_metrics_grow_with_traffic(client):
    before = scrape()
    story = [{"role": "user", "content": STORY}]
    whole = chat(client, story, max_tokens=8)
    streamed = list(chat(client, story, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    after = scrape()
    generated = whole.usage.completion_tokens + streamed[-1].usage.completion_tokens
    assert value(after, "baton_generated_tokens_total") - value(before, "baton_generated_tokens_total") >= generated
    grew = value(after, "baton_requests_total", endpoint="chat", outcome="ok") - value(
        before, "baton_requests_total", endpoint="chat", outcome="ok"
    )
    assert grew == 2, grew
    ttft = value(after, "baton_time_to_first_token_seconds_count") - value(before, "baton_time_to_first_token_seconds_count")
    assert ttft == 2, ttft
    assert value(after, "baton_inter_token_latency_seconds_count") > value(before, "baton_inter_token_latency_seconds_count")
    computed = value(after, "baton_prompt_tokens_total", source="computed") + value(after, "baton_prompt_tokens_total", source="cache")
    assert computed >= whole.usage.prompt_tokens
    assert ("baton_kv_cells_used", (("stage", "0"),)) in after, sorted(after)[:20]
    assert value(after, "baton_queue_depth") == 0
