"""`dflash-mac bench`: statistics on synthetic cycles, report formats and schema, prompt
suites, the runner on a tiny pair, and a computed (not assumed) lossless column."""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from dflash_mac.api import prompt_ids
from dflash_mac.bench import agent as agent_bench
from dflash_mac.bench import agent_loop, concurrency, summary
from dflash_mac.bench import command as bench_command
from dflash_mac.bench import inputs as bench_inputs
from dflash_mac.bench import report as bench_report
from dflash_mac.bench import run as bench
from dflash_mac.bench.inputs import BenchError, BenchPrompt
from dflash_mac.bench.run import BenchConfig, Run
from dflash_mac.cli import app
from dflash_mac.engine import drafts as engine
from dflash_mac.engine.stats import (
    DecodeStats,
    drafting,
    histogram,
    mean_std,
    position_acceptance,
    survival,
)
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.loading.loader import BUNDLED_DRAFT

# -- synthetic data ---------------------------------------------------------------------


def run(
    n_tokens: int, decode_time: float, lengths=(), bs=None, tokens=None, ttft=0.01, peak=1000
) -> Run:
    toks = list(tokens) if tokens is not None else list(range(n_tokens))
    return Run(toks, 10, ttft, decode_time, peak, "length", bs, list(lengths))


def record(pid: str, trial: int, base: Run, dflash: dict[int, Run], suite="s") -> dict:
    return {
        "id": pid,
        "suite": suite,
        "trial": trial,
        "position": 0,
        "prompt_tokens": 10,
        "baseline": base,
        "dflash": dflash,
    }


def synthetic_records() -> list[dict]:
    """Two prompts × two trials; baseline 100 / 50 tok/s per trial, DFlash 4 tokens per
    cycle pattern with a known histogram."""
    recs = []
    for trial, (bt, dt) in enumerate([(1.0, 0.5), (2.0, 0.5)]):
        # 101 tokens → 100 decode tokens per prompt.
        recs.append(
            record(
                "a",
                trial,
                run(101, bt),
                {4: run(101, dt, [4, 4, 2, 1], bs=4, ttft=0.02, peak=1500)},
            )
        )
        recs.append(
            record("b", trial, run(101, bt), {4: run(101, dt, [3, 1], bs=4, ttft=0.02, peak=1200)})
        )
    return recs


def test_stats_helpers_on_synthetic_cycles():
    lengths = [4, 4, 2, 1, 3, 1]
    assert histogram(lengths, 4) == [2, 1, 1, 2]
    assert survival(lengths, 4) == [1.0, 4 / 6, 3 / 6, 2 / 6]
    # draft position 1 accepted in cycles with A >= 2 (4 of 6); position 2 given 1: 3 of 4 …
    assert position_acceptance(lengths, 4) == [4 / 6, 3 / 4, 2 / 3]
    assert mean_std([2.0, 4.0]) == (3.0, pytest.approx(2**0.5))
    assert mean_std([5.0]) == (5.0, 0.0)


def test_position_acceptance_counts_only_the_positions_each_cycle_drafted():
    # auto: plain steps (size 1) draft nothing; a block of 5 that kept all 4 drafts says
    # nothing about position 5; a block of 2 nothing about position 2
    lengths, sizes = [1, 1, 3, 5, 1, 2], [1, 1, 5, 5, 3, 2]
    assert position_acceptance(lengths, 5, sizes) == [3 / 4, 2 / 2, 1 / 2, 1 / 1]
    # the same cycles taken as all of size 5 read as rejections (what the bench once printed)
    assert position_acceptance(lengths, 5) == [3 / 6, 2 / 3, 1 / 2, 1 / 1]
    stats = DecodeStats(5, acceptance_lengths=tuple(lengths), auto=True, block_sizes=tuple(sizes))
    assert stats.position_acceptance == [3 / 4, 2 / 2, 1 / 2, 1 / 1]
    assert position_acceptance([1, 1], 4, [1, 1]) == [0.0, 0.0, 0.0]  # nothing drafted
    # the histogram and survival are those of the drafting cycles; τ stays tokens per cycle
    assert stats.histogram == [1, 1, 1, 0, 1] and stats.draft_cycles == 4
    assert stats.survival == [1.0, 3 / 4, 2 / 4, 1 / 4, 1 / 4] and stats.plain_steps == 2
    assert stats.tau == pytest.approx(13 / 6)
    assert drafting(lengths, sizes) == [3, 5, 1, 2] and drafting(lengths) == lengths
    assert stats.as_dict()["draft_cycles"] == 4 and stats.as_dict()["cycles"] == 6
    recs = synthetic_records()
    for r, (lens, bss) in zip(recs, [(lengths, sizes), ([2, 1], [2, 1])] * 2):
        r["dflash"][bench_inputs.AUTO] = Run(
            list(range(101)), 10, 0.01, 0.5, 1000, "length", bench_inputs.AUTO, lens, bss
        )
    row = summary.summarize(recs, bench_inputs.AUTO, "s", greedy=True)
    assert row["position_acceptance"] == pytest.approx([8 / 10, 4 / 4, 2 / 4, 2 / 2])
    assert row["cycles"] == 16 and row["draft_cycles"] == 10
    assert row["histogram"] == [2, 4, 2, 0, 2]  # 1: the two rejected blocks, not the plain steps
    md = bench_report.render(
        bench_report.build_report(HEADER, CONFIG, recs, [bench_inputs.AUTO], greedy=True), "md"
    )
    assert "### Acceptance, block size auto (16 cycles, 6 of them plain steps, τ" in md


def test_copies_are_not_drafter_blocks_in_the_acceptance_pictures():
    """Issue 55: an auto run whose copies verified 17 tokens drew a 17-row histogram of zeros;
    copies are counted apart and the pictures end at the widest drafter block."""
    recs = synthetic_records()
    lengths, sizes = [1, 3, 12, 2, 17, 1], [1, 5, 17, 4, 17, 1]
    copied = [False, False, True, False, True, False]
    for r in recs:
        r["dflash"][bench_inputs.AUTO] = Run(
            list(range(101)), 10, 0.01, 0.5, 1000, "length", bench_inputs.AUTO, lengths,
            sizes, copied=copied,
        )  # fmt: skip
    row = summary.summarize(recs, bench_inputs.AUTO, "s", greedy=True)
    assert len(row["histogram"]) == 5 and row["histogram"] == [0, 4, 4, 0, 0]
    assert row["copy_cycles"] == 8 and row["block_mix"] == {"1": 8, "4": 4, "5": 4}
    assert sum(row["block_mix"].values()) + row["copy_cycles"] == row["cycles"] == 24
    run_dict = recs[0]["dflash"][bench_inputs.AUTO].as_dict()
    assert len(run_dict["histogram"]) == 5 and run_dict["copy_cycles"] == 2
    uncopied = summary.summarize(synthetic_records(), 4, "s", greedy=True)
    assert uncopied["copy_cycles"] == 0 and len(uncopied["histogram"]) == 4  # the control


def test_the_verdict_says_whether_plain_decoding_wins():
    """Issue 55: "Best block size: auto" was printed when every speedup was below 1×."""
    row = {"suite": "s", "runs": 4, "block_size": "auto"}
    slow = [{**row, "speedup": [0.9, 0.0], "speedup_ci": [0.85, 0.95]}]
    assert summary.verdict(slow)["winner"] == "plain"
    fast = [*slow, {**row, "block_size": 8, "speedup": [1.3, 0.0], "speedup_ci": [1.1, 1.5]}]
    assert summary.verdict(fast) | {"ci": None} == {
        "winner": "dflash", "block_size": 8, "speedup": 1.3, "ci": None,
    }  # fmt: skip
    even = [{**row, "speedup": [1.05, 0.0], "speedup_ci": [0.9, 1.2]}]
    assert summary.verdict(even)["winner"] == "even"
    one = [{**row, "runs": 1, "speedup": [0.97, 0.0], "speedup_ci": [0.97, 0.97]}]
    assert summary.verdict(one)["winner"] == "plain"  # one run: 2 % from 1× decides
    doc = bench_report.build_report(HEADER, CONFIG, synthetic_records(), [4], greedy=True)
    brief = bench_report.to_markdown(doc, brief=True)
    assert "DFlash is 3.00× faster than plain decoding" in brief.splitlines()[2]
    assert "acceptance" not in brief.lower() and len(brief.splitlines()) < 15


def test_run_decode_tps_excludes_first_token():
    r = run(11, 0.5, [3, 3, 4], bs=4)
    assert r.decode_tokens == 10
    assert r.decode_tps == pytest.approx(20.0)
    assert r.tau == pytest.approx(10 / 3)
    assert r.prefill_tps == pytest.approx(10 / 0.01)
    assert run(1, 0.0).decode_tps == 0.0


def test_speedup_interval_separates_a_speedup_from_noise():
    import random

    rng = random.Random(1)

    def records(speedup: float, noise: float) -> list[dict]:
        out = []
        for i in range(30):  # baseline 100 tok/s; both runs of a pair share the pair's mood
            mood = rng.uniform(0.8, 1.2)
            d = mood / speedup * rng.uniform(1 - noise, 1 + noise)
            out.append(record(f"p{i}", 0, run(101, mood), {4: run(101, d, bs=4)}))
        return out

    lo, hi = summary.speedup_interval(same := records(1.0, 0.05), 4)
    assert lo < 1.0 < hi and hi - lo < 0.05
    assert summary.speedup_interval(same, 4) == [lo, hi]  # seeded
    lo, hi = summary.speedup_interval(records(2.0, 0.05), 4)
    assert 1.9 < lo < 2.0 < hi < 2.1  # excludes 1 and brackets the true 2
    # with 20 % noise per run it still holds the true speedup in most of 40 experiments
    # (95 % nominal)
    held = 0
    for _ in range(40):
        lo, hi = summary.speedup_interval(records(1.5, 0.2), 4, resamples=400)
        held += lo <= 1.5 <= hi
    assert held >= 32


def test_auto_against_each_fixed_size_on_the_same_runs():
    """The report compares auto with every fixed size pair by pair: a ratio and its interval
    (a clear 10 % loss is not within noise; a tie brackets 1); nothing without auto."""
    import random

    rng = random.Random(2)
    recs = []
    for i in range(30):
        mood = rng.uniform(0.8, 1.2)  # the three runs of a prompt share the machine's mood
        a, b, c = (mood * rng.uniform(0.97, 1.03) for _ in range(3))
        runs = {
            bench_inputs.AUTO: run(101, a * 0.5, bs=bench_inputs.AUTO),
            5: run(101, b * 0.45, bs=5),
            8: run(101, c * 0.5, bs=8),
        }
        recs.append(record(f"p{i}", 0, run(101, mood), runs))
    five, eight = summary.auto_vs_fixed(recs, [bench_inputs.AUTO, 5, 8])
    assert five["block_size"] == 5 and 0.85 < five["ci"][0] < five["ratio"] < five["ci"][1] < 0.95
    assert eight["ci"][0] < 1.0 < eight["ci"][1] and eight["ratio"] == pytest.approx(1.0, abs=0.02)
    assert summary.auto_vs_fixed(recs, [5, 8]) == []
    config = {**CONFIG, "block_sizes": [bench_inputs.AUTO, 5, 8]}
    doc = bench_report.build_report(HEADER, config, recs, [bench_inputs.AUTO, 5, 8], greedy=False)
    assert doc["auto_vs_fixed"] == [five, eight] and bench_report.validate(doc) == []
    assert "auto ÷ block 5 on the same runs: **0.9" in bench_report.to_markdown(doc)


def test_trial_tps_is_token_weighted():
    assert summary.trial_tps([run(11, 1.0), run(101, 1.0)]) == pytest.approx(55.0)


def test_summarize_synthetic():
    row = summary.summarize(synthetic_records(), 4, "s", greedy=True)
    assert row["prompts"] == 2 and row["trials"] == 2 and row["runs"] == 4
    assert row["baseline_tps"] == [pytest.approx(75.0), pytest.approx(25 * 2**0.5)]
    assert row["dflash_tps"] == [pytest.approx(200.0), 0.0]
    assert row["speedup"] == [pytest.approx(3.0), pytest.approx(2**0.5)]
    # τ: mean per request (11/4 and 2), then over requests — not the pooled 15/6.
    assert row["tau"][0] == pytest.approx((11 / 4 + 2) / 2)
    assert row["eta"] == pytest.approx(3.0 / ((11 / 4 + 2) / 2))  # speedup ÷ τ
    assert row["cycles"] == 12
    assert row["histogram"] == [4, 2, 2, 4]
    assert row["survival"] == pytest.approx([1.0, 8 / 12, 6 / 12, 4 / 12])
    assert row["position_acceptance"] == pytest.approx([8 / 12, 6 / 8, 4 / 6])
    assert row["baseline_ttft_ms"] == pytest.approx(10.0)
    assert row["dflash_peak_bytes"] == 1500
    assert (row["lossless_equal"], row["lossless_checked"]) == (4, 4)
    assert summary.summarize(synthetic_records(), 4, "s", greedy=False)["lossless_checked"] is None


def test_rows_best_block_size_and_mismatches():
    recs = synthetic_records()
    for r in recs:
        r["dflash"][2] = run(101, 1.0, [2] * 50, bs=2)
    recs[1]["suite"] = recs[3]["suite"] = "t"
    recs[3]["dflash"][2] = run(101, 1.0, [2] * 50, bs=2, tokens=[0, 1, 9] + list(range(3, 101)))
    rows = summary.summary_rows(recs, [2, 4], greedy=True)
    assert [(r["block_size"], r["suite"]) for r in rows] == [
        (2, "s"),
        (2, "t"),
        (2, "all"),
        (4, "s"),
        (4, "t"),
        (4, "all"),
    ]
    assert summary.best_block_size(rows) == 4
    assert rows[2]["lossless_equal"] == 3
    assert summary.mismatches(recs) == [{"id": "b", "trial": 1, "block_size": 2, "first_diff": 2}]
    assert summary.first_diff([1, 2], [1, 2, 3]) == 2 and summary.first_diff([1], [1]) is None


# -- report formats and schema ------------------------------------------------------------

HEADER = {
    "machine": "x86_64",
    "cpu": "test cpu",
    "cpu_count": 2,
    "os": "Linux",
    "mlx": "0",
    "mlx_lm": "0",
    "device": "cpu",
    "blas": "OpenBLAS",
    "python": "3",
    "target": "t",
    "draft": "d",
    "drafter_kind": "DFlash",
    "target_quantization": "none",
    "draft_quantization": "none",
    "dtype": "float32",
    "target_weight_bytes": 10,
    "drafter_weight_bytes": 100,
    "date": "today",
    "dflash_mac": "0.1.0",
}
CONFIG = {
    "suite": "math",
    "prompts_file": None,
    "limit": None,
    "trials": 2,
    "max_tokens": 101,
    "block_sizes": [4],
    "temp": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": 0,
    "use_eos": True,
    "reasoning": None,
    "draft_bits": None,
    "cooldown_s": 0.0,
}


@pytest.fixture
def doc():
    return bench_report.build_report(HEADER, CONFIG, synthetic_records(), [4], greedy=True)


def test_json_report_passes_schema(doc):
    assert bench_report.validate(doc) == []
    loaded = json.loads(bench_report.render(doc, "json"))
    assert bench_report.validate(loaded) == []
    p = loaded["prompts"][0]
    assert p["dflash"][0]["acceptance_lengths"] == [4, 4, 2, 1]
    assert p["dflash"][0]["histogram"] == [1, 1, 0, 2]
    assert p["dflash"][0]["lossless"] is True and len(p["baseline"]["tokens"]) == 101
    assert loaded["lossless"] == {"checked": 4, "equal": 4, "mismatches": []}


def test_one_trial_shows_no_spread():
    one = [r for r in synthetic_records() if r["trial"] == 0]
    doc = bench_report.build_report(HEADER, {**CONFIG, "trials": 1}, one, [4], greedy=True)
    md = bench_report.render(doc, "md")
    # no spread over trials to show; the interval over the prompts is all 2.00
    assert "| 4 | s | 2 | 100.0 | 200.0 | 2.00× [2.00, 2.00] | 2.38 |" in md and "± 0.0" not in md


def test_live_view_progress_bar_has_its_own_line():
    """The bar ends its line: the stats header starts the next one instead of overlapping."""
    from rich.console import Console

    from dflash_mac.bench.view import BenchView

    console = Console(width=100, color_system=None, force_terminal=True, record=True)
    view = BenchView(console, 12, [4, 8], live=False)
    view.done_prompts = 3
    console.print(view.render())
    lines = console.export_text().splitlines()
    bar = next(i for i, line in enumerate(lines) if "━" in line)
    assert set(lines[bar].strip("│ ")) <= set("━╸╺")
    assert lines[bar + 1].split("│")[1].split() == [
        "block",
        "τ",
        "DFlash",
        "tok/s",
        "baseline",
        "tok/s",
        "speedup",
    ]


def test_schema_validator_catches_errors(doc):
    bad = json.loads(json.dumps(doc))
    del bad["rows"][0]["tau"]
    bad["header"]["blas"] = 3
    bad["prompts"][0]["dflash"][0]["histogram"] = ["x"]
    errors = bench_report.validate(bad)
    assert any("missing 'tau'" in e for e in errors)
    assert any("header.blas" in e for e in errors)
    assert any("histogram[0]" in e for e in errors)


def test_markdown_report(doc):
    md = bench_report.render(doc, "md")
    assert "| bs | suite | prompts | baseline t/s | DFlash t/s | speedup | τ |" in md
    assert "| 4 | s | 2 | 75.0 ± 35.4 | 200.0 ± 0.0 | 3.00× ± 1.41 [2.00, 4.00] | 2.38 |" in md
    assert "95 % bootstrap interval of the pooled speedup" in md
    assert "| 4/4 |" in md and "BLAS OpenBLAS" in md and "tokens after the first" in md
    assert "  1 │" in md and "P(A ≥ k)" in md
    # η = 3.00 / 2.375 and its inverse, the cost of a cycle in baseline steps
    assert "(12 cycles, τ 2.38, η 1.26: a cycle costs 0.79 baseline steps)" in md


def test_jsonl_and_csv_reports(doc):
    lines = bench_report.render(doc, "jsonl").splitlines()
    assert len(lines) == len(doc["rows"]) == 1
    flat = json.loads(lines[0])
    assert flat["dflash_tps_mean"] == pytest.approx(200.0) and flat["blas"] == "OpenBLAS"
    rows = list(csv.DictReader(io.StringIO(bench_report.render(doc, "csv"))))
    assert len(rows) == 1
    assert float(rows[0]["speedup_mean"]) == pytest.approx(3.0)
    assert (flat["speedup_ci_low"], flat["speedup_ci_high"]) == (2.0, 4.0)
    assert flat["eta"] == pytest.approx(3.0 / 2.375)
    assert rows[0]["histogram"] == "4 2 2 4" and rows[0]["lossless_equal"] == "4"


def test_out_appends_jsonl(doc, tmp_path):
    path = tmp_path / "sub" / "results.jsonl"
    bench_report.append_jsonl(path, doc)
    bench_report.append_jsonl(path, doc)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and bench_report.validate(json.loads(lines[1])) == []


def test_lossless_failure_is_reported_in_markdown(doc):
    recs = synthetic_records()
    recs[0]["dflash"][4].tokens[5] = 999
    d = bench_report.build_report(HEADER, CONFIG, recs, [4], greedy=True)
    assert d["lossless"]["equal"] == 3 and d["lossless"]["mismatches"][0]["first_diff"] == 5
    md = bench_report.render(d, "md")
    assert "3/4 ✗" in md and "Lossless check failed" in md


# -- options and prompts ------------------------------------------------------------------


def test_parse_block_sizes_and_format():
    assert bench_inputs.parse_block_sizes("5") == [5]
    assert bench_inputs.parse_block_sizes("8,2, 3,2") == [2, 3, 8]
    assert bench_inputs.parse_block_sizes(None) is None
    for bad in ("2,x", "0", "3,-1", "2,,3"):
        with pytest.raises(BenchError, match="block-size"):
            bench_inputs.parse_block_sizes(bad)
    with pytest.raises(BenchError, match="--format must be one of"):
        bench_inputs.check_format("yaml")


def test_shipped_suites():
    for name in ("math", "chat"):
        ps = bench_inputs.suite_prompts(name)
        assert len(ps) >= 16 and len({p.id for p in ps}) == len(ps)
        assert all(p.suite == name and p.prompt[0]["role"] == "user" for p in ps)


def test_code_suite_missing_falls_back_clearly(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_inputs, "code_suite_path", lambda: tmp_path / "none.jsonl")
    warnings = []
    ps = bench_inputs.suite_prompts("code", warnings.append)
    assert {p.suite for p in ps} == {"math"}
    assert "code suite" in warnings[0] and "missing" in warnings[0]
    assert {p.suite for p in bench_inputs.suite_prompts("all", warnings.append)} == {"math", "chat"}


def test_read_prompts_errors(tmp_path):
    with pytest.raises(BenchError, match="does not exist"):
        bench_inputs.read_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{nope\n')
    with pytest.raises(BenchError, match="line 2 is not valid JSON"):
        bench_inputs.read_prompts(bad)
    bad.write_text('{"messages": []}\n')
    with pytest.raises(BenchError, match="line 1 needs"):
        bench_inputs.read_prompts(bad)
    bad.write_text("\n")
    with pytest.raises(BenchError, match="holds no prompts"):
        bench_inputs.read_prompts(bad)
    good = tmp_path / "mine.jsonl"
    good.write_text(
        '{"prompt": "hi"}\n{"id": "x", "messages": [{"role": "user", "content": "yo"}]}\n'
    )
    ps = bench_inputs.read_prompts(good)
    assert [(p.id, p.suite) for p in ps] == [("mine-1", "mine"), ("x", "mine")]


# -- the runner on a tiny pair ------------------------------------------------------------


def test_runner_measures_baseline_and_dflash(tiny_pair):
    """Baseline = mlx-lm greedy decoding; DFlash via an oracle drafter (30% wrong) gives
    1 < τ ≤ bs, equal tokens, and the cycle callback sees every cycle."""
    ids = tiny_pair.tokenizer.encode("def add(a, b):")
    ref = [t for t, _ in generate_step(mx.array(ids), tiny_pair.target, max_tokens=24)]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, 1))
    cfg = BenchConfig([2, 4], max_tokens=24, trials=2, use_eos=False, warmup_tokens=4)
    seen: list[tuple[int, int, int]] = []

    class Obs(bench.Observer):
        def cycle(self, bs, accepted, size):
            seen.append((bs, accepted, size))

    prompts = [BenchPrompt("p", "s", "unused")]
    records = bench.run_bench(pair, prompts, [ids], cfg, Obs())
    assert len(records) == 2
    for rec in records:
        assert rec["baseline"].tokens == ref
        for bs in (2, 4):
            r = rec["dflash"][bs]
            assert r.tokens == ref and sum(r.acceptance_lengths) == 23
            assert r.decode_tps > 0 and r.ttft > 0 and r.peak_memory > 0
    assert len(seen) == sum(len(r["dflash"][b].acceptance_lengths) for r in records for b in (2, 4))
    assert [s for b, _, s in seen if b == 4] == [
        s for r in records for s in r["dflash"][4].block_sizes
    ]
    row = summary.summarize(records, 4, "s", greedy=True)
    assert 1.0 < row["tau"][0] <= 4 and row["lossless_equal"] == 2


@pytest.mark.slow
def test_seeded_shuffle_is_reproducible(tiny_pair):
    ids = [tiny_pair.tokenizer.encode(s) for s in ("a", "b", "c", "d")]
    prompts = [BenchPrompt(s, "s", s) for s in "abcd"]
    cfg = BenchConfig([2], max_tokens=2, trials=2, seed=3, warmup_tokens=1)
    orders = [[r["id"] for r in bench.run_bench(tiny_pair, prompts, ids, cfg)] for _ in range(2)]
    assert orders[0] == orders[1]
    assert sorted(orders[0][:4]) == sorted(orders[0][4:]) == list("abcd")
    assert orders[0][:4] != list("abcd") or orders[0][4:] != list("abcd")


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_run_orders_are_balanced_for_slot_and_predecessor(n):
    rows = bench.balanced_orders(n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    for slot in range(n):  # every configuration in every slot equally often
        assert Counter(r[slot] for r in rows) == Counter({c: len(rows) // n for c in range(n)})
    follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_the_bench_runs_configurations_in_balanced_orders(tiny_pair):
    """A run right after another one on the same prompt comes out a little faster: baseline
    and block sizes run in balanced orders, so that no configuration always follows another."""
    ids = [tiny_pair.tokenizer.encode(s) for s in "abcdef"]
    prompts = [BenchPrompt(s, "s", s) for s in "abcdef"]
    cfg = BenchConfig([2, 3], max_tokens=2, trials=1, warmup_tokens=1)
    starts = []

    class Order(bench.Observer):
        def start(self, bp, trial, index, bs):
            starts.append(bs or 0)

    bench.run_bench(tiny_pair, prompts, ids, cfg, Order())
    runs = [tuple(starts[i : i + 3]) for i in range(0, 18, 3)]
    assert sorted(runs) == sorted(itertools.permutations([0, 2, 3]))


# -- the command --------------------------------------------------------------------------

runner = CliRunner()


def cli(tiny_dirs, *args):
    t, d = tiny_dirs
    return runner.invoke(
        app,
        [
            "bench",
            "-m",
            str(t),
            "-d",
            str(d),
            "--suite",
            "math",
            "--limit",
            "2",
            "-t",
            "1",
            "--max-tokens",
            "8",
            "--no-live",
            *(args if "--temp" in args else (*args, "--temp", "0")),
        ],
    )


@pytest.mark.slow
def test_cli_json_and_out(tiny_dirs, tmp_path):
    out = tmp_path / "r.jsonl"
    res = cli(tiny_dirs, "-b", "2,3", "-f", "json", "--out", str(out), "-v")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert bench_report.validate(doc) == []
    assert doc["config"]["block_sizes"] == [2, 3] and doc["best_block_size"] in (2, 3)
    assert doc["lossless"]["checked"] == 4 and doc["lossless"]["equal"] == 4
    assert len(doc["prompts"]) == 2 and "acceptance histogram" in res.stderr
    assert json.loads(out.read_text().splitlines()[0])["schema"] == bench_report.SCHEMA_ID


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["md", "csv", "jsonl"])
def test_cli_formats(tiny_dirs, fmt):
    res = cli(tiny_dirs, "-b", "3", "-f", fmt)
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert {"md": "# dflash-mac bench", "csv": "machine,cpu"}.get(fmt, "{") in first


def lossy_accept(drafts, logits):
    """A deliberately lossy verifier: commits every draft token without checking it."""
    return mx.array(drafts.shape[0]), mx.argmax(logits[-1])


def test_lossy_drafter_path_fails_strict(tiny_dirs, monkeypatch):
    monkeypatch.setattr(engine, "accept_greedy", lossy_accept)
    res = cli(tiny_dirs, "-b", "4", "--strict")
    assert res.exit_code == 1
    assert "lossless check failed" in res.stderr and "differ from the baseline" in res.stderr
    assert "✗" in res.stdout
    res = cli(tiny_dirs, "-b", "4", "-f", "json")
    assert res.exit_code == 0 and "warning" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["lossless"]["equal"] < doc["lossless"]["checked"] == 2
    assert doc["prompts"][0]["dflash"][0]["lossless"] is False


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--block-size", "2,x"], "--block-size must be auto, an integer"),
        (["-f", "yaml"], "--format must be one of"),
        (["--prompts", "/nonexistent/p.jsonl"], "does not exist"),
        (["--suite", "poetry"], "--suite must be one of"),
    ],
)
def test_cli_errors_are_one_sentence(monkeypatch, capsys, args, msg):
    from dflash_mac import cli as cli_mod

    monkeypatch.setenv("DFLASH_MAC_BLAS", "reference")
    monkeypatch.setattr("sys.argv", ["dflash-mac", "bench", *args])
    with pytest.raises(SystemExit) as e:
        cli_mod.main()
    assert e.value.code == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the console width
    assert err.startswith("error: ") and msg in err and "Traceback" not in err
    assert err.count(".") - err.count("..") <= 3 and err.endswith(".")


def test_rerender_saved_report(doc, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(bench_report.render(doc, "json"))
    bench_report.main([str(path)])
    assert capsys.readouterr().out == bench_report.render(doc, "md")
    bench_report.main([str(path), "csv"])
    assert capsys.readouterr().out == bench_report.render(doc, "csv")


# -- the bundled pair and committed results -----------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_committed_results_pass_schema():
    # every bench report (the soak's summary has its own format: tests/e2e/test_soak.py)
    files = sorted(
        f for f in (ROOT / "bench" / "results").glob("*.json*") if "-soak." not in f.name
    )
    if not files:
        pytest.skip("no committed bench results")
    for f in files:
        docs = (
            [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            if f.suffix == ".jsonl"
            else [json.loads(f.read_text())]
        )
        for d in docs:
            if d.get("kind") == "agent":  # bench --suite agent: its own document
                assert agent_bench.validate(d) == [], f
                assert d["total"]["identical"] == d["total"]["turns"], f
                continue
            if d.get("kind") == "agent-loop":  # bench --suite agent-loop: its own document
                assert agent_loop.validate(d) == [], f
                assert agent_loop.differing(d) == 0, f
                continue
            if d.get("kind") == "concurrency":  # bench --concurrency: its own document
                assert concurrency.validate(d) == [], f
                for row in d["rows"]:  # greedy batched answers equal the ones alone
                    same, n = row.get("identical", "0/0").split("/")
                    assert same == n, (f, row["setting"], row["concurrency"])
                continue
            assert bench_report.validate(d) == [], f
            assert d["lossless"]["equal"] == d["lossless"]["checked"], f


@pytest.mark.slow
@pytest.mark.skipif(not (BUNDLED_DRAFT / "config.json").exists(), reason="no bundled pair")
def test_bundled_pair_default_bench_json():
    """The default command on the bundled pair (shortened): JSON passes the schema, lossless."""
    res = runner.invoke(
        app, ["bench", "--limit", "2", "-t", "1", "--max-tokens", "16", "--no-live", "-f", "json"]
    )
    assert res.exit_code == 0, res.output
    doc, sampled = json.loads(res.stdout)  # greedy, then the pair's recommended sampling
    assert bench_report.validate(doc) == [] and bench_report.validate(sampled) == []
    assert doc["config"]["setting"] == "greedy" and doc["config"]["temp"] == 0
    # the bundled target's generation_config.json does not sample: T = 0.7
    assert sampled["config"]["temp"] == 0.7 and "recommended" in sampled["config"]["setting"]
    assert sampled["lossless"]["checked"] is None and not sampled["config"]["seeded_dflash"]
    assert doc["header"]["target"] == "bundled/target"
    assert doc["config"]["suite"] == "code" and doc["rows"][0]["suite"] == "code"
    assert [r["block_size"] for r in doc["rows"]] == ["auto", 8]  # auto and the pair's size
    assert doc["lossless"]["equal"] == doc["lossless"]["checked"] == 4
    assert doc["rows"][1]["tau"][0] > 1.0 and doc["rows"][0]["tau"][0] >= 1.0


# -- settings, prompt length, the long suite ----------------------------------------------


@pytest.mark.parametrize(
    "gen,expected",
    [
        ({}, SamplingParams(0.7)),
        ({"do_sample": False, "temperature": 0.6}, SamplingParams(0.7)),
        ({"temperature": 0.6, "top_p": 0.95, "top_k": 20}, SamplingParams(0.6, 0.95, 20)),
        ({"do_sample": True, "temperature": 1.0, "top_p": 7}, SamplingParams(1.0)),
    ],
)
def test_recommended_sampling_reads_the_generation_config(gen, expected):
    from types import SimpleNamespace

    from dflash_mac.api import recommended_sampling

    pair = SimpleNamespace(generation_config=gen)
    assert recommended_sampling(pair) == expected
    labels = [label for label, _ in bench_command.sampling_settings(pair, None, None, None, 0.0)]
    assert labels[0] == "greedy" and "recommended" in labels[1]
    sps = bench_command.sampling_settings(pair, [0.0, 1.0], 0.9, None, 0.0)
    assert [sp for _, sp in sps] == [SamplingParams(0.0, 0.9), SamplingParams(1.0, 0.9)]


@pytest.mark.parametrize("text", ["x", "0,-1", "0.7,,1"])
def test_bad_temperature_lists_are_one_sentence(text):
    with pytest.raises(bench_inputs.BenchError, match="--temp must be"):
        bench_command.parse_temps(text)


def test_sampled_dflash_runs_go_unseeded_unless_asked():
    cfg = bench.BenchConfig([0], temp=0.7)
    assert bench.dflash_seed(cfg, 5) is None
    assert bench.dflash_seed(replace(cfg, seeded_dflash=True), 5) == 5
    assert bench.dflash_seed(replace(cfg, temp=0.0), 5) == 5


def test_speedup_against_prompt_length():
    recs = []
    for i, n in enumerate([300, 1100, 1150, 1700]):
        base = run(11, 1.0)
        dfl = run(11, 0.5 if n < 1500 else 2.0, [2, 3, 1], bs=bench_inputs.AUTO)
        recs.append(record(f"p{i}", 0, base, {bench_inputs.AUTO: dfl}) | {"prompt_tokens": n})
    rows = summary.length_rows(recs, [bench_inputs.AUTO])
    assert [(r["min_prompt_tokens"], r["max_prompt_tokens"]) for r in rows] == [
        (300, 300),
        (1100, 1150),
        (1700, 1700),
    ]
    assert [round(r["speedup"], 2) for r in rows] == [2.0, 2.0, 0.5]
    assert rows[1]["prompts"] == 2 and rows[0]["tau"] == 2.0
    doc = bench_report.build_report(HEADER, CONFIG, recs, [bench_inputs.AUTO], True)
    assert bench_report.validate(doc) == [] and len(doc["by_length"]) == 3
    assert "Speedup against prompt length" in bench_report.render(doc, "md")
    one = bench_report.build_report(HEADER, CONFIG, recs[1:3], [bench_inputs.AUTO], True)
    assert one["by_length"] == []  # one bucket: nothing to compare


@pytest.mark.skipif(not (BUNDLED_DRAFT / "config.json").exists(), reason="no bundled pair")
def test_long_suite_fills_the_bundled_context():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(BUNDLED_DRAFT.parent / "target")
    ps = bench_inputs.suite_prompts("long")
    lengths = [len(prompt_ids(tok, p.prompt)) for p in ps]
    assert len(ps) >= 10 and all(1000 <= n <= 1900 for n in lengths)
    assert max(lengths) - min(lengths) >= 700  # spread over the range
    assert "long" not in {p.suite for p in bench_inputs.suite_prompts("all")}


def test_runs_stop_at_the_end_of_the_context(tiny_pair):
    """A prompt near the end of the context generates only up to it, baseline and DFlash
    alike (the one context rule), instead of running past the positions the model has."""
    ids = tiny_pair.tokenizer.encode("def add(a, b):")
    short = replace(tiny_pair, target_config={"max_position_embeddings": len(ids) + 5})
    cfg = BenchConfig(
        [bench_inputs.AUTO, 3], max_tokens=24, trials=1, use_eos=False, warmup_tokens=2
    )
    (rec,) = bench.run_bench(short, [BenchPrompt("p", "s", "unused")], [ids], cfg)
    assert len(rec["baseline"].tokens) == 5
    assert [len(r.tokens) for r in rec["dflash"].values()] == [5, 5]
    assert all(r.tokens == rec["baseline"].tokens for r in rec["dflash"].values())


def test_cli_runs_openblas_on_every_core_unless_told_otherwise(monkeypatch, tmp_path):
    """The OpenBLAS re-exec asks for one thread per core (measured faster on a 2-core Xeon),
    unless the user chose a thread count."""
    from dflash_mac import host as plat

    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    seen = {}
    monkeypatch.setattr(plat, "find_openblas", lambda: str(lib))
    monkeypatch.setattr(plat.os, "execve", lambda exe, argv, env: seen.update(env))
    monkeypatch.setattr(plat.os, "cpu_count", lambda: 8)
    for key in ("LD_PRELOAD", "_DFLASH_MAC_REEXEC", "OPENBLAS_NUM_THREADS", "DFLASH_MAC_BLAS"):
        monkeypatch.delenv(key, raising=False)
    plat.maybe_reexec_with_openblas(["bench"])
    assert seen["OPENBLAS_NUM_THREADS"] == "8" and str(lib) in seen["LD_PRELOAD"]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    plat.maybe_reexec_with_openblas(["generate"])
    assert seen["OPENBLAS_NUM_THREADS"] == "3"
