"""Continued pretraining of the bundled target over its whole context (a length curriculum).

The v1 target saw 256-token windows only. This stage starts from its weights and trains on
windows of growing length (for example 512, then 1024, then 2048 tokens), each window starting
at a document boundary and holding whole documents where they fit (`aligned_windows`), so the
model learns to use long prefixes. The token budget is fixed up front (`--tokens`) and split
over the stages by fraction; the learning rate warms up, then decays by cosine over the whole
run. Checkpoints (weights, optimizer, meta) make every stage resumable. `position_losses`
measures the held-out loss per position bucket (0-256, 256-1k, 1k-2k), which tells whether
the long positions are learnt; `context_control` scores the same tokens with a short context
too, which tells whether the long prefixes help.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from .pretrain import TARGET_CONFIG, build_model, get_batch, load_ckpt, loss_fn, save_ckpt

BUCKETS = ((0, 256), (256, 1024), (1024, 2048))


@dataclass
class CurriculumConfig:
    """Hyper-parameters of the continued pretraining."""

    stages: list[tuple[int, float]] = field(
        default_factory=lambda: [(512, 0.2), (1024, 0.3), (2048, 0.5)]
    )  # (sequence length, fraction of the tokens)
    batch_tokens: int = 4096  # tokens per optimizer step (batch = batch_tokens // seq_len)
    tokens: int = 800_000  # total tokens of the run
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ckpt_every: int = 10
    seed: int = 1

    @property
    def max_len(self) -> int:
        return max(s for s, _ in self.stages)


def aligned_windows(tokens: np.ndarray, seq_len: int, eot: int = 0) -> np.ndarray:
    """Start offsets of ``seq_len + 1`` windows that begin at document starts.

    A window holds whole documents while they fit; the next window starts at the first
    document that did not fit whole (so a document cut at a window's end is seen whole in the
    next one when it fits). A document longer than a window is cut into consecutive windows."""
    doc_starts = np.concatenate([[0], np.flatnonzero(tokens[:-1] == eot) + 1])
    last = len(tokens) - seq_len - 1
    out, start, j = [], 0, 0
    while start <= last:
        out.append(start)
        end = start + seq_len
        # the last document start strictly inside (start, end]
        j = int(np.searchsorted(doc_starts, end, side="right")) - 1
        nxt = int(doc_starts[j]) if j >= 0 else start
        start = nxt if nxt > start else end
    return np.array(out, dtype=np.int64)


def lr_at(tokens: int, cc: CurriculumConfig) -> float:
    """Linear warmup then cosine to ``min_lr_frac * lr`` over the run's tokens."""
    warm = max(1, int(cc.warmup_frac * cc.tokens))
    if tokens < warm:
        return cc.lr * max(tokens, 1) / warm
    t = min(1.0, (tokens - warm) / max(1, cc.tokens - warm))
    return cc.lr * (cc.min_lr_frac + (1 - cc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def stage_of(tokens: int, cc: CurriculumConfig) -> int:
    """Index of the curriculum stage that the run's ``tokens``-th token belongs to."""
    acc = 0.0
    for i, (_, frac) in enumerate(cc.stages):
        acc += frac * cc.tokens
        if tokens < acc:
            return i
    return len(cc.stages) - 1


def eval_windows(tokens: np.ndarray, seq_len: int, n_windows: int | None, eot: int = 0):
    """Start offsets of ``n_windows`` aligned windows spread evenly over the stream (all of
    them when None or when there are fewer)."""
    starts = aligned_windows(tokens, seq_len, eot)
    if n_windows is not None and len(starts) > n_windows:
        starts = starts[np.linspace(0, len(starts) - 1, n_windows).round().astype(int)]
    return starts


def token_losses(model: nn.Module, window: mx.array) -> np.ndarray:
    """Next-token losses of a ``[1, n + 1]`` window (n values)."""
    ce = nn.losses.cross_entropy(model(window[:, :-1]), window[:, 1:], reduction="none")
    return np.array(ce[0].astype(mx.float32))


def bucket_means(per_pos: np.ndarray, seq_len: int) -> dict[str, float]:
    return {f"{a}-{b}": round(float(per_pos[a:b].mean()), 4) for a, b in BUCKETS if b <= seq_len}


def position_losses(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int = 2048,
    n_windows: int | None = 8,
    eot: int = 0,
) -> dict[str, float]:
    """Held-out next-token loss per position bucket over ``n_windows`` aligned windows."""
    starts = eval_windows(tokens, seq_len, n_windows, eot)
    sums = np.zeros(seq_len)
    for s in starts:
        sums += token_losses(model, get_batch(tokens, np.array([s]), seq_len))
    return bucket_means(sums / max(len(starts), 1), seq_len)


def context_control(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int = 2048,
    n_windows: int | None = None,
    short: int = 256,
    eot: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Loss per position bucket with the whole window as context (`full`) and, for the same
    tokens, with only the ``short`` tokens before each chunk of ``short`` targets (`short`).

    The buckets differ in what they hold (a window's first tokens are a document's opening),
    so `full` alone does not say whether long prefixes help; `short - full` at 1k-2k does
    (positive: the model uses its long context; negative: it is hurt by it)."""
    starts = eval_windows(tokens, seq_len, n_windows, eot)
    full, cut = np.zeros(seq_len), np.zeros(seq_len)
    for i, s in enumerate(starts):
        window = get_batch(tokens, np.array([s]), seq_len)  # [1, seq_len + 1]
        losses = token_losses(model, window)
        full += losses
        cut[:short] += losses[:short]  # these have no longer context to cut
        for p in range(short, seq_len, short):
            cut[p : p + short] += token_losses(model, window[:, p - short : p + short + 1])[short:]
        if progress:
            progress(i + 1, len(starts))
    n = max(len(starts), 1)
    return {
        "full": bucket_means(full / n, seq_len),
        "short": bucket_means(cut / n, seq_len),
        "windows": len(starts),
    }


def continue_pretraining(
    init: Path,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray,
    ckpt_dir: Path,
    cc: CurriculumConfig,
    log: Callable[[str], None] = print,
) -> tuple[nn.Module, dict]:
    """Train (or resume) from the weights in ``init``; return the model and the run's figures."""
    model = build_model(seed=cc.seed)
    model.load_weights(str(Path(init) / "model.safetensors"))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    opt = optim.AdamW(
        learning_rate=cc.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=cc.weight_decay
    )
    meta = load_ckpt(model, opt, ckpt_dir)
    if meta is None:
        meta = {"step": 0, "tokens": 0, "stage_windows": [0] * len(cc.stages), "curve": []}
        meta["train_seconds"] = 0.0
        meta["initial_position_loss"] = position_losses(model, eval_tokens, cc.max_len)
        log(f"start from {init}: held-out loss by position {meta['initial_position_loss']}")
    else:
        log(f"resumed at step {meta['step']}, {meta['tokens']:,} tokens")
    meta["config"] = asdict(cc)
    state = [model.state, opt.state]
    orders = [
        np.random.default_rng([cc.seed, s]).permutation(aligned_windows(train_tokens, s))
        for s, _ in cc.stages
    ]
    t_start = time.perf_counter() - meta["train_seconds"]
    ema, t_mark, tok_mark = None, time.perf_counter(), 0
    while meta["tokens"] < cc.tokens:
        i = stage_of(meta["tokens"], cc)
        seq_len = cc.stages[i][0]
        bsz = max(1, cc.batch_tokens // seq_len)
        w = meta["stage_windows"][i]
        starts = orders[i][np.arange(w, w + bsz) % len(orders[i])]
        opt.learning_rate = mx.array(lr_at(meta["tokens"], cc))
        loss, grads = nn.value_and_grad(model, loss_fn)(
            model, get_batch(train_tokens, starts, seq_len)
        )
        grads, _ = optim.clip_grad_norm(grads, cc.grad_clip)
        opt.update(model, grads)
        mx.eval(state, loss)
        meta["step"] += 1
        meta["stage_windows"][i] += bsz
        meta["tokens"] += bsz * seq_len
        tok_mark += bsz * seq_len
        lv = loss.item()
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        done = meta["tokens"] >= cc.tokens
        if meta["step"] % 5 == 0:
            tps = tok_mark / max(1e-9, time.perf_counter() - t_mark)
            log(
                f"step {meta['step']} seq {seq_len} tokens {meta['tokens']:,}/{cc.tokens:,} "
                f"loss {ema:.3f} {tps:.0f} tok/s"
            )
            t_mark, tok_mark = time.perf_counter(), 0
        if meta["step"] % cc.ckpt_every == 0 or done:
            meta["train_seconds"] = time.perf_counter() - t_start
            meta["curve"].append(
                {
                    "step": meta["step"],
                    "tokens": meta["tokens"],
                    "seq_len": seq_len,
                    "train_loss": round(ema, 4),
                    "seconds": round(meta["train_seconds"], 1),
                }
            )
            save_ckpt(model, opt, meta, ckpt_dir)
    meta["position_loss"] = position_losses(model, eval_tokens, cc.max_len)
    meta["train_seconds"] = round(time.perf_counter() - t_start, 1)
    meta["n_params"] = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"held-out loss by position {meta['position_loss']}")
    return model, meta


def target_config(max_len: int) -> dict:
    """The target's config.json with an honest context length (the longest trained window)."""
    return dict(TARGET_CONFIG, max_position_embeddings=max_len)


def write_meta(path: Path, meta: dict) -> None:
    path.write_text(json.dumps(meta, indent=1))
