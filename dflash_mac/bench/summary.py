"""Aggregation of bench records (pure functions on plain records, tested on synthetic
data): token-weighted tok/s per trial, mean ± std over trials, a bootstrap interval of the
speedup, the lossless check."""

from __future__ import annotations

import random

from dflash_mac.engine.stats import (
    drafter_cycles,
    drafting,
    histogram,
    mean_std,
    position_acceptance,
    survival,
)
from dflash_mac.settings import AUTO

from .run import Run


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def trial_tps(runs: list[Run]) -> float:
    """Decode tok/s of a set of runs: Σ decode tokens ÷ Σ decode time (token-weighted)."""
    t = sum(r.decode_time for r in runs)
    return sum(r.decode_tokens for r in runs) / t if t > 0 else 0.0


def speedup_interval(
    records: list[dict],
    block_size: int,
    level: float = 0.95,
    resamples: int = 2000,
    over: int | None = None,
) -> list[float]:
    """A bootstrap interval of the pooled speedup (Σ tokens ÷ Σ seconds, DFlash at
    `block_size` over the baseline, or over DFlash at block size `over`): the (trial, prompt)
    records resampled with replacement, each keeping its runs together (they ran back to back,
    so they share the machine's mood). Seeded: the same records give the same interval."""
    pairs = []
    for r in records:
        b = r["baseline"] if over is None else r["dflash"][over]
        d = r["dflash"][block_size]
        pairs.append((b.decode_tokens, b.decode_time, d.decode_tokens, d.decode_time))
    if not pairs:
        return [0.0, 0.0]
    rng = random.Random(0)
    out = []
    for _ in range(resamples if len(pairs) > 1 else 1):
        bn, bt, dn, dt = (sum(col) for col in zip(*rng.choices(pairs, k=len(pairs))))
        out.append(dn * bt / (dt * bn) if bn > 0 and dt > 0 else 0.0)
    out.sort()
    tail = (1 - level) / 2
    return [out[int(tail * len(out))], out[min(int((1 - tail) * len(out)), len(out) - 1)]]


def summarize(records: list[dict], block_size: int, suite: str, greedy: bool) -> dict:
    """One report row: the records' baseline vs DFlash at `block_size`.

    Speeds are token-weighted per trial, then mean ± sample std over trials; speedup is
    DFlash ÷ baseline per trial. τ is the mean per request, then the mean over requests. The
    histogram, survival and per-position acceptance pool all cycles; `speedup_ci` is a 95 %
    bootstrap interval over the (trial, prompt) pairs (`speedup_interval`)."""
    trials = sorted({r["trial"] for r in records})
    base_t, dfl_t, speed_t = [], [], []
    for t in trials:
        rs = [r for r in records if r["trial"] == t]
        b = trial_tps([r["baseline"] for r in rs])
        d = trial_tps([r["dflash"][block_size] for r in rs])
        base_t.append(b)
        dfl_t.append(d)
        speed_t.append(d / b if b > 0 else 0.0)
    base = [r["baseline"] for r in records]
    dfl = [r["dflash"][block_size] for r in records]
    lengths = [a for r in dfl for a in r.acceptance_lengths]
    taus = [r.tau for r in dfl if r.acceptance_lengths]
    checks = [r["dflash"][block_size].tokens == r["baseline"].tokens for r in records]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    sizes = [b for r in dfl for b in r.block_sizes]
    copied = [c for r in dfl for c in (r.copied or [False] * len(r.acceptance_lengths))]
    # the drafter's own cycles: copies apart (older records: no sizes, no copies)
    own, per_cycle = drafter_cycles(lengths, sizes, copied)
    drafted = drafting(own, per_cycle)
    # auto: up to the widest drafter block it chose (a 17-token copy is not a block)
    width = max(per_cycle or [1]) if block_size == AUTO else block_size
    mix = {b: (per_cycle or []).count(b) for b in sorted(set(per_cycle or []))}
    return {
        "block_size": block_size,
        "block_mix": {str(b): n for b, n in mix.items()},  # the drafter's blocks
        "copy_cycles": sum(copied),
        "host_ms_per_cycle": 1000 * sum(r.host_time for r in dfl) / max(len(lengths), 1),
        "suite": suite,
        "prompts": len({r["id"] for r in records}),
        "trials": len(trials),
        "runs": len(records),
        "baseline_tps": list(mean_std(base_t)),
        "dflash_tps": list(mean_std(dfl_t)),
        "speedup": list(mean_std(speed_t)),
        "speedup_ci": speedup_interval(records, block_size),
        "tau": list(mean_std(taus)),
        # η = speedup ÷ τ: the share of τ turned into speed (1 ÷ a cycle's cost in baseline steps)
        "eta": mean(speed_t) / mean(taus) if taus and speed_t else 0.0,
        "cycles": len(lengths),
        "draft_cycles": len(drafted),
        "histogram": histogram(drafted, width),
        "survival": survival(drafted, width),
        "position_acceptance": position_acceptance(own, width, per_cycle),
        "baseline_prefill_tps": mean([r.prefill_tps for r in base]),
        "dflash_prefill_tps": mean([r.prefill_tps for r in dfl]),
        "baseline_ttft_ms": 1000 * mean([r.ttft for r in base]),
        "dflash_ttft_ms": 1000 * mean([r.ttft for r in dfl]),
        "baseline_peak_bytes": max((r.peak_memory for r in base), default=0),
        "dflash_peak_bytes": max((r.peak_memory for r in dfl), default=0),
        "baseline_tokens": sum(len(r.tokens) for r in base),
        "dflash_tokens": sum(len(r.tokens) for r in dfl),
        "lossless_equal": sum(checks) if greedy else None,
        "lossless_checked": len(checks) if greedy else None,
    }


def summary_rows(records: list[dict], block_sizes: list[int], greedy: bool) -> list[dict]:
    """Rows per block size: one per suite, plus `all` when several suites ran."""
    suites = list(dict.fromkeys(r["suite"] for r in records))
    groups = [(s, [r for r in records if r["suite"] == s]) for s in suites]
    if len(suites) > 1:
        groups.append(("all", records))
    return [summarize(rs, bs, s, greedy) for bs in block_sizes for s, rs in groups]


LENGTH_BUCKETS = (0, 256, 1000, 1200, 1400, 1600, 1800)  # prompt-token bucket lower edges


def length_rows(records: list[dict], block_sizes: list[int]) -> list[dict]:
    """Speedup against prompt length: per (block size, prompt-length bucket), the records'
    DFlash vs baseline decode tok/s pooled over trials (Σ tokens ÷ Σ seconds), and τ."""
    out = []
    edges = [*LENGTH_BUCKETS, float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        rs = [r for r in records if lo <= r["prompt_tokens"] < hi]
        if not rs:
            continue
        base = trial_tps([r["baseline"] for r in rs])
        for bs in block_sizes:
            runs = [r["dflash"][bs] for r in rs]
            taus = [r.tau for r in runs if r.acceptance_lengths]
            sizes = [b for r in runs for b in r.block_sizes]
            out.append(
                {
                    "block_size": bs,
                    "min_prompt_tokens": min(r["prompt_tokens"] for r in rs),
                    "max_prompt_tokens": max(r["prompt_tokens"] for r in rs),
                    "prompts": len({r["id"] for r in rs}),
                    "baseline_tps": base,
                    "dflash_tps": trial_tps(runs),
                    "speedup": trial_tps(runs) / base if base > 0 else 0.0,
                    "tau": sum(taus) / len(taus) if taus else 0.0,
                    "plain_share": sizes.count(1) / len(sizes) if sizes else 0.0,
                }
            )
    return out


def auto_vs_fixed(records: list[dict], block_sizes: list[int]) -> list[dict]:
    """`auto` against each fixed size on the same (trial, prompt) runs: the pooled ratio of
    decode tok/s (auto ÷ fixed) and its 95 % bootstrap interval. Empty without auto and a
    fixed size."""
    if AUTO not in block_sizes:
        return []
    auto = trial_tps([r["dflash"][AUTO] for r in records])
    out = []
    for bs in (b for b in block_sizes if b != AUTO):
        fixed = trial_tps([r["dflash"][bs] for r in records])
        out.append(
            {
                "block_size": bs,
                "ratio": auto / fixed if fixed > 0 else 0.0,
                "ci": speedup_interval(records, AUTO, over=bs),
            }
        )
    return out


def best_block_size(rows: list[dict]) -> int | None:
    """The block size with the highest DFlash decode tok/s over all prompts."""
    pool = [r for r in rows if r["suite"] == "all"] or rows
    return max(pool, key=lambda r: r["dflash_tps"][0])["block_size"] if pool else None


def mismatches(records: list[dict]) -> list[dict]:
    """Greedy lossless failures: (prompt, trial, block size, first differing index)."""
    out = []
    for r in records:
        for bs, run in r["dflash"].items():
            i = first_diff(run.tokens, r["baseline"].tokens)
            if i is not None:
                out.append({"id": r["id"], "trial": r["trial"], "block_size": bs, "first_diff": i})
    return out


EVEN = 0.02  # one run, no interval: within 2 % of plain speed is a tie


def verdict(rows: list[dict]) -> dict | None:
    """Which decodes faster on this machine: the best DFlash row (the suites pooled when
    several ran) against plain decoding. `winner` is "dflash" or "plain" when the 95 %
    interval of the speedup lies above or below 1×, else "even"."""
    pool = [r for r in rows if r["suite"] == "all"] or rows
    if not pool:
        return None
    best = max(pool, key=lambda r: r["speedup"][0])
    speedup = best["speedup"][0]
    ci = best.get("speedup_ci") if best["runs"] >= 2 else None
    lo, hi = ci if ci else (speedup - EVEN, speedup + EVEN)
    winner = "dflash" if lo > 1 else "plain" if hi < 1 else "even"
    return {"winner": winner, "block_size": best["block_size"], "speedup": speedup, "ci": ci}
