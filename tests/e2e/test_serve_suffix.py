"""Suffix drafting in `dflash-mac serve`: a second conversation drafts from the first one's
answer (the server's memory of earlier answers; `--no-copy`, so nothing comes from the
request's own text), `--suffix off` drafts nothing from it, and a restarted server reads the
answers its predecessor kept beside the prompt cache's disk tier."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import httpx
import pytest

from .conftest import start_serve

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

CODE = inspect.getsource(json.dumps)[:700]  # the same code in both conversations
N = 48


def complete(server, prompt: str) -> dict:
    r = httpx.post(
        server.root + "/v1/completions",
        json={"model": "dflash-mac", "prompt": prompt, "max_tokens": N, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def serve(cli, log, *args):
    srv = start_serve(cli, log, "--max-tokens", "64", "--block-size", "4", "--no-copy", *args)
    srv.wait_healthy(60)
    return srv


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.root + "/metrics?format=prometheus", timeout=10).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines())}


def test_a_second_conversation_drafts_from_the_first_answer(cli, tmp_path):
    on = serve(cli, tmp_path / "on.out", "--suffix", "on")
    try:
        first = complete(on, "# conversation one\n" + CODE)
        second = complete(on, "# another conversation, the same file\n" + CODE)
        a, b = first["choices"][0]["text"], second["choices"][0]["text"]
        assert first["dflash"]["suffix_cycles"] == 0  # nothing earlier to draft from
        assert b[:40] == a[:40], "the tiny pair must answer the same code alike for this test"
        assert second["dflash"]["suffix_cycles"] > 0
        assert second["dflash"]["suffix_tokens"] > second["dflash"]["suffix_cycles"]
        m = metrics(on)
        assert m["dflash_suffix_cycles_total"] == second["dflash"]["suffix_cycles"]
        assert m["dflash_suffix_memory_answers"] == 2 and m["dflash_suffix_memory_tokens"] > 0
    finally:
        assert on.terminate() == 0  # SIGTERM: the answers are kept at shutdown

    again = serve(cli, tmp_path / "again.out", "--suffix", "on")
    try:
        assert metrics(again)["dflash_suffix_memory_answers"] == 2  # read back from disk
        log = re.search(r"log (\S+)\)", again.output()).group(1)
        assert "suffix drafting: 2 earlier answers" in Path(log).read_text()
        third = complete(again, "# a third conversation, after a restart\n" + CODE)
        assert third["choices"][0]["text"] == b and third["dflash"]["suffix_cycles"] > 0
    finally:
        again.stop()

    off = serve(cli, tmp_path / "off.out", "--suffix", "off")
    try:
        fourth = complete(off, "# with suffix drafting off\n" + CODE)
        assert fourth["choices"][0]["text"][:40] == b[:40]
        assert fourth["dflash"]["suffix_cycles"] == 0
    finally:
        off.stop()


def test_a_bad_suffix_value_is_one_sentence(cli):
    res = cli("serve", "--suffix", "maybe")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "on or off" in res.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_every_front_end_takes_suffix_on_or_off(cli, command):
    args = [command, "--suffix", "sometimes"] + (["hello"] if command == "generate" else [])
    res = cli(*args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "on or off" in res.stderr


def test_generate_with_suffix_drafting_on(cli):
    res = cli("generate", "--suffix", "on", "-n", "12", "-v", "def add(a, b):")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
