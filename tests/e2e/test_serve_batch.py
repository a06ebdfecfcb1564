"""`dflash-mac serve --max-batch 8` as a user starts it: eight real `openai` clients at once get
the answers each gets alone (a fresh subprocess on loopback, bounded in time; the reference
BLAS, whose matmuls are row-invariant, so batched rows are bitwise the rows alone)."""

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


def ask(root: str, i: int) -> str:
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTIONS[i]}]
    kw = {"max_tokens": 12 + 3 * i, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if i % 2:
        parts = client.chat.completions.create(model="m", messages=messages, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    return (
        client.chat.completions.create(model="m", messages=messages, **kw)
        .choices[0]
        .message.content
    )


def test_eight_concurrent_clients_get_their_solo_answers(cli, tmp_path):
    cli.env["DFLASH_MAC_BLAS"] = "reference"
    srv = start_serve(cli, tmp_path / "serve.out", "--max-batch", "8", "--max-tokens", "64")
    try:
        srv.wait_healthy(60)
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: ask(srv.root, i), range(8)))
        stats = httpx.get(srv.root + "/v1/dflash/stats", timeout=10).json()
        alone = [ask(srv.root, i) for i in range(8)]  # one at a time: a batch of one
    finally:
        srv.stop()
        del cli.env["DFLASH_MAC_BLAS"]
    assert together == alone
    assert all(together)
    assert stats["batch"]["max_batch"] == 8 and stats["batch"]["mean_occupancy"] > 1.5
