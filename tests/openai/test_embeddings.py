"""`client.embeddings.create` against a running `baton serve --pooling mean`.

Run by `tests/server.rs` with the other modules of tests/openai (see test_client.py for
the variables). The vectors themselves are checked against libllama and llama-server in
tests/embeddings.rs; here the official client's view: shapes, batches, base64 (the
client's default encoding), token ids, usage and refusals.
"""

import json
import math
import os
import urllib.request

import openai
import pytest

BATON_URL = os.environ.get("BATON_URL", "").rstrip("/")
BATON_API_KEY = os.environ.get("BATON_API_KEY", "")
BATON_MODEL = os.environ.get("BATON_MODEL", "")

if not BATON_URL or not BATON_API_KEY or not BATON_MODEL:
    pytest.fail(
        "BATON_URL, BATON_API_KEY and BATON_MODEL must be set: these tests need a running "
        "`baton serve --pooling mean`; `cargo test --test server` starts one and sets them",
        pytrace=False,
    )

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n", "Hello"]


@pytest.fixture(scope="module")
def client():
    c = openai.OpenAI(base_url=BATON_URL + "/v1", api_key=BATON_API_KEY, max_retries=0, timeout=300.0)
    yield c
    c.close()


def embed(client, input, **kwargs):
    return client.embeddings.create(model=BATON_MODEL, input=input, **kwargs)


def test_one_input_gives_one_unit_vector(client):
    answer = embed(client, TEXTS[0], encoding_format="float")
    assert answer.object == "list"
    assert answer.model == BATON_MODEL
    assert len(answer.data) == 1
    item = answer.data[0]
    assert item.object == "embedding" and item.index == 0
    assert len(item.embedding) == 896, len(item.embedding)
    assert all(isinstance(x, float) for x in item.embedding)
    assert math.isclose(math.sqrt(sum(x * x for x in item.embedding)), 1.0, rel_tol=1e-5)
    assert answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens


def test_a_batch_gives_each_input_its_own_vector(client):
    alone = [embed(client, t, encoding_format="float").data[0].embedding for t in TEXTS]
    batch = embed(client, TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert [d.embedding for d in batch.data] == alone
    assert alone[0] != alone[1]
    single_tokens = sum(embed(client, t).usage.prompt_tokens for t in TEXTS)
    assert batch.usage.prompt_tokens == single_tokens


def test_base64_is_the_same_floats(client):
    # The client asks for base64 unless told otherwise, and decodes it to floats.
    floats = embed(client, TEXTS, encoding_format="float")
    default = embed(client, TEXTS)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = client.embeddings.with_raw_response.create(model=BATON_MODEL, input=TEXTS[2], encoding_format="base64")
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)


def test_token_ids_are_inputs_too(client):
    text = embed(client, TEXTS[2], encoding_format="float")
    request = urllib.request.Request(
        BATON_URL + "/tokenize",
        data=json.dumps({"content": TEXTS[2], "add_special": True}).encode(),
        headers={"Authorization": f"Bearer {BATON_API_KEY}", "Content-Type": "application/json"},
    )
    tokens = json.load(urllib.request.urlopen(request))["tokens"]
    assert len(tokens) == text.usage.prompt_tokens
    one = embed(client, tokens, encoding_format="float")
    assert one.data[0].embedding == text.data[0].embedding
    two = embed(client, [tokens, tokens], encoding_format="float")
    assert [d.embedding for d in two.data] == [text.data[0].embedding] * 2


def test_bad_requests_are_refused_with_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, [])
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "")
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "hi", encoding_format="hex")
    assert "encoding_format" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "hi", dimensions=64)
    assert "dimensions" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, [[1, 2], [10**9]])
    assert "vocabulary" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "word " * 5000)
    assert e.value.code == "context_length_exceeded"
    assert "tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="hi")
