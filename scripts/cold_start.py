"""`auto` from a fresh start, prompt by prompt: a new controller per prompt (as a fresh
`dflash-mac generate` process with nothing remembered), with the guess worth 1 or 8 drafting
cycles, against a fixed block. Scored by the saved cost curve (untimed controllers, so the
choices and the score are free of this host's timing noise): tokens per plain step's worth of
time (docs/bench.md, `--block-size auto`).

    DFLASH_MAC_HOME=<dir with a saved curve> python scripts/cold_start.py 0 32
    DFLASH_MAC_HOME=<dir> python scripts/cold_start.py 1.0 32 --seeds 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_mac.api import prompt_ids
from dflash_mac.autoblock import BlockController, CostCurve, CostModel
from dflash_mac.decode import GenerationConfig, speculative_stream
from dflash_mac.loading import load
from dflash_mac.policy import cost_curve_path
from dflash_mac.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "models" / "bundled" / "eval_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("temp", type=float)
    ap.add_argument("prompts", type=int)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--weights", default="1,8", help="guess weights to compare")
    ap.add_argument("--block", type=int, default=8, help="the fixed size to compare with")
    args = ap.parse_args()
    pair = load()
    curve = CostCurve.load(cost_curve_path(pair), args.temp > 0)
    if curve is None:
        raise SystemExit("no saved cost curve: run `dflash-mac bench --cost-curve` first.")
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[: args.prompts]]
    prompts = [prompt_ids(pair.tokenizer, r["messages"][-1]["content"]) for r in rows]
    runs = [(f"auto, guess worth {w}", float(w)) for w in args.weights.split(",")]
    for name, weight in runs + [(f"block {args.block}", None)]:
        tokens = cost = cycles = plain = 0.0
        for seed in range(args.seeds):
            for ids in prompts:
                ctl = None
                if weight is not None:
                    model = CostModel(curve)
                    ctl = BlockController(pair.block_size, model, timed=False, guess_weight=weight)
                cfg = GenerationConfig(
                    max_tokens=128 if ctl else args.block,
                    sampling=SamplingParams(args.temp),
                    seed=seed if args.temp > 0 else None,
                )
                for event in speculative_stream(pair, ids, cfg, controller=ctl):
                    stats = event.stats
                tokens += sum(stats.acceptance_lengths)
                cost += sum(curve.ratio(b) for b in stats.block_sizes)
                cycles += len(stats.block_sizes)
                plain += stats.block_sizes.count(1)
        print(
            f"{name:<22} {tokens / cost:.3f} tokens per plain step's time · "
            f"τ {tokens / cycles:.2f} · plain steps {plain:.0f} of {cycles:.0f} cycles",
            flush=True,
        )


if __name__ == "__main__":
    main()
