"""`logprobs` / `top_logprobs` and structured output (`response_format`, Ollama's `format`) on
`dflash-mac serve`, started as a user starts it and driven by the real `openai` and `ollama`
clients: two servers, one plain (`--block-size 1`) and one with DFlash, give the same
log-probabilities; JSON answers parse and follow their schema; bad schemas are a 400."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ollama
import openai
import pytest

from .conftest import Cli, Server, start_serve

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

PROMPT = "Write a Python function that adds two numbers."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}


def start(cli: Cli, out: Path, *extra: str) -> Server:
    return start_serve(cli, out, "--max-tokens", "128", *extra)


@pytest.fixture(scope="module")
def servers(cli, tmp_path_factory):
    """{"dflash": the default block size, "plain": --block-size 1}."""
    folder = tmp_path_factory.mktemp("lp")
    started = {
        "dflash": start(cli, folder / "dflash.out"),
        "plain": start(cli, folder / "plain.out", "--block-size", "1"),
    }
    try:
        for srv in started.values():
            srv.wait_healthy(90)
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.root + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(srv: Server, **kw):
    kw = {"max_tokens": 24, **kw}
    return client(srv).chat.completions.create(
        model="dflash-mac", messages=[{"role": "user", "content": PROMPT}], temperature=0, **kw
    )


def test_chat_logprobs_are_the_same_with_and_without_dflash(servers):
    """Non-streamed and streamed, DFlash and plain steps: the same tokens, values and top 3;
    the tokens spell the answer, and each top list starts with the most likely token."""
    got = {}
    for name, srv in servers.items():
        r = chat(srv, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        assert "".join(e.token for e in content) == r.choices[0].message.content
        for e in content:
            assert bytes(e.bytes).decode("utf-8", "replace") == e.token and e.logprob <= 0
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
        streamed = [
            e
            for c in chat(srv, logprobs=True, top_logprobs=3, stream=True)
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert [e.token for e in streamed] == [e.token for e in content]
        got[name] = content
    a, b = got["dflash"], got["plain"]
    assert [e.token for e in a] == [e.token for e in b]
    for x, y in zip(a, b):
        assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
    assert chat(servers["dflash"]).choices[0].logprobs is None  # only when asked


def test_completion_logprobs_shape(servers):
    r = client(servers["dflash"]).completions.create(
        model="dflash-mac", prompt="def add(a, b):", max_tokens=12, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    # the tokens spell the text (whose first space this tokenizer's decoder drops)
    assert "".join(lp.tokens).removeprefix(" ") == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    assert all(
        len(top) <= 2 and max(top.values()) >= v
        for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_bad_logprob_requests_are_one_sentence(servers):
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["dflash"], top_logprobs=3)
    assert "'top_logprobs' needs 'logprobs': true." in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["dflash"], logprobs=True, top_logprobs=21)
    assert "'top_logprobs' must be at most 20 (got 21)." in str(e.value)


def valid(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "count", "ok"} and isinstance(obj["ok"], bool)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["count"], int) and 0 <= obj["count"] <= 999
    return obj


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object(servers, stream):
    """The same greedy JSON with DFlash and plain steps, valid against the schema; a
    json_object answer parses."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    texts = []
    for srv in servers.values():
        r = chat(srv, response_format=fmt, max_tokens=100, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        valid(text)
        texts.append(text)
    assert texts[0] == texts[1]
    r = chat(servers["dflash"], response_format={"type": "json_object"}, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by the budget: still the start of an object
        assert r.choices[0].message.content.startswith("{")


def test_invalid_schema_is_a_400(servers):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["dflash"], response_format=bad)
    assert e.value.body["message"] == "the JSON schema is not valid: Invalid type: nope."
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["dflash"], response_format={"type": "xml"})
    assert "'response_format' type must be text, json_object or json_schema." in str(e.value)


def test_ollama_format(servers):
    """Ollama's `format`: a schema and "json", through the real `ollama` client; a bad one is
    a 400 with the sentence."""
    c = ollama.Client(host=servers["dflash"].root, timeout=60)
    msgs = [{"role": "user", "content": PROMPT}]
    opts = {"temperature": 0, "num_predict": 100}
    r = c.chat(model="dflash-mac", messages=msgs, format=SCHEMA, options=opts)
    valid(r.message.content)
    r = c.generate(model="dflash-mac", prompt=PROMPT, format="json", options=opts)
    assert r.response.startswith("{")
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="dflash-mac", messages=msgs, format={"type": "nope"}, options=opts)
    assert e.value.status_code == 400
    assert e.value.error == "the JSON schema is not valid: Invalid type: nope."
