"""`bench --suite agent-loop` (dflash_mac/bench/agent_loop.py): the shipped traces, their
deterministic replay with the target's own answers, greedy rows identical to plain decoding,
the report's rows and strategy counts, and bad options as one sentence before any model loads.
On the tiny random pair, a few tokens per answer."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mac.bench import agent_loop
from dflash_mac.bench.inputs import BenchError
from dflash_mac.cli import app
from dflash_mac.engine.stats import DecodeStats
from dflash_mac.errors import is_user_error
from dflash_mac.sizing.tuning import AutoTuning

# two short traces (the tiny pair's tokenizer has one token per byte)
SMALL = {
    "system": 'Tools: read_file(path). Call one as {"name": ..., "arguments": {...}}.',
    "traces": [
        {
            "id": "read",
            "turns": [
                {"role": "user", "content": "Read src/a.py."},
                {"role": "tool", "content": "def f(x):\n    return x + 1\n"},
                {"role": "user", "content": "Rename f to g. Show the whole file."},
            ],
        },
        {
            "id": "fix",
            "system": "You fix failing tests.",
            "turns": [
                {"role": "user", "content": "Run tests/test_a.py."},
                {"role": "tool", "content": "FAILED tests/test_a.py::test_f - assert 2 == 3"},
            ],
        },
    ],
}


def replay(pair, doc, setting, limit=None, rows=None):
    rows = rows or agent_loop.modes("auto")
    return agent_loop.replay(pair, doc, setting, rows, AutoTuning, limit)


def test_the_shipped_traces_parse():
    doc = agent_loop.read_traces()
    traces = doc["traces"]
    assert 4 <= len(traces) <= 6 and doc["system"]
    assert {"tool-calls", "edit-twice", "plan", "fix-tests"} <= {t["id"] for t in traces}
    roles = {turn["role"] for t in traces for turn in t["turns"]}
    assert roles == {"user", "tool"}  # the assistant turns are the target's own, not stored
    assert all(turn["content"].isascii() for t in traces for turn in t["turns"])


def check_replays(pair, doc, rows=None) -> None:
    """Two greedy replays give the same tokens, and every row's answers are plain's."""
    setting = agent_loop.Setting(max_tokens=4)
    first, second = replay(pair, doc, setting, rows=rows), replay(pair, doc, setting, rows=rows)
    key = [(a.trace, a.turn, a.row) for a in first]
    assert key == [(a.trace, a.turn, a.row) for a in second]
    assert [a.tokens for a in first] == [a.tokens for a in second]
    assert {a.trace for a in first} == {t["id"] for t in doc["traces"]}
    assert len(first) == len(rows or "abc") * sum(len(t["turns"]) for t in doc["traces"])
    assert all(a.identical for a in first if a.row != "plain")
    # one session per row: later turns reuse the conversation so far
    later = [a for a in first if a.turn > 1]
    assert later and all(0 < a.reused_tokens < a.prompt_tokens for a in later)


def test_traces_replay_deterministically_and_greedy_rows_equal_plain(tiny_pair):
    check_replays(tiny_pair, SMALL)


@pytest.mark.slow  # ~10k prompt tokens a row on the tiny pair's byte tokenizer
def test_every_shipped_trace_replays_deterministically(tiny_pair):
    plain, _, both = agent_loop.modes("auto")
    check_replays(tiny_pair, agent_loop.read_traces(), [plain, both])


def test_the_rows_share_nothing_and_keep_one_tuning_each(tiny_pair):
    made: list[AutoTuning] = []

    def tuning() -> AutoTuning:
        made.append(AutoTuning())
        return made[-1]

    rows = agent_loop.modes("auto")
    agent_loop.replay(tiny_pair, SMALL, agent_loop.Setting(max_tokens=3), rows, tuning)
    assert len(made) == 3 and len({id(t) for t in made}) == 3  # one per row, for every trace


def test_report_has_the_rows_and_strategy_counts(tiny_pair):
    setting = agent_loop.Setting(max_tokens=6)
    parts = agent_loop.run_suite(tiny_pair, SMALL, [setting], "auto", AutoTuning)
    config = agent_loop.config_doc(SMALL, None, None, "auto", setting)
    doc = agent_loop.report({"target": "t", "draft": "d"}, config, parts)
    assert agent_loop.validate(doc) == []
    assert agent_loop.validate(json.loads(json.dumps(doc))) == []
    [part] = doc["settings"]
    rows = {r["row"]: r for r in part["rows"]}
    assert list(rows) == ["plain", "dflash", "dflash+copy+suffix"]
    assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["tau"] == 1.0
    for r in rows.values():
        assert sum(r["won"].values()) == r["cycles"] > 0
        assert r["answers"] == 5 and r["generation_tokens"] <= 5 * 6
    assert rows["plain"]["won"]["plain"] == rows["plain"]["cycles"]
    assert rows["dflash"]["won"]["copy"] == rows["dflash"]["won"]["suffix"] == 0  # copies off
    assert part["identical"] == {"checked": 10, "equal": 10} and agent_loop.differing(doc) == 0
    md = agent_loop.agent_loop_markdown(doc)
    assert "Greedy identical 10/10" in md
    for label in ("plain decoding", "| DFlash |", "DFlash + copies + suffix"):
        assert label in md
    assert "| drafter | copy | suffix | plain |" in md
    full = agent_loop.agent_loop_markdown(doc, brief=False)
    assert "| read | 2 | dflash+copy+suffix |" in full and "| fix | 2 | plain |" in full


def test_sampled_rows_are_not_compared(tiny_pair):
    setting = agent_loop.Setting(max_tokens=4, temp=0.7)
    answers = replay(tiny_pair, SMALL, setting, limit=1)
    assert {a.trace for a in answers} == {"read"} and len(answers) == 9
    part = agent_loop.setting_doc(setting, answers, agent_loop.modes())
    assert part["identical"] is None and part["setting"] == "T 0.7"
    assert all(r["identical"] is None for r in part["rows"])
    assert "not compared" in agent_loop.identical_line(part)


def test_a_differing_answer_is_named():
    part = {
        "setting": "greedy",
        "identical": {"checked": 2, "equal": 1},
        "answers": [
            {"trace": "read", "turn": 1, "row": "dflash", "identical": True},
            {"trace": "read", "turn": 2, "row": "dflash", "identical": False},
        ],
    }
    line = agent_loop.identical_line(part)
    assert line.startswith("Greedy identical 1/2") and "read turn 2, dflash" in line


def test_strategies_count_each_cycle_once():
    s = DecodeStats(
        8,
        acceptance_lengths=(3, 5, 1, 4, 2),
        block_sizes=(8, 6, 1, 5, 8),
        copied=(False, True, False, True, False),
        suffixed=(False, False, False, True, False),
        trees=(0, 0, 0, 0, 8),
    )
    assert agent_loop.strategies(s) == {"drafter": 2, "copy": 1, "suffix": 1, "plain": 1}


def test_a_trace_longer_than_the_context_is_one_sentence(tiny_pair):
    from dataclasses import replace

    short = replace(tiny_pair, target_config={"max_position_embeddings": 64})
    with pytest.raises(BenchError, match="more than the model's 64-token context"):
        replay(short, SMALL, agent_loop.Setting(max_tokens=2))


def test_bad_traces_files(tmp_path):
    bad = tmp_path / "t.json"
    for text, why in [
        ("{", "Expecting"),
        ('{"traces": []}', "no traces"),
        ('{"traces": [{"id": "a", "turns": [{"role": "assistant", "content": "x"}]}]}', "role"),
        ('{"traces": [{"id": "a", "turns": []}, {"id": "a", "turns": []}]}', "one id"),
    ]:
        bad.write_text(text)
        with pytest.raises(BenchError, match="not an agent-loop traces file") as e:
            agent_loop.read_traces(bad)
        assert why in str(e.value)


@pytest.mark.parametrize(
    "args, says",
    [
        (["-t", "2"], "--trials does not apply"),
        (["--copy"], "--copy/--no-copy and --suffix do not apply"),
        (["--suffix", "on"], "--copy/--no-copy and --suffix do not apply"),
        (["-f", "csv"], "writes md or json"),
        (["-b", "auto,4"], "one DFlash block size"),
        (["-b", "1"], "block 1 is its plain row"),
        (["--temp", "0.7", "--top-p", "2"], "top"),
        (["--concurrency", "2"], "not agent-loop"),
    ],
)
def test_bad_options_fail_before_loading(args, says, monkeypatch):
    def no_load(*a, **k):  # the check comes first: a typo never waits for the model
        raise AssertionError("loaded a model")

    monkeypatch.setattr("dflash_mac.cli.terminal.load_pair", no_load)
    res = CliRunner().invoke(app, ["bench", "--suite", "agent-loop", *args])
    assert res.exit_code != 0 and is_user_error(res.exception), res.output
    assert says in str(res.exception), res.output
