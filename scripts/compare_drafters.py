"""Compare drafters for one target: τ (greedy and sampled), parameters, drafter cycle time.

    python scripts/compare_drafters.py --target models/bundled/target \\
        --drafts models/bundled/dflash models/bundled/dflash2 \\
        --prompts models/bundled/eval_prompts.jsonl --block-sizes 5,8 --temps 0,1

τ is the mean over requests of each request's mean committed tokens per cycle (bonus
included, docs/design.md §9); sampled runs use seed = prompt index, so both drafters see the
same seeds.
Greedy runs are also checked token for token against plain mlx-lm decoding of the target.
Cycle time: the drafter's proposal (`engine.propose`, evaluated) and the target's verify pass
at the same block size, timed on the first prompt's context (median of repetitions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.engine.drafts import propose
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.loading.loader import load
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.target.capture import FeatureCapture
from dflash_mac.train.data import encode_prompts, read_prompts
from dflash_mac.train.evaluate import baseline_run


def param_counts(drafter) -> dict[str, int]:
    """Drafter parameters (the target's embedding / LM head are shared, not counted)."""
    total = conv = sel = 0
    for k, v in tree_flatten(drafter.parameters()):
        total += v.size
        conv += v.size if "_conv." in k else 0
        sel += v.size if k.startswith("candidate_selector.") else 0
    return {"total": total, "conv": conv, "selector": sel}


class NoSelector:
    """A DFlash 2 drafter seen without its `propose`: drafts = argmax / samples of the backbone
    logits (the convs stay), to separate the selector's share of τ."""

    def __init__(self, drafter):
        self._d = drafter

    def __getattr__(self, name: str):
        if name == "propose":
            raise AttributeError(name)
        return getattr(self._d, name)

    def __call__(self, *args):
        return self._d(*args)


def tau_run(pair, prompts, bs: int, temp: float, max_tokens: int, refs=None) -> dict:
    taus, identical, toks, secs = [], 0, 0, 0.0
    for i, ids in enumerate(prompts):
        cfg = GenerationConfig(
            max_tokens=max_tokens,
            block=BlockChoice(bs),
            seed=i,
            sampling=SamplingParams(temperature=temp),
            copy=False,  # the drafter's own chains: no copies, no trees
            tree=0,
        )
        t0 = time.perf_counter()
        events = list(speculative_stream(pair, ids, cfg))
        secs += time.perf_counter() - t0
        lengths = events[-1].stats.acceptance_lengths
        out = [t for e in events for t in e.tokens]
        toks += len(out)
        taus.append(sum(lengths) / len(lengths) if lengths else 1.0)
        if refs is not None:
            identical += [t for t in out if t not in pair.eos_ids] == refs[i]
    res = {"tau": statistics.mean(taus), "tokens": toks, "tok_per_s": toks / secs}
    if refs is not None:
        res["identical"] = f"{identical}/{len(prompts)}"
    return res


def cycle_times(pair, ids: list[int], bs: int, temp: float, reps: int = 30) -> dict:
    """Seconds of one proposal and of one verify pass at block size `bs` (median and min)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(pair.target)
    dcache = pair.drafter.make_cache()
    with FeatureCapture(pair.target, pair.layer_ids) as cap:
        pair.target(mx.array(ids)[None], cache=cache)
        pair.drafter.extend_context(cap.features(), dcache)
    mx.eval([c.state for c in cache + dcache])
    sp = SamplingParams(temperature=temp)
    block = mx.array([ids[-1]] + [pair.drafter.config.mask_token_id] * (bs - 1))
    draft_t, verify_t = [], []
    for r in range(reps + 3):
        t0 = time.perf_counter()
        drafts, q = propose(pair, block, dcache, sp, mx.random.key(r))
        mx.eval(drafts, q) if q is not None else mx.eval(drafts)
        t1 = time.perf_counter()
        logits = pair.target(mx.concatenate([block[:1], drafts])[None], cache=cache)
        mx.eval(logits)
        t2 = time.perf_counter()
        for c in cache:
            c.trim(bs)
        if r >= 3:
            draft_t.append(t1 - t0)
            verify_t.append(t2 - t1)
    return {
        "draft_s": statistics.median(draft_t),
        "verify_s": statistics.median(verify_t),
        "draft_min_s": min(draft_t),
        "verify_min_s": min(verify_t),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--block-sizes", default="5,8")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--ablate-selector",
        action="store_true",
        help="also run DFlash 2 drafters without the selector walk",
    )
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    results, refs = {}, None
    for draft in args.drafts:
        pair = load(args.target, draft)
        prompts = encode_prompts(pair.tokenizer, read_prompts(args.prompts)[: args.limit], 4096)
        if refs is None:
            refs = []
            for ids in prompts:
                out, _ = baseline_run(pair, ids, args.max_tokens)
                refs.append(out)
        r = {"kind": pair.kind, "params": param_counts(pair.drafter), "runs": {}}
        tau_run(pair, prompts[:1], sizes[0], 0.0, 16)  # warm-up
        for bs in sizes:
            for t in temps:
                run = tau_run(pair, prompts, bs, t, args.max_tokens, refs if t == 0 else None)
                run.update(cycle_times(pair, prompts[0], bs, t))
                r["runs"][f"bs{bs}_T{t:g}"] = run
                print(
                    f"{draft} ({pair.kind}) bs {bs} T {t:g}: "
                    + ", ".join(
                        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in run.items()
                    ),
                    flush=True,
                )
        if args.ablate_selector and hasattr(pair.drafter, "propose"):
            pair.drafter = NoSelector(pair.drafter)
            for bs in sizes:
                for t in temps:
                    run = tau_run(pair, prompts, bs, t, args.max_tokens, refs if t == 0 else None)
                    r["runs"][f"noselector_bs{bs}_T{t:g}"] = run
                    print(
                        f"{draft} without selector bs {bs} T {t:g}: tau {run['tau']:.4g}",
                        flush=True,
                    )
        results[draft] = r
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
