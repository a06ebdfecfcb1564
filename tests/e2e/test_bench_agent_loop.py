"""`dflash-mac bench --suite agent-loop` as a user runs it: the shipped traces replayed with the
target's own answers by plain decoding, DFlash and DFlash + copies + suffix; greedy answers
identical to plain decoding, the strategy counts, sampled rows, a bad option's one sentence."""

from __future__ import annotations

import json

import pytest

from dflash_mac.bench import agent_loop

from .conftest import one_error

pytestmark = pytest.mark.slow  # starts the installed command


def test_agent_loop_bench_greedy_json_and_markdown(cli, tmp_path):
    out = tmp_path / "loop.jsonl"
    r = cli("bench", "--suite", "agent-loop", "--limit", "2", "-n", "8", "--format", "json",
            "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "tool-calls turn 1:" in r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text()) and agent_loop.validate(doc) == []
    assert doc["kind"] == "agent-loop" and doc["config"]["traces_run"] == [
        "tool-calls",
        "edit-twice",
    ]
    [part] = doc["settings"]
    turns = doc["config"]["turns"]
    assert part["identical"] == {"checked": 2 * turns, "equal": 2 * turns}
    plain, dflash, both = part["rows"]
    assert (plain["row"], dflash["row"], both["row"]) == ("plain", "dflash", "dflash+copy+suffix")
    assert plain["won"]["plain"] == plain["cycles"] and plain["speedup"] == 1.0
    for row in part["rows"]:
        assert row["answers"] == turns and sum(row["won"].values()) == row["cycles"]
    md = cli("bench", "--suite", "agent-loop", "--limit", "1", "-n", "4", "-v")
    assert md.returncode == 0, md.stderr
    assert (
        "Greedy identical 10/10" in md.stdout and "| DFlash + copies + suffix | auto |" in md.stdout
    )
    assert "| tool-calls | 5 | dflash+copy+suffix |" in md.stdout  # -v: every answer


def test_agent_loop_bench_sampled(cli):
    r = cli("bench", "--suite", "agent-loop", "--limit", "1", "-n", "6", "--temp", "0.7")
    assert r.returncode == 0, r.stderr
    assert "## T 0.7" in r.stdout and "not compared" in r.stdout
    assert "| plain decoding | 1 |" in r.stdout and "Greedy identical" not in r.stdout


def test_agent_loop_bench_bad_option_is_one_sentence(cli):
    said = one_error(cli("bench", "--suite", "agent-loop", "-t", "2"))
    assert "--trials does not apply" in said
