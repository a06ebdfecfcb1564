"""Held-out evaluation of a pair with the real runtime: τ, per-position acceptance, speedup.

    python -m dflash_mac.train.evaluate --model T --draft D --prompts P.jsonl \\
        --block-sizes 5,8 --max-tokens 256 [--temps 0.7,1.0] [--long-prompts L.jsonl]

Besides greedy τ and speed: with ``--temps``, sampled τ and per-position acceptance at each
temperature (seeded per prompt; sampled output is exact in distribution, not token-identical)
and the teacher-forced average ``1 - TV(p_T, q)`` per block position (`tv_agreement`), the
acceptance probability of a draft whose predecessors were accepted; τ is also reported by
prompt-length bucket (``--long-prompts`` adds long prompts).

Greedy DFlash (`dflash_mac.engine.decode.speculative_stream`) against the same process's plain
target decoding (mlx-lm `generate_step`, no hooks), both warmed up, same prompts and max tokens,
both stopping at EOS. Decode speed counts the tokens after the first over the time after the first
(prefill excluded on both sides). Every prompt's committed ids must equal the baseline's.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from dflash_mac.engine.stats import histogram, position_acceptance, survival
from dflash_mac.pair import Pair


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


def dflash_run(
    pair: Pair,
    ids: list[int],
    max_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    seed: int | None = None,
):
    """DFlash (greedy unless `temperature`); returns (committed ids, decode time after the
    first, cycle lengths, cycle block sizes)."""
    from dflash_mac.engine.decode import GenerationConfig, speculative_stream
    from dflash_mac.models.distribution import SamplingParams
    from dflash_mac.sizing.choice import BlockChoice

    cfg = GenerationConfig(
        max_tokens=max_tokens,
        block=BlockChoice(block_size),
        sampling=SamplingParams(temperature=temperature),
        seed=seed,
        copy=False,  # the drafter's own acceptance: chains, no copies, no trees
        tree=0,
    )
    out: list[int] = []
    t_first = t_last = None
    stats = None
    for ev in speculative_stream(pair, ids, cfg):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        out += ev.tokens
        stats = ev.stats
    return out, (t_last - t_first), list(stats.acceptance_lengths), list(stats.block_sizes)


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
    sizes_all: dict[int, list[int]] = {bs: [] for bs in block_sizes}
    for n, ids in enumerate(prompts):
        order = list(block_sizes) if n % 2 == 0 else list(reversed(block_sizes))
        ref, t_base = baseline_run(pair, ids, max_tokens)
        for _ in range(repeats - 1):
            t_base = min(t_base, baseline_run(pair, ids, max_tokens)[1])
        for bs in order:
            r = res[bs]
            toks, t, lengths, sizes = dflash_run(pair, ids, max_tokens, bs)
            for _ in range(repeats - 1):
                t = min(t, dflash_run(pair, ids, max_tokens, bs)[1])
            r.identical += toks == ref
            lengths_all[bs] += lengths
            sizes_all[bs] += sizes
            r.per_prompt_tau.append(sum(lengths) / len(lengths) if lengths else 1.0)
            r.dflash_tokens += max(len(toks) - 1, 0)
            r.dflash_time += t
            r.baseline_tokens += max(len(ref) - 1, 0)
            r.baseline_time += t_base
    out = []
    for bs in block_sizes:
        r, lengths = res[bs], lengths_all[bs]
        r.tau = sum(r.per_prompt_tau) / len(r.per_prompt_tau)
        r.position_acceptance = position_acceptance(lengths, bs, sizes_all[bs])
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


LENGTH_BUCKETS = ((0, 256), (256, 1024), (1024, 2048))


def bucket_of(n: int) -> str:
    for a, b in LENGTH_BUCKETS:
        if a <= n < b:
            return f"{a}-{b}"
    return f">={LENGTH_BUCKETS[-1][1]}"


def tau_by_length(prompts: list[list[int]], taus: list[float]) -> dict[str, dict]:
    """Mean τ per prompt-length bucket (prompt tokens): ``{bucket: {"prompts", "tau"}}``."""
    groups: dict[str, list[float]] = {}
    for ids, t in zip(prompts, taus):
        groups.setdefault(bucket_of(len(ids)), []).append(t)
    return {k: {"prompts": len(v), "tau": round(sum(v) / len(v), 3)} for k, v in groups.items()}


def sampled_tau(
    pair: Pair, prompts: list[list[int]], block_size: int, temperature: float, max_tokens: int
) -> dict:
    """τ and per-position acceptance of sampled DFlash at `temperature` (seed = prompt index)."""
    taus, lengths, per_cycle = [], [], []
    for n, ids in enumerate(prompts):
        _, _, lens, sizes = dflash_run(pair, ids, max_tokens, block_size, temperature, seed=n)
        taus.append(sum(lens) / len(lens) if lens else 1.0)
        lengths += lens
        per_cycle += sizes
    return {
        "temperature": temperature,
        "block_size": block_size,
        "tau": round(sum(taus) / len(taus), 3),
        "position_acceptance": [
            round(a, 3) for a in position_acceptance(lengths, block_size, per_cycle)
        ],
        "by_length": tau_by_length(prompts, taus),
    }


def tv_agreement(
    pair: Pair,
    sequences: list[tuple[list[int], list[int]]],
    temperatures: list[float],
    anchors: int = 32,
    seed: int = 0,
) -> dict[float, list[float]]:
    """Teacher-forced mean ``1 - TV(p_T, q_T)`` per block position, per temperature.

    For random anchors in each (prompt, response) the drafter drafts the block with the true
    context (the training forward, `forward.py`); p_T is the target's distribution at the
    same position. ``1 - TV = Σ min(p, q)`` is the probability that verification accepts the
    draft at that position given its predecessors were accepted. DFlash 2's q is the walk's
    (``softmax(scores / T)`` over its candidates, teacher-forced predecessors)."""
    import numpy as np

    from dflash_mac.models.distribution import scatter_candidates
    from dflash_mac.target.structure import target_head

    from .batches import target_forward
    from .blocks import block_inputs, sample_anchors
    from .dflash2_loss import selector_q, train_hidden2
    from .forward import layer_masks, train_hidden
    from .soft import label_positions

    drafter, bs = pair.drafter, pair.block_size
    d2 = drafter.config.is_dflash2
    head = target_head(pair.target)
    sums = {t: np.zeros(bs - 1) for t in temperatures}
    count = 0
    for j, (prompt, resp) in enumerate(sequences):
        toks = np.array(prompt + resp, dtype=np.int32)
        rng = np.random.default_rng([seed, j])
        anc = sample_anchors(rng, len(prompt), len(toks), bs, anchors)
        if len(anc) == 0:
            continue
        ids, labels = block_inputs(toks, anc, bs, drafter.config.mask_token_id)
        feats, hidden = target_forward(pair.target, pair.layer_ids, mx.array(toks)[None], True)
        a = mx.array(anc.astype(np.int32))[None]
        masks = layer_masks(drafter, anc[None], len(toks), bs)
        fwd = train_hidden2 if d2 else train_hidden
        dh = fwd(drafter, feats, mx.array(ids)[None], a, masks)[:, :, 1:]
        dl = drafter.logits(dh)  # [1, N, P, V]
        pos = label_positions(a, bs)  # [1, N, P]
        th = mx.take_along_axis(hidden, pos.reshape(1, -1, 1), axis=1)
        tl = head.logits(th).reshape(dl.shape)
        V = dl.shape[-1]
        for t in temperatures:
            p = mx.softmax(tl.astype(mx.float32) / t, axis=-1)
            if d2:
                preds = mx.concatenate(
                    [mx.array(ids)[None, :, :1], mx.array(labels)[None, :, :-1]], -1
                )
                _, cand, qc = selector_q(drafter.candidate_selector, dh, dl, preds, t)
                k = cand.shape[-1]
                q = scatter_candidates(cand.reshape(-1, k), qc.reshape(-1, k), V).reshape(p.shape)
            else:
                q = mx.softmax(dl.astype(mx.float32) / t, axis=-1)
            agree = mx.minimum(p, q).sum(axis=-1)[0]  # [N, P]
            sums[t] += np.array(agree.sum(axis=0))
        count += len(anc)
    return {t: [round(float(x), 4) for x in v / max(count, 1)] for t, v in sums.items()}


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    from dflash_mac.host import blas_in_use
    from dflash_mac.loading.loader import load

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
    ap.add_argument(
        "--temps",
        default="",
        help="sampled τ, per-position acceptance and 1-TV(p_T, q) at these temperatures",
    )
    ap.add_argument(
        "--long-prompts", type=Path, default=None, help="more prompts (τ by prompt length)"
    )
    ap.add_argument("--no-speed", action="store_true", help="τ only: skip the baseline timing")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    con = Console()
    pair = load(args.model, args.draft)
    prompts = encode_prompts(pair.tokenizer, read_prompts(args.prompts)[: args.limit], 4096)
    if args.long_prompts:
        prompts += encode_prompts(pair.tokenizer, read_prompts(args.long_prompts), 4096)
    temps = [float(t) for t in args.temps.split(",") if t.strip()]
    con.log(
        f"{len(prompts)} prompts, max {args.max_tokens} tokens, greedy, "
        f"{mx.default_device()}, BLAS: {blas_in_use()}"
    )
    res = evaluate(
        pair,
        prompts,
        [int(b) for b in args.block_sizes.split(",")],
        args.max_tokens,
        speed=not args.no_speed,
        repeats=args.repeats,
        log=con.log,
    )
    out: dict = {"greedy": [r.as_dict() for r in res]}
    for r in res:
        out.setdefault("greedy_by_length", {})[r.block_size] = tau_by_length(
            prompts, r.per_prompt_tau
        )
        con.log(
            f"bs {r.block_size} greedy τ by prompt length: {out['greedy_by_length'][r.block_size]}"
        )
    bs_top = max(int(b) for b in args.block_sizes.split(","))
    out["sampled"] = []
    for t in temps:
        r = sampled_tau(pair, prompts, bs_top, t, args.max_tokens)
        out["sampled"].append(r)
        con.log(f"T {t} bs {bs_top}: {r}")
    if temps:
        seqs = [(p, baseline_run(pair, p, args.max_tokens)[0]) for p in prompts]
        out["one_minus_tv"] = tv_agreement(pair, seqs, temps)
        con.log(f"1 - TV(p_T, q) per position (teacher-forced): {out['one_minus_tv']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
