"""Pretrain the bundled qwen3 target from scratch in MLX (fp32, AdamW, warmup + cosine).

The token budget is set from a wall-clock budget: the first steps are timed and the total step
count is fixed from the measured tokens/s, then stored in the checkpoint so a resumed run keeps
the same schedule. Checkpoints (weights, optimizer state, meta) go to ``ckpt_dir``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3

TARGET_CONFIG: dict = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": [2, 0],
    "pad_token_id": 0,
    "torch_dtype": "float16",
}


@dataclass
class TrainConfig:
    """Hyper-parameters of the pretraining run."""

    seq_len: int = 256
    batch_size: int = 12
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.04
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    minutes: float = 30.0
    calib_steps: int = 6
    ckpt_every: int = 50
    seed: int = 0
    compile: bool = False
    recalibrate: bool = False


def build_model(config: dict | None = None, seed: int = 0) -> qwen3.Model:
    """A freshly initialised qwen3 model (GPT-2 style init, scaled residual projections)."""
    cfg = config or TARGET_CONFIG
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    std, n_layers = 0.02, cfg["num_hidden_layers"]
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 2:
            out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
            s = std / math.sqrt(2 * n_layers) if out_proj else std
            p = s * mx.random.normal(p.shape)
        params.append((name, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def batch_windows(tokens: np.ndarray, seq_len: int, seed: int) -> np.ndarray:
    """Start offsets of non-overlapping ``seq_len+1`` windows, in a seeded random order."""
    n = (len(tokens) - 1) // seq_len
    return np.random.default_rng(seed).permutation(n) * seq_len


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> mx.array:
    """Stack ``seq_len+1`` windows starting at ``starts`` into an int32 batch."""
    return mx.array(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32))


def loss_fn(model: nn.Module, batch: mx.array) -> mx.array:
    """Mean next-token cross-entropy."""
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def lr_at(tokens: int, total: int, tc: TrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_frac * lr``, in units of tokens."""
    warm = max(1, int(tc.warmup_frac * total))
    if tokens < warm:
        return tc.lr * max(tokens, 1) / warm
    t = min(1.0, (tokens - warm) / max(1, total - warm))
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def save_ckpt(model: nn.Module, opt: optim.Optimizer, meta: dict, ckpt_dir: Path) -> None:
    """Write weights, optimizer state and meta (atomic-ish: meta written last)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(ckpt_dir / "weights.safetensors"), weights)
    mx.save_safetensors(str(ckpt_dir / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    tmp = ckpt_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(ckpt_dir / "meta.json")


def load_ckpt(model: nn.Module, opt: optim.Optimizer, ckpt_dir: Path) -> dict | None:
    """Restore a checkpoint if one exists; return its meta."""
    if not (ckpt_dir / "meta.json").exists():
        return None
    model.load_weights(str(ckpt_dir / "weights.safetensors"))
    opt.state = tree_unflatten(list(mx.load(str(ckpt_dir / "optimizer.safetensors")).items()))
    return json.loads((ckpt_dir / "meta.json").read_text())


def evaluate(model: nn.Module, tokens: np.ndarray, seq_len: int, n_batches: int = 8) -> float:
    """Mean loss over the first ``n_batches`` x 8 windows of ``tokens``."""
    starts = np.arange((len(tokens) - 1) // seq_len)[: n_batches * 8] * seq_len
    losses = [
        loss_fn(model, get_batch(tokens, starts[i : i + 8], seq_len)).item()
        for i in range(0, len(starts), 8)
    ]
    return float(np.mean(losses)) if losses else float("nan")


Progress = Callable[[int, int, float, float], None]  # (tokens, total, loss, tokens_per_s)


def pretrain(
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray,
    ckpt_dir: Path,
    tc: TrainConfig,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> tuple[nn.Module, dict]:
    """Train (or resume) the target; return the model and the run's meta/figures."""
    model = build_model(seed=tc.seed)
    opt = optim.AdamW(
        learning_rate=tc.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=tc.weight_decay
    )
    meta = load_ckpt(model, opt, ckpt_dir) or {
        "step": 0,
        "windows": 0,
        "total_tokens": None,
        "train_seconds": 0.0,
        "curve": [],
        "n_params": sum(v.size for _, v in tree_flatten(model.parameters())),
        "config": TARGET_CONFIG,
    }
    meta["train"] = asdict(tc)
    if meta["step"]:
        log(f"resumed at step {meta['step']}, {meta['windows'] * tc.seq_len:,} tokens")
        if tc.recalibrate:
            meta["total_tokens"] = None
    state = [model.state, opt.state, mx.random.state]

    def step_fn(batch: mx.array) -> mx.array:
        loss, grads = nn.value_and_grad(model, loss_fn)(model, batch)
        grads, _ = optim.clip_grad_norm(grads, tc.grad_clip)
        opt.update(model, grads)
        return loss

    if tc.compile:
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)
    order = batch_windows(train_tokens, tc.seq_len, tc.seed)
    per_step = tc.batch_size * tc.seq_len
    t_mark, tok_mark, ema, n_here = time.perf_counter(), 0, None, 0
    t_start = time.perf_counter() - meta["train_seconds"]
    while meta["total_tokens"] is None or meta["windows"] * tc.seq_len < meta["total_tokens"]:
        tokens = meta["windows"] * tc.seq_len
        opt.learning_rate = mx.array(lr_at(tokens, meta["total_tokens"] or 10**12, tc))
        idx = np.arange(meta["windows"], meta["windows"] + tc.batch_size) % len(order)
        loss = step_fn(get_batch(train_tokens, order[idx], tc.seq_len))
        mx.eval(state, loss)
        meta["step"] += 1
        meta["windows"] += tc.batch_size
        n_here += 1
        lv = loss.item()
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        tok_mark += per_step
        elapsed = time.perf_counter() - t_start
        tps = tok_mark / max(1e-9, time.perf_counter() - t_mark)
        if meta["total_tokens"] is None and n_here == tc.calib_steps:
            t_mark, tok_mark = time.perf_counter(), 0  # first steps include compile time
        if meta["total_tokens"] is None and n_here == 2 * tc.calib_steps:
            remaining = tc.minutes * 60 - elapsed
            meta["total_tokens"] = tokens + per_step + max(per_step, int(remaining * tps))
            log(f"measured {tps:.0f} tok/s -> total {meta['total_tokens'] / 1e6:.2f}M tokens")
        done_tokens = meta["windows"] * tc.seq_len
        if progress:
            progress(done_tokens, meta["total_tokens"] or 0, ema, tps)
        done = meta["total_tokens"] is not None and done_tokens >= meta["total_tokens"]
        if meta["step"] % tc.ckpt_every == 0 or done:
            ev = evaluate(model, eval_tokens, tc.seq_len)
            meta["curve"].append(
                {
                    "step": meta["step"],
                    "tokens": done_tokens,
                    "train_loss": round(ema, 4),
                    "eval_loss": round(ev, 4),
                    "seconds": round(elapsed, 1),
                    "tok_per_s": round(tps, 1),
                }
            )
            meta["train_seconds"] = elapsed
            save_ckpt(model, opt, meta, ckpt_dir)
            log(json.dumps(meta["curve"][-1]))
    meta["tokens_trained"] = meta["windows"] * tc.seq_len
    meta["epochs"] = round(meta["windows"] / len(order), 3)
    return model, meta


def save_target(model: nn.Module, out_dir: Path, config: dict | None = None) -> None:
    """Save weights as float16 safetensors plus ``config.json`` (mlx_lm/HF loadable)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config or TARGET_CONFIG, indent=2) + "\n")
    gen = {"eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
