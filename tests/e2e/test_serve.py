"""`dflash-mac serve` started as a user starts it, driven by the real `openai` client.

The server generates on its own thread while the pair was loaded on the main thread; this is
the case that failed every request with "There is no Stream(cpu, 0) in current thread"."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

PROMPT = "Write a Python function that adds two numbers."
N = 8


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.root + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def generated(cli) -> dict:
    """`dflash-mac generate` of the same prompt: chat template (like /v1/chat/completions)
    and raw text (like /v1/completions), greedy."""
    out = {}
    for kind, extra in (("chat", []), ("raw", ["--ignore-chat-template"])):
        r = cli("generate", PROMPT, "-n", str(N), "--temp", "0", "--json", *extra)
        assert r.returncode == 0, r.stderr
        out[kind] = json.loads(r.stdout)
    return out


def test_chat_stream_with_usage_equals_generate(server, client, generated):
    stream = client.chat.completions.create(
        model="dflash-mac",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and not chunks[-1].choices and usage is not None
    # Server and `generate` build the prompt with the same chat-template call, so greedy
    # output is the same text.
    want = generated["chat"]
    assert text == want["text"] and finish == [want["finish_reason"]]
    assert usage.completion_tokens == want["generation_tokens"]
    assert usage.prompt_tokens == want["prompt_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_not_streamed(client, generated):
    r = client.chat.completions.create(
        model="dflash-mac",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N,
        temperature=0,
    )
    want = generated["chat"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.usage.completion_tokens == want["generation_tokens"]


def test_completion_equals_raw_generate(client, generated):
    r = client.completions.create(model="dflash-mac", prompt=PROMPT, max_tokens=N, temperature=0)
    want = generated["raw"]
    assert r.choices[0].text == want["text"] and want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.usage.completion_tokens == want["generation_tokens"]


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["dflash-mac-bundled"]
    client.completions.create(model="dflash-mac", prompt="x", max_tokens=1)
    health = httpx.get(server.root + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["failed"] == 0
    assert health["completed"] == health["requests"] >= 1


def test_sigterm_exits_cleanly_and_removes_the_pid_file(server):
    port = server.root.rsplit(":", 1)[1]
    pid_file = server.home / f"serve-{port}.pid"
    assert int(pid_file.read_text()) == server.proc.pid
    assert server.terminate() == 0, server.output()
    assert not pid_file.exists() and not (server.home / f"serve-{port}.url").exists()
