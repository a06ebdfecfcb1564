"""The prompt cache across a restart: a `dflash-mac serve` process caches a prompt on disk, a
new process reads it back (same answer, the prefix not prefilled again), `dflash-mac cache ls`
shows it and `cache clear` removes it."""

from __future__ import annotations

import inspect
import json

import httpx
import openai
import pytest

from dflash_mac.prefix import tree as prefix_tree

from .conftest import start_serve

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

PROMPT = inspect.getsource(prefix_tree)[:1500]  # a long shared prefix, as agents send
N = 8


def complete(server, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="dflash-mac", prompt=prompt, max_tokens=N, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def stats(server) -> dict:
    return httpx.get(server.root + "/v1/dflash/stats", timeout=10).json()["prompt_cache"]


def serve(cli, log):
    srv = start_serve(cli, log, "--max-tokens", "64")
    srv.wait_healthy(60)
    return srv


def test_a_restarted_server_reads_the_cached_prefix_from_disk(cli, tmp_path):
    first = serve(cli, tmp_path / "first.out")
    try:
        text, cached = complete(first, PROMPT)
        assert cached == 0
        again, warm = complete(first, PROMPT + text)  # the same conversation, from memory
        assert warm > 0 and stats(first)["hits_ram"] == 1
    finally:
        assert first.terminate() == 0  # SIGTERM: pending files are written first
    listing = cli("cache", "ls")
    assert listing.returncode == 0 and "tiny-code--" in listing.stdout, listing.stderr

    second = serve(cli, tmp_path / "second.out")
    try:
        after, cold_hit = complete(second, PROMPT + text)
        s = stats(second)
        assert after == again and cold_hit == warm
        assert s["hits_disk"] == 1 and s["misses"] == 0 and s["disk_files"] >= 1
        metrics = httpx.get(second.root + "/metrics?format=prometheus", timeout=10).text
        assert "dflash_prompt_cache_hits_disk 1" in metrics.splitlines()
    finally:
        second.terminate()

    cleared = cli("cache", "clear")
    assert cleared.returncode == 0 and "removed 1 pair folder" in cleared.stdout
    assert "no cached prefixes" in cli("cache", "ls").stdout
    bad = cli("cache", "drop")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert json.dumps(bad.stderr.strip().splitlines()[-1:]).count("cache ls") == 1
