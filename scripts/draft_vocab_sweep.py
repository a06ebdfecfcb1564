"""Choose a draft vocabulary size K by measurement (FR-Spec applied to a trained drafter).

    python scripts/draft_vocab_sweep.py --draft models/smollm2_135m/dflash2 \\
        --data .cache/smollm2/train-dflash2/data/regen-<key>.jsonl --out bench/results/FILE

For each K: the share of the target's held-out greedy answers (code and chat suites) inside the
top-K ids (counted on the training answers, `train/vocab.py`, with the feature store's soft
mass when `--store` names it), the drafter's own block-8 chain τ with its head cut to those K
rows (no retraining, no copies, no trees; greedy and T 0.7) and the drafter's pass time.
K = 0 is the whole vocabulary.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from compare_drafters import cycle_times, tau_run  # noqa: E402
from helpers.oracle import with_drafter  # noqa: E402
from helpers.subset import subset_copy  # noqa: E402

from dflash_mac.bench.inputs import code_suite_path  # noqa: E402
from dflash_mac.draft_vocab import control_ids, coverage, rank  # noqa: E402
from dflash_mac.loading.loader import load  # noqa: E402
from dflash_mac.target.structure import target_head  # noqa: E402
from dflash_mac.train.data import _read_cache, encode_prompts, read_prompts  # noqa: E402
from dflash_mac.train.evaluate import baseline_run  # noqa: E402
from dflash_mac.train.features import FeatureStore, StoreLayout  # noqa: E402
from dflash_mac.train.vocab import token_counts  # noqa: E402

SUITES = {"code": code_suite_path(), "chat": Path("dflash_mac/data/suites/chat.jsonl")}


def subset(pair, ids):
    """`pair` with its drafter's head cut to the target ids `ids`."""
    return with_drafter(pair, subset_copy(pair.drafter, target_head(pair.target), ids.tolist()))


def context_coverage(vocab, prompts, refs) -> float:
    """Coverage if each request also drafted over its prompt's ids and its answer so far."""
    hit = total = 0
    base = set(vocab.tolist())
    for ids, ref in zip(prompts, refs):
        seen = base | set(ids)
        for t in ref:
            hit += t in seen
            total += 1
            seen.add(t)
    return hit / max(total, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the default pair's)")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", required=True, type=Path, help="regenerated answers (JSONL)")
    ap.add_argument("--store", type=Path, default=None, help="feature store folder")
    ap.add_argument("--ks", default="4096,8192,16384,24576,0")
    ap.add_argument(
        "--limits", default="code:8,chat:6", help="name:N (first N prompts) or name:START:END"
    )
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.csv and OUT.json")
    ap.add_argument("--coverage-only", action="store_true", help="no τ runs (fast)")
    ap.add_argument("--no-timing", action="store_true", help="no pass timing (a busy host)")
    args = ap.parse_args(argv)
    pair = load(args.model, args.draft)
    V = pair.drafter.config.vocab_size
    seqs = _read_cache(args.data)
    store = None
    if args.store:
        layout = StoreLayout(**json.loads((args.store / "layout.json").read_text()))
        store = FeatureStore(args.store, layout)
    counts = token_counts(seqs, V, store)
    always = control_ids(pair.tokenizer)
    temps = [float(t) for t in args.temps.split(",")]
    suites = {}
    for part in args.limits.split(","):
        name, *span = part.split(":")  # name:N (the first N) or name:START:END
        lo, hi = (0, int(span[0])) if len(span) == 1 else (int(span[0]), int(span[1]))
        prompts = encode_prompts(pair.tokenizer, read_prompts(SUITES[name])[lo:hi], 4096)
        refs = [baseline_run(pair, ids, args.max_tokens)[0] for ids in prompts]
        suites[name] = (prompts, refs)
        print(f"{name}: {len(prompts)} prompts, {sum(map(len, refs))} answer tokens", flush=True)
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        ids = rank(counts, always, k) if k else None
        p = subset(pair, ids) if k else pair
        if not args.coverage_only:
            tau_run(p, suites["code"][0][:1], 8, 0.0, 16)  # warm-up
        times = (
            {"draft_s": 0.0}
            if args.coverage_only or args.no_timing
            else cycle_times(p, suites["code"][0][0], 8, 0.0)
        )
        for name, (prompts, refs) in suites.items():
            cov = coverage(ids, [t for r in refs for t in r]) if k else 1.0
            ctx = context_coverage(ids, prompts, refs) if k else 1.0
            for t in temps if not args.coverage_only else [0.0]:
                t0 = time.perf_counter()
                run = {"tau": 0.0}
                if not args.coverage_only:
                    run = tau_run(p, prompts, 8, t, args.max_tokens, refs if t == 0 else None)
                row = {
                    "K": k or V,
                    "suite": name,
                    "temperature": t,
                    "coverage": round(cov, 4),
                    "coverage_with_context": round(ctx, 4),
                    "tau": round(run["tau"], 4),
                    "identical": run.get("identical", ""),
                    "draft_ms": round(times["draft_s"] * 1e3, 2),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summary = {
        "draft": args.draft,
        "data_tokens": sum(len(s.response) for s in seqs),
        "soft_mass": bool(store),
        "median_draft_ms": {
            r["K"]: statistics.median(x["draft_ms"] for x in rows if x["K"] == r["K"]) for r in rows
        },
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
