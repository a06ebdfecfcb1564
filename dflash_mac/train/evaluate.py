"""Held-out evaluation of a pair with the real runtime: τ, per-position acceptance, speedup.

    python -m dflash_mac.train.evaluate --model T --draft D --prompts P.jsonl \\
        --block-sizes 5,8 --max-tokens 256

Greedy DFlash (`dflash_mac.decode.speculative_stream`) against the same process's plain target
decoding (mlx-lm `generate_step`, no hooks), both warmed up, same prompts and max tokens, both
stopping at EOS. Decode speed counts the tokens after the first over the time after the first
(prefill excluded on both sides). Every prompt's committed ids must equal the baseline's.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from dflash_mac.pair import Pair
from dflash_mac.stats import histogram, position_acceptance, survival


@dataclass
class EvalResult:
    block_size: int
    prompts: int
    tau: float  # mean over requests of the per-request mean committed per cycle
    position_acceptance: list[float]
    survival: list[float]
    histogram: list[int]
    identical: int  # prompts whose DFlash ids equal the baseline's
    dflash_tokens: int = 0
    dflash_time: float = 0.0
    baseline_tokens: int = 0
    baseline_time: float = 0.0
    per_prompt_tau: list[float] = field(default_factory=list)

    @property
    def dflash_tps(self) -> float:
        return self.dflash_tokens / self.dflash_time if self.dflash_time else 0.0

    @property
    def baseline_tps(self) -> float:
        return self.baseline_tokens / self.baseline_time if self.baseline_time else 0.0

    @property
    def speedup(self) -> float:
        return self.dflash_tps / self.baseline_tps if self.baseline_tps else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(dflash_tps=self.dflash_tps, baseline_tps=self.baseline_tps, speedup=self.speedup)
        return d


def baseline_run(pair: Pair, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Plain greedy target decoding; returns (ids before EOS, decode time after the first)."""
    from mlx_lm.generate import generate_step

    eos = pair.eos_ids
    out: list[int] = []
    t_first = t_last = time.perf_counter()
    for tok, _ in generate_step(mx.array(ids), pair.target, max_tokens=max_tokens):
        tok = int(tok)
        now = time.perf_counter()
        if not out:
            t_first = now
        if tok in eos:
            t_last = now
            break
        out.append(tok)
        t_last = now
    return out, t_last - t_first


def dflash_run(pair: Pair, ids: list[int], max_tokens: int, block_size: int):
    """Greedy DFlash; returns (committed ids, decode time after the first, cycle lengths)."""
    from dflash_mac.decode import GenerationConfig, speculative_stream

    cfg = GenerationConfig(max_tokens=max_tokens, block_size=block_size)
    out: list[int] = []
    t_first = t_last = None
    stats = None
    for ev in speculative_stream(pair, ids, cfg):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        out += ev.tokens
        stats = ev.stats
    return out, (t_last - t_first), list(stats.acceptance_lengths)


def evaluate(
    pair: Pair,
    prompts: list[list[int]],
    block_sizes: list[int],
    max_tokens: int = 256,
    speed: bool = True,
    repeats: int = 1,
    log=None,
) -> list[EvalResult]:
    """Evaluate each block size on every prompt against the plain target.

    Prompts are the outer loop (baseline, then each block size, order alternating), so a
    machine whose load drifts affects both sides alike; with `repeats` > 1 each prompt's decode
    time is the best of that many runs (ids and τ come from the first)."""
    warm = prompts[0]
    if speed:
        baseline_run(pair, warm, min(32, max_tokens))
        for bs in block_sizes:
            dflash_run(pair, warm, min(32, max_tokens), bs)
    res = {bs: EvalResult(bs, len(prompts), 0.0, [], [], [], 0) for bs in block_sizes}
    lengths_all: dict[int, list[int]] = {bs: [] for bs in block_sizes}
    for n, ids in enumerate(prompts):
        order = list(block_sizes) if n % 2 == 0 else list(reversed(block_sizes))
        ref, t_base = baseline_run(pair, ids, max_tokens)
        for _ in range(repeats - 1):
            t_base = min(t_base, baseline_run(pair, ids, max_tokens)[1])
        for bs in order:
            r = res[bs]
            toks, t, lengths = dflash_run(pair, ids, max_tokens, bs)
            for _ in range(repeats - 1):
                t = min(t, dflash_run(pair, ids, max_tokens, bs)[1])
            r.identical += toks == ref
            lengths_all[bs] += lengths
            r.per_prompt_tau.append(sum(lengths) / len(lengths) if lengths else 1.0)
            r.dflash_tokens += max(len(toks) - 1, 0)
            r.dflash_time += t
            r.baseline_tokens += max(len(ref) - 1, 0)
            r.baseline_time += t_base
    out = []
    for bs in block_sizes:
        r, lengths = res[bs], lengths_all[bs]
        r.tau = sum(r.per_prompt_tau) / len(r.per_prompt_tau)
        r.position_acceptance = position_acceptance(lengths, bs)
        r.survival = survival(lengths, bs)
        r.histogram = histogram(lengths, bs)
        out.append(r)
        if log:
            log(summary_line(r))
    return out


def summary_line(r: EvalResult) -> str:
    acc = " ".join(f"{a:.2f}" for a in r.position_acceptance)
    return (
        f"bs {r.block_size}: τ {r.tau:.2f} | per-position acceptance {acc} | "
        f"DFlash {r.dflash_tps:.0f} tok/s vs target {r.baseline_tps:.0f} tok/s = "
        f"{r.speedup:.2f}x | identical {r.identical}/{r.prompts}"
    )


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    from dflash_mac.loading import load
    from dflash_mac.platform import blas_in_use

    from .data import encode_prompts, read_prompts

    ap = argparse.ArgumentParser(
        prog="python -m dflash_mac.train.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--block-sizes", default="5,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each prompt this many times and keep the best (noisy machines)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    con = Console()
    pair = load(args.model, args.draft)
    prompts = encode_prompts(pair.tokenizer, read_prompts(args.prompts)[: args.limit], 4096)
    con.log(
        f"{len(prompts)} prompts, max {args.max_tokens} tokens, greedy, "
        f"{mx.default_device()}, BLAS: {blas_in_use()}"
    )
    res = evaluate(
        pair,
        prompts,
        [int(b) for b in args.block_sizes.split(",")],
        args.max_tokens,
        repeats=args.repeats,
        log=con.log,
    )
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in res], indent=1))


if __name__ == "__main__":
    main()
