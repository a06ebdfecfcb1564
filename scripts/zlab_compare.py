"""Our decode loop against z-lab's lean reference loop on the same weights, in one process.

z-lab's `dflash/model_mlx.py: stream_generate` (github.com/z-lab/dflash; not part of this repo:
pass the path of a checkout's file) drafts and verifies without pipelining, statistics or a
block-size controller. Both loops run the bundled target (fp32) with the bundled DFlash 1
drafter at one fixed block size, greedy, EOS on, prompt by prompt in alternating order; each
on its own copy of the target (z-lab's loop replaces the target's layers for good). Printed:
decode tok/s of each (tokens after the first ÷ time from the first to the last), their ratio,
and whether the tokens agree (both are lossless: they must).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python scripts/zlab_compare.py PATH/dflash/model_mlx.py [--block 8] [--prompts 16]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load as mlx_load

from dflash_mac.api import prompt_ids
from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.loading.loader import BUNDLED_TARGET, cast_floats, load
from dflash_mac.prompts import read_prompt_file
from dflash_mac.sizing.choice import BlockChoice

DRAFT = BUNDLED_TARGET.parent / "dflash"
PROMPTS = BUNDLED_TARGET.parent / "eval_prompts.jsonl"


def zlab_module(path: Path):
    spec = importlib.util.spec_from_file_location("zlab_model_mlx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def zlab_drafter(zl, folder: Path):
    """z-lab's DFlashDraftModel with the weights of our drafter folder (as its `load_draft`)."""
    cfg = json.loads((folder / "config.json").read_text())
    config = zl.DFlashConfig(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"],
        block_size=cfg["block_size"],
        target_layer_ids=tuple(cfg["dflash_config"]["target_layer_ids"]),
        num_target_layers=cfg["num_target_layers"],
        mask_token_id=cfg["dflash_config"]["mask_token_id"],
        rope_scaling=cfg.get("rope_scaling"),
    )
    model = zl.DFlashDraftModel(config)
    weights = {k: v for f in folder.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    model.load_weights(list(weights.items()), strict=False)
    cast_floats(model, mx.float32)
    mx.eval(model.parameters())
    return model


def timed(events, tokens_of) -> tuple[list[int], float]:
    """(tokens, decode tok/s) of a stream of events."""
    tokens, stamps = [], []
    for ev in events:
        new = tokens_of(ev)
        if new:
            tokens += new
            stamps.append(time.perf_counter())
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return tokens, (len(tokens) - 1) / span if span > 0 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("zlab", type=Path, help="path of z-lab's dflash/model_mlx.py")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    zl = zlab_module(args.zlab)
    pair = load(BUNDLED_TARGET, DRAFT)
    target, tokenizer = mlx_load(str(BUNDLED_TARGET))
    cast_floats(target, mx.float32)
    mx.eval(target.parameters())
    draft = zlab_drafter(zl, DRAFT)
    prompts = read_prompt_file(PROMPTS)[: args.prompts]
    ids = [prompt_ids(pair.tokenizer, p.prompt) for p in prompts]
    cfg = GenerationConfig(args.tokens, BlockChoice(args.block))

    def ours(x):
        return timed(speculative_stream(pair, x, cfg), lambda ev: ev.tokens)

    def theirs(x):
        events = zl.stream_generate(target, draft, tokenizer, x, args.block, args.tokens)
        return timed(events, lambda ev: ev.tokens)

    ours(ids[0])  # warm-up: each loop's graphs built once
    theirs(ids[0])
    rates: dict[str, list[float]] = {"ours": [], "z-lab": []}
    agree = 0
    for r in range(args.rounds):
        for i, x in enumerate(ids):
            runs = [("ours", ours), ("z-lab", theirs)]
            for name, run in runs if (i + r) % 2 == 0 else runs[::-1]:
                tokens, tps = run(x)
                rates[name].append(tps)
                if name == "ours":
                    mine = tokens
                else:
                    other = tokens
            n = min(len(mine), len(other))
            agree += mine[:n] == other[:n]
    for name, values in rates.items():
        print(f"{name:>6}: {statistics.mean(values):7.1f} tok/s (mean of {len(values)} runs)")
    ratio = [a / b for a, b in zip(rates["ours"], rates["z-lab"]) if b > 0]
    print(f"ours ÷ z-lab: {statistics.median(ratio):.3f} (median per prompt)")
    print(f"tokens agree on {agree} of {len(ids) * args.rounds} prompt runs")


if __name__ == "__main__":
    main()
