"""`dflash-mac serve --max-batch 8` as a user starts it: eight real `openai` clients at once get
the answers each gets alone, some asking their own block size, and edits that copy their source
inside the batch get theirs too (a fresh subprocess on loopback,
bounded in time; the reference BLAS, whose matmuls are row-invariant, so batched rows are
bitwise the rows alone)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import start_serve

pytestmark = pytest.mark.slow  # starts the installed command in a subprocess

QUESTIONS = [
    "Write a Python function that adds two numbers.",
    "What is a list?",
    "def fib(n):",
    "Explain recursion in one line.",
    "Sort [3, 1, 2].",
    "import json",
    "hello",
    "Name three colours.",
]

SIZES = [1, 3, "auto"]

# an edit repeats its source: rows that copy it share the batch with rows that draft
SOURCE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
EDITS = [SOURCE * 3 + SOURCE[:24], "import os", SOURCE * 2 + SOURCE[:30], "class Stack:"]


def ask(root: str, i: int) -> str:
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTIONS[i]}]
    extra = {"ignore_eos": True, "block_size": SIZES[i % 3]}  # rows of three sizes share a batch
    kw = {"max_tokens": 12 + 3 * i, "temperature": 0, "extra_body": extra}
    if i % 2:
        parts = client.chat.completions.create(model="m", messages=messages, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    return (
        client.chat.completions.create(model="m", messages=messages, **kw)
        .choices[0]
        .message.content
    )


def complete(root: str, i: int) -> str:
    """A raw completion (no chat template) of `EDITS[i]`, greedy, to its length."""
    body = {"prompt": EDITS[i], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    return post(root + "/v1/completions", body)["choices"][0]["text"]


def test_eight_concurrent_clients_get_their_solo_answers(cli, tmp_path):
    cli.env["DFLASH_MAC_BLAS"] = "reference"
    srv = start_serve(cli, tmp_path / "serve.out", "--max-batch", "8", "--max-tokens", "64")
    try:
        srv.wait_healthy(60)
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: ask(srv.root, i), range(8)))
        stats = httpx.get(srv.root + "/v1/dflash/stats", timeout=10).json()
        alone = [ask(srv.root, i) for i in range(8)]  # one at a time: each runs alone
        # the size a request ran is in the answer; Ollama's options carry it too
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ran = post(srv.root + "/v1/chat/completions", body | {"block_size": 3})
        ollama = {"model": "m", "messages": body["messages"], "stream": False}
        plain = post(srv.root + "/api/chat", ollama | {"options": {"block_size": 1}})
        refused = httpx.post(srv.root + "/v1/chat/completions", json=body | {"block_size": 99})
        before = httpx.get(srv.root + "/v1/dflash/stats", timeout=10).json()["batch"]
        with ThreadPoolExecutor(4) as pool:  # edits copy their source inside the batch
            edits = list(pool.map(lambda i: complete(srv.root, i), range(4)))
        copies = httpx.get(srv.root + "/v1/dflash/stats", timeout=10).json()["batch"]
        edits_alone = [complete(srv.root, i) for i in range(4)]
    finally:
        srv.stop()
        del cli.env["DFLASH_MAC_BLAS"]
    assert together == alone
    assert all(together)
    assert stats["batch"]["max_batch"] == 8 and stats["batch"]["mean_occupancy"] > 1.5
    assert before["solo_cycles"] > stats["batch"]["solo_cycles"]  # the lone loop ran them
    assert ran["dflash"]["block_size"] == 3 and plain["message"]["content"]
    assert plain["dflash"]["block_size"] == 1 and plain["dflash"]["draft_cycles"] == 0
    assert refused.status_code == 400 and "block_size" in refused.json()["error"]["message"]
    assert edits == edits_alone and all(edits)
    copied = {k: copies[k] - before[k] for k in ("copy_cycles", "copied_tokens")}
    assert 0 < copied["copy_cycles"] < copied["copied_tokens"]  # the edits' copies were taken
    assert copies["prefill_passes"] < copies["prefill_chunks"]  # together: shared passes


def post(url: str, body: dict) -> dict:
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
