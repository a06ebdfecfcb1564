"""Bundled pair v2 stages: a target trained over its whole context, drafters distilled on it.

- ``corpus2``: the extended stdlib corpus (more directories; the hash split keeps every v1
  held-out module held out) tokenised with the v1 tokenizer into ``train2/eval2`` streams;
  long-context chat prompts (a module's source, then a request) from training modules for the
  drafters and from held-out modules for the evaluation (``<out>/eval_long_prompts.jsonl``).
- ``longctx``: continued pretraining of the v1 target with a 512 -> 1024 -> 2048 curriculum
  (`longctx.py`); resumable; writes ``<out>/target`` with an honest ``max_position_embeddings``.
- ``drafters2``: DFlash 1 and DFlash 2 fine-tuned (``--init-from`` the v1 drafters) on the new
  target's greedy AND sampled (T 0.7) answers to short and long prompts, with the mixed
  CE + KL(p_T || q) loss (`dflash_mac/train/soft.py`); each run resumes from its checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console

from dflash_mac.bundle import corpus
from dflash_mac.bundle.tokenizer import write_token_streams

console = Console(log_path=False)
RECOMMENDED_TEMP = 0.7  # the temperature the bundled pair is tuned and measured for
V2 = {
    "tokens": 2_500_000,  # continued-pretraining tokens (~35 min on 2 quiet x86 cores)
    "dflash_steps": 500,  # DFlash 1 steps (the v1 recipe's length)
    "dflash_more_steps": 400,  # then a second run from the first one's output, lr 1e-3
    "dflash2_steps": 500,  # DFlash 2 steps
    "dflash2_more_steps": 400,  # idem
    "short_prompts": 400,  # answered greedy and at RECOMMENDED_TEMP
    "long_prompts": 64,  # idem
    # DFlash 2's walk at inference goes over this many candidates (trained over 16): more of
    # p_T's mass is reachable when sampling (1 - TV at T 1.0, position 1: 0.52 -> 0.61), same
    # cost on the CPU (MODEL_CARD.md, "Selector candidates")
    "dflash2_candidates": 128,
}


def need_v1(cache: Path, name: str) -> Path:
    """The v1 model the v2 stages start from, kept in the cache by the v1 stages."""
    path = cache / f"{name}_v1"
    if not (path / "config.json").exists():
        raise SystemExit(
            f"{path} is missing: the v2 stages start from the v1 models; run "
            "`python -m dflash_mac.bundle.build --stage v1` first."
        )
    return path


def stage_corpus2(out: Path, cache: Path) -> None:
    """Tokenise the extended corpus with the v1 tokenizer; write the long-context prompts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    train, heldout = corpus.split_modules(extended=True)
    counts = write_token_streams(tok, {"train2": train, "eval2": heldout}, cache)
    for (name, n), mods in zip(counts.items(), (train, heldout)):
        console.log(f"{name} stream: {len(mods)} modules, {n:,} tokens")
    n = corpus.write_jsonl(
        cache / "train_long_prompts.jsonl", corpus.long_context_prompts(train, 400, seed=0)
    )
    m = corpus.write_jsonl(
        out / "eval_long_prompts.jsonl",
        corpus.long_context_prompts(heldout, 12, min_chars=4_000, max_chars=5_500, seed=1),
    )
    console.log(f"long-context prompts: {n} training, {m} held-out")


def stage_longctx(out: Path, cache: Path, tokens: int | None = None) -> None:
    """Continue pretraining the v1 target over its whole context (resumable)."""
    from dflash_mac.bundle import longctx, pretrain

    v1 = need_v1(cache, "target")
    cc = longctx.CurriculumConfig(tokens=tokens or V2["tokens"])
    model, meta = longctx.continue_pretraining(
        v1,
        np.load(cache / "train2_tokens.npy"),
        np.load(cache / "eval2_tokens.npy"),
        cache / "longctx_ckpt",
        cc,
        log=console.log,
    )
    for f in v1.iterdir():  # tokenizer and generation files unchanged
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / "target" / f.name)
    pretrain.save_target(model, out / "target", longctx.target_config(cc.max_len))
    longctx.write_meta(cache / "target2_train.json", meta)


def stage_positions(out: Path, cache: Path, windows: int | None = None) -> dict:
    """The bundled target's held-out loss by position, with its whole window as context and
    with 256 tokens (`longctx.context_control`); writes ``<cache>/target2_positions.json``."""
    import mlx.core as mx
    from mlx_lm import load
    from rich.progress import Progress

    from dflash_mac.bundle import longctx

    path = cache / "eval2_tokens.npy"
    if not path.exists():  # the held-out stream alone (what corpus2 writes with the rest)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
        write_token_streams(tok, {"eval2": corpus.split_modules(extended=True)[1]}, cache)
    model, _ = load(str(out / "target"))
    model.set_dtype(mx.float32)  # as trained (fp16 matmuls are slow and coarse on a CPU)
    seq_len = json.loads((out / "target" / "config.json").read_text())["max_position_embeddings"]
    with Progress(console=console) as bar:
        task = bar.add_task("held-out windows", total=None)
        res = longctx.context_control(
            model,
            np.load(path),
            seq_len,
            windows,
            progress=lambda i, n: bar.update(task, completed=i, total=n),
        )
    longctx.write_meta(cache / "target2_positions.json", res)
    console.log(f"{res['windows']} windows of {seq_len} tokens")
    for bucket in res["full"]:
        full, short = res["full"][bucket], res["short"][bucket]
        console.log(f"{bucket:>9}: {full:.4f} (whole window), {short:.4f} (256-token context)")
    return res


def stage_drafters2(out: Path, cache: Path, only: str | None = None) -> None:
    """Fine-tune both drafters on the v2 target with the distribution-matching loss."""
    from dflash_mac.train import TrainingArgs, train_drafter
    from dflash_mac.train.command import ProgressReporter

    prompts = cache / "train_prompts2.jsonl"
    if not prompts.exists():
        rows = [json.loads(x) for x in corpus.cached_train_prompts(cache).read_text().splitlines()]
        rows = [rows[i] for i in np.linspace(0, len(rows) - 1, V2["short_prompts"]).astype(int)]
        longs = (cache / "train_long_prompts.jsonl").read_text().splitlines()
        rows += [json.loads(x) for x in longs[: V2["long_prompts"]]]
        corpus.write_jsonl(prompts, rows)
    base = TrainingArgs(
        target=str(out / "target"),
        prompts=prompts,
        out_dir=out / "dflash",
        block_size=8,
        num_layers=1,
        target_layer_ids=[1, 3, 5],
        max_new_tokens=160,
        temps=[0.0, RECOMMENDED_TEMP],
        gen_batch_size=32,
        lr=2e-3,
        batch_size=4,
        anchors=96,
        max_length=2048,
        loss="mix",
        kl_temperatures=[RECOMMENDED_TEMP, 1.0],
        kl_weight=0.7,
        top_k_soft=32,
        cache_dir=cache / "drafter2",
        save_every=10,
        resume=True,
    )
    reporter = ProgressReporter(console)
    for arch in ("dflash", "dflash2"):
        if only not in (None, arch):
            continue
        first = replace(
            base,
            arch=arch,
            out_dir=out / arch,
            steps=V2[f"{arch}_steps"],
            init_from=need_v1(cache, arch),
            cache_dir=cache / "drafter2"
            if arch == "dflash"
            else shared_data(cache, f"drafter2-{arch}"),
        )
        train_drafter(first, reporter)
        # both still learn after their first run: a second run from its output (fresh warmup
        # and cosine, half the peak lr; its own checkpoints)
        more = replace(
            first,
            steps=V2[f"{arch}_more_steps"],
            lr=1e-3,
            init_from=out / arch,
            cache_dir=shared_data(cache, f"drafter2-{arch}-more"),
        )
        train_drafter(more, reporter)
        if arch == "dflash2":
            set_candidates(out / arch, V2["dflash2_candidates"])


def set_candidates(folder: Path, top_k: int) -> None:
    """Set the number of candidates a DFlash 2 drafter's walk chooses from at inference."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dflash_config"]["selector_top_k"] = top_k
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def shared_data(cache: Path, name: str, source: str = "drafter2") -> Path:
    """``cache/name``: a training cache folder of its own (checkpoints) whose ``data`` is that of
    ``cache/source`` (one regeneration serves every drafter run of a version)."""
    data, shared = cache / name / "data", cache / source / "data"
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        shared.mkdir(parents=True, exist_ok=True)
        data.symlink_to(shared.resolve(), target_is_directory=True)
    return cache / name
