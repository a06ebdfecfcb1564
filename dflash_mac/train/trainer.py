"""Train a DFlash drafter for an mlx-lm target (docs/design.md §10): the whole run.

Pipeline: load the target (frozen) -> regenerate responses to the prompts with the target
(cached, `data.py`) -> for each batch of sequences, ONE target forward gives the features of
every position (`FeatureCapture`, exactly as at inference, `batches.py`) -> random anchors in
the responses, many blocks per sequence in one drafter pass (`forward.py`) -> position-decayed
CE -> AdamW with warmup + cosine, grad clip 1.0 (`loop.py`) -> resumable checkpoints -> a
z-lab-format drafter folder (`checkpoint.py`) -> held-out evaluation with the real runtime
(`evaluate.py`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from dflash_mac.draft_vocab import control_ids, coverage, rank
from dflash_mac.sizing.choice import quantized_default

from .args import TrainError, TrainingArgs, TrainSettings
from .blocks import decay_gamma
from .callback import TrainingCallback
from .checkpoint import SAVE_DTYPES, LoopState, discard, load_init, resume, save_drafter
from .config import build_drafter, drafter_config, target_text_config, train_settings
from .data import Sequence, load_fixed, load_or_regenerate
from .features import FeatureStore, StoreSet
from .loop import Trainee, make_optimizer, train_loop
from .parallel_features import build_in_workers
from .vocab import token_counts


@dataclass
class TrainingData:
    """The target's own responses to the prompts, kept when long enough to train on."""

    seqs: list[Sequence]
    file: Path  # the regeneration cache they came from (the first, when several)
    response_tokens: int
    seconds: float  # regeneration time (0 when cached)
    parts: list[tuple[Path, int]] = field(default_factory=list)  # (cache file, sequences)


def load_target(target_dir: Path) -> tuple[nn.Module, Any]:
    """The frozen target in the default dtype and its tokenizer (a folder through mlx-lm, a
    GGUF file through `gguf.load`, dequantized to the CPU's fp32)."""
    from mlx_lm.utils import load as mlx_load

    from dflash_mac.loading import gguf
    from dflash_mac.loading.loader import cast_floats, default_dtype

    dtype = default_dtype()
    if gguf.is_gguf(target_dir):
        model, tokenizer, _, _ = gguf.load(target_dir, dtype)
    else:
        model, tokenizer = mlx_load(str(target_dir))
    if dtype is not None:
        cast_floats(model, dtype)
    model.freeze()
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer


def prepare_data(
    model: nn.Module, tokenizer: Any, target_dir: Path, args: TrainingArgs, log
) -> TrainingData:
    """Regenerate (or reload) the responses to every prompts file, once per regeneration
    temperature (greedy and sampled answers to the same prompts), and read the fixed-text
    files; keep sequences with at least one full block. Each (file, temperature) and each
    fixed-text file is a part of its own (one feature store each)."""
    t0 = time.perf_counter()
    seqs, parts = [], []
    longest = max(16, args.max_length - args.block_size - 1)
    # fixed text first: a bad record fails before the answers are generated
    fixed = [load_fixed(tokenizer, path, args.cache_dir / "data", longest) for path in args.fixed]
    for prompts, temp, seed in args.parts:
        part, data_file = load_or_regenerate(
            model,
            tokenizer,
            target_dir,
            prompts,
            args.cache_dir / "data",
            max_tokens=args.max_new_tokens,
            temp=temp,
            seed=seed,
            max_prompt=longest,
            limit=args.limit,
            batch_size=args.gen_batch_size,
            log=log,
            progress=lambda d, n, tok, t: log(
                f"regenerated {d}/{n} ({tok:,} tokens, {tok / max(t, 1e-9):,.0f} tok/s)"
            ),
        )
        part = [
            q for q in part if min(len(q.ids), args.max_length) - len(q.prompt) >= args.block_size
        ]
        seqs += part
        parts.append((data_file, len(part)))
    for part, data_file in fixed:  # fixed text: tokenized, not answered
        part = [
            q for q in part if min(len(q.ids), args.max_length) - len(q.prompt) >= args.block_size
        ]
        log(f"fixed text: {len(part)} sequences, {sum(len(q.response) for q in part):,} tokens")
        seqs += part
        parts.append((data_file, len(part)))
    seconds = time.perf_counter() - t0
    if not seqs:
        raise TrainError(f"no regenerated response is at least {args.block_size} tokens long.")
    return TrainingData(seqs, parts[0][0], sum(len(q.response) for q in seqs), seconds, parts)


def feature_store(
    model: nn.Module,
    s: TrainSettings,
    data: TrainingData,
    args: TrainingArgs,
    log,
    target_dir: Path | None = None,
) -> StoreSet:
    """The target's features (and soft-label logits) of every sequence, computed once: a
    store per data file, so new data adds a store and leaves the others as they are. On a CPU
    with `target_dir` given, unfinished stores are built in one process a core."""
    t0 = time.perf_counter()
    parts, first = [], 0
    for file, n in data.parts:
        parts.append((data.seqs[first : first + n], file))
        first += n
    workers = (os.cpu_count() or 1) if mx.default_device() == mx.cpu else 1
    if target_dir is not None and workers > 1 and len(parts) > 1:
        build_in_workers(
            load_target,
            target_dir,
            parts,
            s.target_layer_ids,
            s.max_length,
            args.loss_spec,
            workers,
            log,
        )
    stores = [
        FeatureStore.open_or_build(
            model,
            s.target_layer_ids,
            seqs,
            file,
            s.max_length,
            args.loss_spec,
            progress=lambda d, n: log(
                f"target features: {d}/{n} sequences ({time.perf_counter() - t0:.0f} s)"
            ),
        )
        for seqs, file in parts
    ]
    store = StoreSet(stores)
    folders = ", ".join(x.folder.name for x in stores)
    log(f"target features of {store.rows:,} tokens in {folders}")
    return store


def draft_vocabulary(
    k: int, data: TrainingData, tokenizer: Any, store: StoreSet | None, vocab: int, log
) -> np.ndarray:
    """The `k` target ids the target's answers use most (`vocab.py`), with its coverage."""
    counts = token_counts(data.seqs, vocab, store)
    ids = rank(counts, control_ids(tokenizer), min(k, vocab))
    answers = [t for q in data.seqs for t in q.response]
    log(
        f"draft vocabulary: {len(ids):,} of {vocab:,} ids, covering "
        f"{coverage(ids, answers):.1%} of the training answers' tokens"
    )
    return ids


def prepare_trainee(
    args: TrainingArgs,
    s: TrainSettings,
    config: dict,
    model: nn.Module,
    seqs: list[Sequence],
    log,
    vocab: np.ndarray | None = None,
) -> tuple[Trainee, str | None]:
    """A seeded new drafter (or `init_from`'s weights) with AdamW over the run's length
    (`steps`, else `epochs`); also returns the note on where the weights came from. `vocab`:
    the draft vocabulary (an `init_from` drafter's own wins)."""
    mx.random.seed(args.seed)
    drafter = build_drafter(config, model, s.layer_init)
    if vocab is not None:
        drafter.set_draft_vocab(mx.array(vocab))
    init_note = None
    if args.init_from:
        init_note = load_init(drafter, args.init_from)
        log(f"initialised from {args.init_from} ({init_note})")
    per_epoch = math.ceil(len(seqs) / s.batch_size)
    opt, sched = make_optimizer(s, args.steps or max(1, math.ceil(args.epochs * per_epoch)))
    return Trainee(drafter, opt, sched, model, seqs, s, args.loss_spec), init_note


def start_state(
    args: TrainingArgs, total: int, trainee: Trainee, settings_key: dict, log
) -> LoopState:
    """A fresh run of `total` steps, or the checkpoint's position on --resume (a fresh run
    discards an old checkpoint)."""
    ckpt = args.checkpoint_dir
    state = resume(ckpt, trainee.drafter, trainee.opt, settings_key) if args.resume else None
    if state is not None:
        trainee.sched.total = state.total
        log(f"resumed from step {state.step}/{state.total} ({ckpt})")
        return state
    if not args.resume:
        discard(ckpt)
    return LoopState(
        step=0, total=total, budget_fixed=args.steps is not None or args.minutes is None
    )


def save_and_evaluate(
    trainee: Trainee,
    config: dict,
    args: TrainingArgs,
    summary: dict,
    target_dir: Path,
    train_s: float,
    log,
) -> dict:
    """Write the drafter folder with its training summary; evaluate it on held-out prompts."""
    out_dtype = SAVE_DTYPES.get(args.save_dtype, mx.float32)
    save_drafter(trainee.drafter, config, args.out_dir, out_dtype, summary)
    log(f"drafter saved to {args.out_dir} ({train_s / 60:.1f} min of training)")
    if args.eval_prompts:
        summary["eval"] = run_eval(
            target_dir,
            args.out_dir,
            args.eval_prompts,
            args.block_size,
            args.eval_max_tokens,
            args.eval_limit,
            log,
        )
        (args.out_dir / "dflash_training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def train_drafter(args: TrainingArgs, callback: TrainingCallback | None = None) -> dict:
    """Train a DFlash drafter for `args.target` on its own responses to `args.prompts`.

    Length of the run: `steps` if given, else `epochs` over the sequences, capped by a
    wall-clock budget `minutes` (measured on the first steps, then fixed and checkpointed).
    `init_from`: start from an existing drafter folder of the same shape (fine-tuning; a fresh
    schedule, its own checkpoint ``<cache_dir>/checkpoint-finetune``).
    Returns a summary dict (also written to ``out_dir/dflash_training.json``)."""
    from dflash_mac.loading.loader import resolve

    cb = callback or TrainingCallback()
    args.check()
    target_dir = resolve(args.target)
    t_start = time.perf_counter()
    tcfg = target_text_config(target_dir)
    model, tokenizer = load_target(target_dir)
    s = train_settings(args, tcfg, tokenizer)
    config = drafter_config(tcfg, s)
    config["dflash_training"]["data_temperatures"] = args.data_temps
    cb.log(
        f"target {args.target}: {tcfg['num_hidden_layers']} layers, hidden "
        f"{tcfg['hidden_size']}, vocab {tcfg['vocab_size']}; drafter: {s.num_layers} "
        f"layer(s), block {s.block_size}, features from layers {s.target_layer_ids}, mask id "
        f"{s.mask_token_id}, γ {decay_gamma(s.block_size):.2f}; loss {s.loss}"
    )

    data = prepare_data(model, tokenizer, target_dir, args, cb.log)
    cb.log(
        f"{len(data.seqs)} training sequences, {data.response_tokens:,} response tokens "
        f"({data.file.name})"
    )

    store = feature_store(model, s, data, args, cb.log, target_dir) if args.cache_features else None
    vocab = None
    if args.draft_vocab:
        vocab = draft_vocabulary(
            args.draft_vocab, data, tokenizer, store, tcfg["vocab_size"], cb.log
        )
    trainee, init_note = prepare_trainee(args, s, config, model, data.seqs, cb.log, vocab)
    trainee.store = store
    n_params = sum(v.size for _, v in tree_flatten(trainee.drafter.parameters()))
    per_epoch = math.ceil(len(data.seqs) / s.batch_size)
    names = "+".join(f.name for f, _ in data.parts)
    settings_key = dict(asdict(s), data=names, init_from=init_note)
    state = start_state(args, trainee.sched.total, trainee, settings_key, cb.log)
    cb.log(
        f"drafter {n_params / 1e6:.2f}M parameters; {state.total} steps of {s.batch_size} "
        f"sequences × ≤{s.anchors} blocks ({per_epoch} steps/epoch), lr {s.lr}"
    )

    train_s = train_loop(
        trainee, state, args.checkpoint_dir, settings_key, args.save_every, args.minutes, cb
    )
    summary = run_summary(args, s, data, state, train_s, n_params, init_note)
    save_and_evaluate(trainee, config, args, summary, target_dir, train_s, cb.log)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return summary


def run_summary(
    args: TrainingArgs,
    s: TrainSettings,
    data: TrainingData,
    state: LoopState,
    train_s: float,
    n_params: int,
    init_note: str | None,
) -> dict:
    return {
        "target": args.target,
        "prompts": str(args.prompts),
        "sequences": len(data.seqs),
        "response_tokens": data.response_tokens,
        "fixed_text": [str(f) for f in args.fixed],
        "regeneration": {
            "max_new_tokens": args.max_new_tokens,
            "temps": args.data_temps,
            "seconds": round(data.seconds, 1),
        },
        "steps": state.total,
        "blocks": state.blocks,
        "epochs": round(state.total * s.batch_size / len(data.seqs), 3),
        "train_seconds": round(train_s, 1),
        "parameters": n_params,
        "settings": asdict(s),
        "loss": dict(s.loss, data_temperatures=args.data_temps),
        "final_loss": float(np.mean(state.losses[-20:])),
        "init_from": init_note,
    }


def run_eval(
    target: Path,
    draft: Path,
    prompts: Path,
    block_size: int,
    max_tokens: int,
    limit: int | None,
    log,
) -> list[dict]:
    """τ and per-position acceptance at the trained block size and at 5 (real runtime)."""
    from dflash_mac.loading.loader import load

    from .data import encode_prompts, read_prompts
    from .evaluate import evaluate

    pair = load(target, draft)
    ids = encode_prompts(pair.tokenizer, read_prompts(prompts)[:limit], 4096)
    log(f"held-out evaluation: {len(ids)} prompts from {prompts}, greedy, max {max_tokens}")
    sizes = sorted({block_size, quantized_default(block_size, None)}, reverse=True)
    res = evaluate(pair, ids, sizes, max_tokens, log=log)
    return [r.as_dict() for r in res]


__all__ = ["train_drafter", "load_target", "prepare_data", "run_eval"]
