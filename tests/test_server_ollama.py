"""The Ollama-compatible API, driven by the official `ollama` Python client."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from servers import running

from dflash_mac.api import generate
from dflash_mac.serve.app import create_app

N = 6
PROMPT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def server(tiny_pair):
    app = create_app(tiny_pair, max_tokens=32)
    with running(app) as root:
        yield {"root": root, "app": app, "pair": tiny_pair}


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server["root"], timeout=60)


@pytest.fixture(scope="module")
def name(server) -> str:
    return server["app"].state.model_name + ":latest"


def test_version_list_show_ps(server, client, name):
    assert httpx.get(server["root"] + "/api/version", timeout=5).json()["version"]
    assert "running" in httpx.get(server["root"] + "/", timeout=5).text
    models = client.list().models
    assert [m.model for m in models] == [name]
    assert models[0].details.family == "qwen3" and models[0].size > 0
    shown = client.show(name)
    pair = server["pair"]
    assert shown.modelinfo["qwen3.context_length"] == pair.context_length
    assert shown.template == pair.tokenizer.chat_template
    assert shown.capabilities == ["completion"]  # ChatML without tools
    running = client.ps().models
    assert running[0].model == name and running[0].context_length == pair.context_length
    # any name, as the generation routes take any (clients use `dflash-mac`)
    assert client.show("llama3:8b").modelinfo == shown.modelinfo
    assert shown.details.quantization_level == "F32"  # the tiny pair: float32 weights


def test_chat_equals_generate(server, client, name):
    ref = generate(server["pair"], PROMPT, max_tokens=N, use_eos=False)
    opts = {"temperature": 0, "num_predict": N}
    messages = [{"role": "user", "content": PROMPT}]
    with_eos = generate(server["pair"], PROMPT, max_tokens=N)
    r = client.chat(model=name, messages=messages, options=opts, keep_alive="5m")
    assert r.message.role == "assistant" and r.message.content == with_eos.text
    assert r.done and r.prompt_eval_count == ref.prompt_tokens
    assert r.eval_count == len(with_eos.tokens) and r.total_duration > 0
    assert r.done_reason == ("length" if with_eos.finish_reason == "length" else "stop")
    parts = list(client.chat(model=name, messages=messages, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == with_eos.text
    assert [p.done for p in parts][-1] and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == r.eval_count


def test_generate_template_and_raw(server, client, name):
    pair = server["pair"]
    opts = {"temperature": 0, "num_predict": N}
    ref = generate(pair, PROMPT, max_tokens=N)
    r = client.generate(model=name, prompt=PROMPT, options=opts)
    assert r.response == ref.text and r.prompt_eval_count == ref.prompt_tokens
    raw = generate(pair, PROMPT, max_tokens=N, ignore_chat_template=True)
    parts = list(client.generate(model=name, prompt=PROMPT, raw=True, options=opts, stream=True))
    assert "".join(p.response for p in parts) == raw.text
    assert parts[-1].done and parts[-1].eval_count == len(raw.tokens)
    system = generate(
        pair,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        max_tokens=N,
    )
    r = client.generate(model=name, prompt=PROMPT, system="Be brief.", options=opts)
    assert r.response == system.text
    loaded = client.generate(model=name, prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_options(server, client, name):
    pair = server["pair"]
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "seed": 7}
    ref = generate(pair, PROMPT, max_tokens=N, temp=1.0, top_p=0.9, top_k=40, min_p=0.02, seed=7)
    r = client.generate(model=name, prompt=PROMPT, options={**sampled, "num_predict": N})
    assert r.response == ref.text
    free = generate(pair, PROMPT, max_tokens=24, use_eos=False).text
    stop = next(ch for i, ch in enumerate(free) if i > 0 and ch.isascii() and ch.isprintable())
    want = generate(pair, PROMPT, max_tokens=24, use_eos=False, stop=[stop])
    r = client.generate(
        model=name, prompt=PROMPT, options={"temperature": 0, "num_predict": 24, "stop": [stop]}
    )
    assert r.response == want.text and r.done_reason == "stop"
    # num_ctx caps the context: the prompt plus 2 tokens
    cap = {"temperature": 0, "num_predict": 20, "num_ctx": ref.prompt_tokens + 2}
    r = client.generate(model=name, prompt=PROMPT, options=cap)
    assert r.eval_count <= 2
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name, prompt=PROMPT, options={"num_ctx": 4})
    assert e.value.status_code == 400 and "context" in e.value.error


def test_bad_requests(server, client, name):
    root = server["root"]
    for path, body, words in (
        (
            "/api/chat",
            {"model": name, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "images",
        ),
        ("/api/generate", {"model": name, "prompt": "x", "format": "xml"}, "format"),
        ("/api/generate", {"model": name, "prompt": "x", "suffix": "y"}, "suffix"),
        (
            "/api/generate",
            {"model": name, "prompt": "x", "options": {"temperature": "hot"}},
            "temperature",
        ),
        ("/api/generate", {"model": name, "prompt": "x", "options": {"mirostat": 2}}, "mirostat"),
        (
            "/api/chat",
            {
                "model": name,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tools",
        ),
    ):
        r = httpx.post(root + path, json=body, timeout=10)
        assert r.status_code == 400, r.text
        assert words in json.dumps(r.json()["error"])
