"""`dflash-mac launch -n 2 -- serve`: rank 0 serves HTTP, rank 1 holds half the target; the
real `openai` client gets the same answers streamed or not, also after a cancelled stream (the
ranks' caches stayed in step), and SIGTERM to the launcher stops both ranks with status 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from openai import OpenAI

from .conftest import Cli, Server, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair_server(cli: Cli, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("launch") / "serve.out"
    env = dict(cli.env, DFLASH_MAC_BLAS="reference")
    args = ["launch", "-n", "2", "--timeout", "90", "--", "serve", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [cli.command, *args, "--max-tokens", "64"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    srv = Server(proc, f"http://127.0.0.1:{port}", Path(env["DFLASH_MAC_HOME"]), log)
    try:
        srv.wait_healthy(100)
        yield srv
    finally:
        srv.stop(20)


def test_launched_serve_answers_openai(pair_server):
    client = OpenAI(base_url=pair_server.root + "/v1", api_key="none", timeout=60)
    msgs = [{"role": "user", "content": "Write a function that adds two numbers."}]
    whole = client.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="x", messages=msgs, max_tokens=24, temperature=0, stream=True
    )
    for _ in zip(range(2), stream):  # read two chunks, then hang up mid-answer
        pass
    stream.close()
    again = client.chat.completions.create(
        model="x", messages=msgs, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == text
    assert pair_server.terminate(30) == 0, pair_server.output()
