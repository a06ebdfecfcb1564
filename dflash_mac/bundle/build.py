"""Build the bundled default pair: corpus -> tokenizer -> target -> drafter.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python -m dflash_mac.bundle.build --out models/bundled --stage all --minutes 30

(On Linux, preloading OpenBLAS makes MLX's CPU fp32 matmuls ~30x faster.) Intermediate data
lives in ``.cache/bundle/`` (gitignored): the tokenised train/eval streams, the drafter-training
prompts ``.cache/bundle/train_prompts.jsonl`` and the resumable target checkpoint
``.cache/bundle/target_ckpt/``. Committed outputs: ``<out>/target/``,
``<out>/eval_prompts.jsonl`` and ``<out>/dflash/`` (after the drafter stage).

``--stage positions`` (not part of ``all``) measures the built target: its held-out loss by
position with the whole window as context and with 256 tokens (``stages2.stage_positions``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflash_mac.bundle import corpus, stages2
from dflash_mac.bundle.tokenizer import build_tokenizer, special_ids, write_token_streams

if TYPE_CHECKING:  # the training stack loads lazily (MLX), only when a stage trains
    from dflash_mac.train import TrainingArgs

CACHE = Path(".cache/bundle")
STAGES = (
    "corpus",
    "tokenizer",
    "target",
    "drafter",
    "drafter2",
    "corpus2",
    "longctx",
    "drafters2",
)
# `v1`: the first pair (short-context target, CE drafters). `all`: v1, then the v2 stages
# (long-context target, drafters distilled on it), which start from the v1 weights.
GROUPS = {"v1": STAGES[:5], "all": STAGES}
MEASURE = ("positions",)  # measurements of the built pair, run on their own

console = Console(log_path=False)


def stage_corpus(out: Path, cache: Path) -> None:
    """Write eval prompts (committed) and drafter-training prompts (cache)."""
    n_eval = corpus.eval_prompts_jsonl(out / "eval_prompts.jsonl", limit=32)
    n_train = corpus.train_prompts_jsonl(cache / "train_prompts.jsonl", limit=4000)
    train, heldout = corpus.split_modules()
    info = {
        "train_modules": len(train),
        "heldout_modules": [m.name for m in heldout],
        "eval_prompts": n_eval,
        "train_prompts": n_train,
    }
    (cache / "corpus.json").write_text(json.dumps(info, indent=1))
    console.log(
        f"corpus: {len(train)} train / {len(heldout)} held-out modules, "
        f"{n_eval} eval prompts, {n_train} drafter-training prompts"
    )


def stage_tokenizer(out: Path, cache: Path) -> None:
    """Train the tokenizer on the training split; tokenise train and held-out streams."""
    from tokenizers import Tokenizer  # noqa: F401  (import check)

    train, heldout = corpus.split_modules()
    tok = build_tokenizer(corpus.training_documents(train), out / "target")
    console.log(f"tokenizer: vocab {tok.get_vocab_size()}, special ids {special_ids(tok)}")
    for name, n in write_token_streams(tok, {"train": train, "eval": heldout}, cache).items():
        console.log(f"{name} stream: {n:,} tokens")


def stage_target(out: Path, cache: Path, minutes: float, **overrides: object) -> None:
    """Pretrain the target (resumable) and save it as float16 to ``<out>/target``."""
    from dflash_mac.bundle import pretrain

    tc = pretrain.TrainConfig(minutes=minutes)
    for k, v in overrides.items():
        if v is not None:
            setattr(tc, k, v)
    train_ids = np.load(cache / "train_tokens.npy")
    eval_ids = np.load(cache / "eval_tokens.npy")
    cols = [
        TextColumn("[bold]target tokens"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*cols, console=console) as bar:
        task = bar.add_task("train", total=None, loss=float("nan"), tps=0.0)

        def on_step(step: int, total: int, loss: float, tps: float) -> None:
            bar.update(task, completed=step, total=total or None, loss=loss, tps=tps)

        model, meta = pretrain.pretrain(
            train_ids, eval_ids, cache / "target_ckpt", tc, progress=on_step, log=console.log
        )
    pretrain.save_target(model, out / "target")
    meta.update(sample_and_time(out / "target", out / "eval_prompts.jsonl"))
    (cache / "target_train.json").write_text(json.dumps(meta, indent=1))
    last = meta["curve"][-1]
    console.log(
        f"target saved: {meta['tokens_trained']:,} tokens, final train loss "
        f"{last['train_loss']}, eval loss {last['eval_loss']}, {last['seconds']:.0f}s"
    )


def sample_and_time(target: Path, prompts: Path, n: int = 3, max_tokens: int = 96) -> dict:
    """Greedy-decode ``n`` held-out prompts with mlx_lm (prints them); return decode tok/s."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tok = load(str(target))
    model.set_dtype(mx.float32)
    rows = [json.loads(x) for x in prompts.read_text().splitlines()][:n]
    speeds = []
    for row in rows:
        prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
        text, last = "", None
        for last in stream_generate(model, tok, prompt, max_tokens=max_tokens):
            text += last.text
        console.rule(row["id"])
        console.print(row["messages"][0]["content"], style="bold", markup=False)
        console.print(text, markup=False, highlight=False)
        if last is not None:
            speeds.append(last.generation_tps)
    res = {"decode_tok_per_s_fp32": round(float(np.median(speeds)), 1) if speeds else None}
    console.log(res)
    return res


def stage_drafter(out: Path, cache: Path) -> None:
    """Train the DFlash drafter on the target's own outputs (``dflash_mac.train``)."""
    from dflash_mac.train import train_drafter
    from dflash_mac.train.command import ProgressReporter

    # == the three `dflash-mac train` runs listed in MODEL_CARD.md ("Drafter"): from scratch,
    # then two fine-tunes of that drafter (`--init-from`, fresh warmup + cosine each). The step
    # counts are the committed run's (first fixed by `--minutes` budgets on the build machine);
    # data order and anchors follow from the seed and the step, so the schedule is identical.
    base = v1_drafter_args(out, cache)
    reporter = ProgressReporter(console)
    train_drafter(replace(base, steps=247), reporter)
    train_drafter(replace(base, steps=110, init_from=out / "dflash"), reporter)
    train_drafter(
        replace(base, steps=137, init_from=out / "dflash", eval_prompts=out / "eval_prompts.jsonl"),
        reporter,
    )


def v1_drafter_args(out: Path, cache: Path) -> TrainingArgs:
    """The v1 drafter recipe (DFlash 1; DFlash 2 changes the arch and the step count)."""
    from dflash_mac.train import TrainingArgs

    return TrainingArgs(
        target=str(out / "target"),
        prompts=corpus.cached_train_prompts(cache),
        out_dir=out / "dflash",
        block_size=8,
        num_layers=1,
        arch="dflash",
        loss="ce",  # the v1 recipe, before the KL losses
        target_layer_ids=[1, 3, 5],  # full depth
        max_new_tokens=256,
        limit=600,
        gen_batch_size=64,
        lr=2e-3,
        batch_size=4,
        anchors=128,
        cache_dir=cache / "drafter",
    )


def stage_drafter2(out: Path, cache: Path) -> None:
    """Train the v1 DFlash 2 drafter: the DFlash 1 recipe and data, 195 steps (MODEL_CARD.md)."""
    from dflash_mac.train import train_drafter
    from dflash_mac.train.command import ProgressReporter

    args = replace(
        v1_drafter_args(out, cache),
        out_dir=out / "dflash2",
        arch="dflash2",
        steps=195,  # the committed run's length (first fixed by `--minutes 15`)
        cache_dir=stages2.shared_data(cache, "drafter-dflash2", source="drafter"),
    )
    train_drafter(args, ProgressReporter(console))


def keep_v1(folder: Path, kept: Path) -> None:
    """Keep a v1 model in the cache: the v2 stages start from it (``<out>`` then holds v2)."""
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(folder, kept)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        prog="python -m dflash_mac.bundle.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=Path("models/bundled"))
    ap.add_argument("--stage", choices=(*STAGES, *GROUPS, *MEASURE), default="all")
    ap.add_argument(
        "--minutes", type=float, default=30.0, help="wall-clock training budget of the target"
    )
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--fresh", action="store_true", help="discard the target checkpoint")
    ap.add_argument("--batch-size", type=int, default=None, help="target batch (sequences)")
    ap.add_argument("--lr", type=float, default=None, help="target peak learning rate")
    ap.add_argument(
        "--recalibrate",
        action="store_true",
        help="on resume, re-measure tokens/s and refit the token budget to --minutes",
    )
    ap.add_argument("--tokens", type=int, default=None, help="longctx: tokens of the run")
    ap.add_argument("--only", choices=("dflash", "dflash2"), default=None, help="drafters2")
    ap.add_argument(
        "--windows", type=int, default=None, help="positions: held-out windows (default: all)"
    )
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        shutil.rmtree(args.cache / "target_ckpt", ignore_errors=True)
    stages = GROUPS.get(args.stage, (args.stage,))
    t0 = time.perf_counter()
    for st in stages:
        console.rule(f"stage {st}")
        if st == "corpus":
            stage_corpus(args.out, args.cache)
        elif st == "tokenizer":
            stage_tokenizer(args.out, args.cache)
        elif st == "target":
            stage_target(
                args.out,
                args.cache,
                args.minutes,
                batch_size=args.batch_size,
                lr=args.lr,
                recalibrate=args.recalibrate or None,
            )
            keep_v1(args.out / "target", args.cache / "target_v1")
        elif st in ("drafter", "drafter2"):
            arch = "dflash" if st == "drafter" else "dflash2"
            if (args.cache / f"{arch}_v1").exists():
                console.log(f"v1 {arch} drafter cached in {args.cache}: kept")
                continue
            (stage_drafter if st == "drafter" else stage_drafter2)(args.out, args.cache)
            keep_v1(args.out / arch, args.cache / f"{arch}_v1")
        elif st == "corpus2":
            stages2.stage_corpus2(args.out, args.cache)
        elif st == "longctx":
            stages2.stage_longctx(args.out, args.cache, args.tokens)
        elif st == "positions":
            stages2.stage_positions(args.out, args.cache, args.windows)
        else:
            stages2.stage_drafters2(args.out, args.cache, args.only)
    console.log(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
