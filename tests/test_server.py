"""`dflash-mac serve` end to end: the real `openai` client against uvicorn on loopback."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import running

from dflash_mac.api import generate
from dflash_mac.loading.loader import BUNDLED_DRAFT, load
from dflash_mac.serve.app import create_app

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="session")
def serve_pair(request):
    """The bundled pair once it is built, else the tiny random pair."""
    if (BUNDLED_DRAFT / "config.json").exists():
        return load()
    return request.getfixturevalue("tiny_pair")


@pytest.fixture(scope="session")
def server(serve_pair):
    app = create_app(serve_pair, api_key=KEY, max_tokens=4096)
    with running(app) as root:
        yield {"root": root, "app": app, "pair": serve_pair}


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server["root"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def stats(server) -> dict:
    return httpx.get(server["root"] + "/v1/dflash/stats", headers=AUTH, timeout=10).json()


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(
        model="dflash", messages=[{"role": "user", "content": prompt}], **kw
    )


def test_health_and_models(server, client):
    assert httpx.get(server["root"] + "/health", timeout=10).json()["status"] == "ok"
    models = client.models.list().data
    assert len(models) == 1
    card = models[0].model_dump()
    assert card["context_length"] == server["pair"].context_length
    assert card["id"] == server["app"].state.model_name


def test_chat_greedy_equals_generate(server, client):
    pair, prompt = server["pair"], "Write a function that adds two numbers."
    ref = generate(pair, prompt, max_tokens=16)
    server["app"].state.session.reset()  # an empty prompt cache: nothing of the prompt to reuse
    r = chat(client, prompt, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    ext = r.model_extra["dflash"]
    assert sum(ext["acceptance_histogram"]) == ext["draft_cycles"] <= ext["cycles"]
    assert ext["tau"] >= 1.0


def test_a_request_may_ask_its_own_block_size(client):
    """`block_size` 1 decodes plain (no drafting cycle) and answers as the server's default
    does; past the drafter's trained block is a 400 with one sentence."""
    kw = {"max_tokens": 12, "temperature": 0}
    plain = chat(client, "hello", extra_body={"block_size": 1, "ignore_eos": True}, **kw)
    default = chat(client, "hello", extra_body={"ignore_eos": True}, **kw)
    ext = plain.model_extra["dflash"]
    assert ext["block_size"] == 1 and ext["draft_cycles"] == 0 and ext["cycles"] > 0
    assert plain.choices[0].message.content == default.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="block_size"):
        chat(client, "hello", extra_body={"block_size": 99}, **kw)


def test_chat_stream_with_usage(server, client):
    prompt = "List three prime numbers."
    whole = chat(client, prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(
        chat(
            client,
            prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert "dflash" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_order(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    r = httpx.post(server["root"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4


def test_completions_plain_and_stream(server, client):
    pair, prompt = server["pair"], "def fibonacci(n):"
    ref = generate(pair, prompt, max_tokens=10, ignore_chat_template=True)
    r = client.completions.create(model="dflash", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.tokens)
    chunks = list(
        client.completions.create(
            model="dflash",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens


def test_max_tokens_gives_length(client):
    r = chat(
        client, "Count to one hundred.", max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_stop_sequence(server, client):
    pair, prompt = server["pair"], "Tell me a story."
    free = generate(pair, prompt, max_tokens=24, use_eos=False).text
    stop = next(
        ch
        for i, ch in enumerate(free)
        if i > 0 and ch.isascii() and ch.isprintable() and free.find(ch) > 0
    )
    ref = generate(pair, prompt, max_tokens=24, use_eos=False, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = chat(client, prompt, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text == free[: free.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = chat(
        client, prompt, max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


@pytest.mark.slow
def test_seed_reproducible(server, client):
    kw = {
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.95,
        "extra_body": {"ignore_eos": True, "top_k": 50, "min_p": 0.01},
    }
    a = chat(client, "Say something random.", seed=1234, **kw).choices[0].message.content
    b = chat(client, "Say something random.", seed=1234, **kw).choices[0].message.content
    assert a == b
    ref = generate(
        server["pair"],
        "Say something random.",
        max_tokens=12,
        temp=1.0,
        top_p=0.95,
        top_k=50,
        min_p=0.01,
        seed=1234,
        use_eos=False,
    )
    assert a == ref.text
    others = {
        chat(client, "Say something random.", seed=s, **kw).choices[0].message.content
        for s in (1, 2)
    }
    assert others != {a}


def test_growing_conversation_reuses_prefix(client):
    messages = [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Write hello world in C."},
    ]
    r1 = client.chat.completions.create(model="dflash", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now in Rust."},
    ]
    r2 = client.chat.completions.create(model="dflash", messages=messages, max_tokens=8)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens


@pytest.mark.slow
def test_concurrent_clients(server, client):
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(4)]
    refs = [generate(server["pair"], p, max_tokens=10, use_eos=False).text for p in prompts]

    def ask(i: int) -> str:
        if i % 2:
            chunks = chat(
                client, prompts[i], max_tokens=10, stream=True, extra_body={"ignore_eos": True}
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        r = chat(client, prompts[i], max_tokens=10, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, range(len(prompts)))) == refs
    s = stats(server)
    assert not s["busy"] and s["queued"] == 0


def wait_cancelled(server, before: int) -> dict:
    deadline = time.time() + 30
    while time.time() < deadline:
        s = stats(server)
        if s["totals"]["cancelled"] > before and not s["busy"]:
            break
        time.sleep(0.1)
    assert s["totals"]["cancelled"] == before + 1
    assert s["last"]["finish_reason"] == "cancelled"
    assert 0 < s["last"]["completion_tokens"] < 3000
    return s


def test_disconnect_stops_generation(server, client):
    url = server["root"] + "/v1/chat/completions"
    body = {
        "messages": [{"role": "user", "content": "Write a very long essay."}],
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    before = stats(server)["totals"]["cancelled"]
    with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body, headers=AUTH) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    wait_cancelled(server, before)
    # Non-streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**body, "stream": False}, headers=AUTH, timeout=1.0)
    wait_cancelled(server, before + 1)
    r = chat(client, "Still there?", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        "tools",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}},
        },
        "response_format",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0]"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
            ]
        },
        "messages[0].content",
    ),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_chat_requests(server, body, param):
    r = httpx.post(server["root"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_penalties_and_logit_bias(server, client):
    """Penalised greedy output equals `generate` with the same penalties; a token out of the
    vocabulary in logit_bias is a 400."""
    pair, prompt = server["pair"], "Count: one two one two one two"
    kw = dict(presence_penalty=0.8, frequency_penalty=0.5)
    ref = generate(pair, prompt, max_tokens=16, **kw)
    r = chat(client, prompt, max_tokens=16, temperature=0, **kw)
    assert r.choices[0].message.content == ref.text
    banned = {t: -100.0 for t in ref.tokens[:3]}
    ref_b = generate(pair, prompt, max_tokens=16, logit_bias=banned)
    assert not set(ref_b.tokens) & set(banned)
    r = chat(
        client, prompt, max_tokens=16, temperature=0, logit_bias={str(t): -100 for t in banned}
    )
    assert r.choices[0].message.content == ref_b.text
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, prompt, max_tokens=4, logit_bias={"99999999": 1})
    assert "is not in the vocabulary" in e.value.message


def test_two_conversations_each_reuse_their_prefix(server, client):
    """Alternating two chats: each second turn reports its own first turn as cached."""

    def ask(messages):
        r = client.chat.completions.create(
            model="dflash", messages=messages, max_tokens=8, temperature=0
        )
        return r.choices[0].message.content, r.usage

    a = [{"role": "user", "content": "Write a function that reverses a list."}]
    b = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    text_a, usage_a = ask(a)
    text_b, usage_b = ask(b)
    _, usage_a2 = ask(
        a + [{"role": "assistant", "content": text_a}, {"role": "user", "content": "Shorter."}]
    )
    _, usage_b2 = ask(
        b + [{"role": "assistant", "content": text_b}, {"role": "user", "content": "More."}]
    )
    assert usage_a2.prompt_tokens_details.cached_tokens >= usage_a.prompt_tokens - 1
    assert usage_b2.prompt_tokens_details.cached_tokens >= usage_b.prompt_tokens - 1


def test_prompt_over_context(server, client):
    words = "x " * (server["pair"].context_length + 10)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, words, max_tokens=4)
    assert e.value.code == "context_length_exceeded"


def test_bad_json_and_completion_fields(server, client):
    root = server["root"]
    r = httpx.post(root + "/v1/chat/completions", content=b"{nope", headers=AUTH, timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(root + "/v1/chat/completions", json=[1, 2], headers=AUTH, timeout=10)
    assert r.status_code == 400
    for body in (
        {"prompt": ""},
        {"prompt": ["a", "b"]},
        {"prompt": "x", "echo": True},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "best_of": 3},
        {"prompt": [10**7]},
    ):
        r = httpx.post(root + "/v1/completions", json=body, headers=AUTH, timeout=10)
        assert r.status_code == 400, body
    with pytest.raises(openai.BadRequestError, match="'n'"):
        chat(client, "x", n=3)
    assert httpx.get(root + "/nope", timeout=10).json()["error"]["message"]


def test_api_key(server):
    root = server["root"]
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(root + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(root + "/v1/models", timeout=10).status_code == 401
    bad = openai.OpenAI(base_url=root + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(root + "/health", timeout=10).status_code == 200


def test_metrics(server, client):
    chat(client, "ping", max_tokens=3, extra_body={"ignore_eos": True})
    m = httpx.get(server["root"] + "/metrics", timeout=10).json()
    pair = server["pair"]
    assert m["model_id"] == str(pair.model_id) and m["draft_id"] == str(pair.draft_id)
    assert m["last"]["completion_tokens"] == 3 and m["last"]["decode_tps"] > 0
    assert m["totals"]["completed"] >= 1 and m["memory"]["peak_bytes"] > 0
    text = httpx.get(server["root"] + "/metrics?format=prometheus", timeout=10).text
    assert "dflash_last_tau " in text and 'dflash_info{model="' in text


def test_health_degraded_after_a_failed_generation_then_ok(server, client, monkeypatch):
    session = server["app"].state.session

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "stream", broken)
    before = httpx.get(server["root"] + "/health", timeout=10).json()
    with pytest.raises(openai.InternalServerError, match="generation failed: boom"):
        chat(client, "ping", max_tokens=2)
    health = httpx.get(server["root"] + "/health", timeout=10).json()
    assert health["status"] == "degraded" and health["last_error"] == "generation failed: boom"
    assert health["failed"] == before["failed"] + 1
    assert health["requests"] == before["requests"] + 1
    text = httpx.get(server["root"] + "/metrics?format=prometheus", timeout=10).text
    assert "dflash_degraded 1" in text and f"dflash_failed_total {health['failed']}" in text
    monkeypatch.undo()
    chat(client, "ping", max_tokens=2)
    health = httpx.get(server["root"] + "/health", timeout=10).json()
    assert health["status"] == "ok" and "last_error" not in health
    assert (
        "dflash_degraded 0"
        in httpx.get(server["root"] + "/metrics?format=prometheus", timeout=10).text
    )
