"""`dflash-mac bench --suite agent` as a user runs it: transcripts replayed through the prompt
cache, cold / memory / disk answers identical, later turns reusing earlier ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_mac.bench import agent as agent_bench

pytestmark = pytest.mark.slow  # starts the installed command

TRANSCRIPTS = Path(__file__).resolve().parent.parent / "data" / "agent_tiny.json"


def test_agent_bench_reports_every_turn(cli, tmp_path):
    out = tmp_path / "agent.jsonl"
    r = cli("bench", "--suite", "agent", "--prompts", str(TRANSCRIPTS), "-n", "12",
            "--format", "json", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "disk tier is off" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text()) and agent_bench.validate(doc) == []
    turns = doc["turns"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [
        ("add", 1), ("sub", 1), ("add", 2), ("sub", 2)
    ]  # fmt: skip
    assert all(t["identical"] for t in turns)
    first, second = turns[0], turns[1]
    assert first["reused_warm"] == 0 and 0 < second["reused_warm"] < second["prompt_tokens"]
    for later in turns[2:]:  # the conversation so far, from memory and, restarted, from disk
        assert later["reused_warm"] == later["reused_disk"] > first["prompt_tokens"]
    md = cli("bench", "--suite", "agent", "--prompts", str(TRANSCRIPTS), "-n", "4", "--limit", "1")
    assert md.returncode == 0 and "| add | 2 |" in md.stdout and "| sub |" not in md.stdout
    bad = cli("bench", "--suite", "agent", "--prompts", str(tmp_path / "none.json"))
    assert bad.returncode != 0 and "agent transcripts file" in bad.stderr
    assert "Traceback" not in bad.stderr
