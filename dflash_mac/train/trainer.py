"""Train a DFlash drafter for an mlx-lm target (docs/design.md §10): loop, schedule, checkpoints.

Pipeline: load the target (frozen) -> regenerate responses to the prompts with the target
(cached, `data.py`) -> for each batch of sequences, ONE target forward gives the features of
every position (`FeatureCapture`, exactly as at inference) -> random anchors in the responses,
many blocks per sequence in one drafter pass (`forward.py`) -> position-decayed CE -> AdamW with
warmup + cosine, grad clip 1.0 -> resumable checkpoints -> a z-lab-format drafter folder ->
held-out evaluation with the real runtime (`evaluate.py`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mac.capture import FeatureCapture, target_head, text_model
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel

from .blocks import block_inputs, decay_gamma, position_weights, sample_anchors
from .data import Sequence, load_or_regenerate
from .dflash2_loss import dflash2_config, dflash2_loss
from .forward import LOSSES, layer_masks

LOSSES.setdefault("dflash2", dflash2_loss)
ARCHS = ("dflash", "dflash2")
MASK_TOKEN = "<|mask|>"


class TrainError(ValueError):
    """A training setup that cannot work; the message is one sentence for the user."""


@dataclass
class TrainSettings:
    """Everything that determines the training run (stored in the checkpoint)."""

    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = -1
    arch: str = "dflash"
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    batch_size: int = 4
    anchors: int = 512
    max_length: int = 3072
    seed: int = 0
    intermediate_size: int | None = None
    sliding_window: int | None = None


# -- target and configuration -----------------------------------------------------------------


def target_text_config(target_dir: Path) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def default_layer_ids(n_layers: int, count: int | None = None) -> list[int]:
    """Uniform between layer 1 and L-3 (z-lab: [1, 9, 17, 25, 33] of 36)."""
    lo, hi = 1, max(1, n_layers - 3)
    count = count or (5 if n_layers >= 12 else 3)
    count = max(1, min(count, hi - lo + 1))
    if count == 1:
        return [lo]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def resolve_mask_id(tokenizer: Any, mask_token_id: int | None) -> int:
    """The tokenizer's `<|mask|>` id if it has one, else the explicit id, else an error."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if MASK_TOKEN in vocab:
        return int(vocab[MASK_TOKEN])
    if mask_token_id is not None:
        return int(mask_token_id)
    raise TrainError(
        f"the target tokenizer has no '{MASK_TOKEN}' token; pass --mask-token-id "
        "(a token id the target never needs to produce in a draft block)."
    )


def drafter_config(tcfg: dict, s: TrainSettings) -> dict:
    """z-lab DFlash 1 config.json for a drafter of this target (newer schema + top-level
    `block_size` / `rope_theta` for older readers)."""
    heads = tcfg["num_attention_heads"]
    rope = tcfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", tcfg.get("rope_theta", 1_000_000.0))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": s.intermediate_size or tcfg["intermediate_size"],
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": tcfg.get("num_key_value_heads", heads),
        "head_dim": tcfg.get("head_dim") or tcfg["hidden_size"] // heads,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "vocab_size": tcfg["vocab_size"],
        "max_position_embeddings": tcfg.get("max_position_embeddings", 32768),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": rope.get("rope_type", "default")},
        "num_target_layers": tcfg["num_hidden_layers"],
        "block_size": s.block_size,
        "tie_word_embeddings": False,
        "dtype": "float16",
        "dflash_config": {
            "block_size": s.block_size,
            "mask_token_id": s.mask_token_id,
            "target_layer_ids": list(s.target_layer_ids),
        },
    }
    if tcfg.get("rope_scaling"):
        cfg["rope_scaling"] = tcfg["rope_scaling"]
    if s.sliding_window:  # windowed drafter attention, bidirectional inside the block
        cfg.update(layer_types=["sliding_attention"] * s.num_layers,
                   sliding_window=s.sliding_window, is_causal=False)
    return dflash2_config(cfg) if s.arch == "dflash2" else cfg


def build_drafter(config: dict, target: nn.Module) -> DFlashDraftModel:
    from dflash_mac.loading import build_drafter as build_class  # DFlash 1 or 2 by `architectures`

    drafter = build_class(DraftConfig.from_dict(config))
    tm = text_model(target)
    final_norm = getattr(getattr(tm, "model", None), "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight = mx.array(final_norm.weight)  # the LM head expects its scale
    drafter.bind(target_head(target))
    return drafter


# -- batches ----------------------------------------------------------------------------------


@dataclass
class Batch:
    tokens: mx.array  # [B, S] right-padded
    block_ids: mx.array  # [B, N, bs]
    labels: mx.array  # [B, N, bs-1]
    anchors: np.ndarray  # [B, N] (padding blocks repeat a real anchor)
    valid: mx.array  # [B, N] 1 for real blocks
    n_tokens: int  # real tokens in the batch
    n_blocks: int


def sequence_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Sequence indices of a step: a fixed permutation per epoch (resume-safe)."""
    out = []
    for j in range(batch_size):
        g = step * batch_size + j
        out.append(int(sequence_order(n, seed, g // n)[g % n]))
    return out


def make_batch(seqs: list[Sequence], idx: list[int], step: int, s: TrainSettings) -> Batch:
    """Right-padded tokens and each sequence's random anchors (padded to the batch's max)."""
    toks, anchors = [], []
    for j, i in enumerate(idx):
        seq = np.array(seqs[i].ids[: s.max_length], dtype=np.int32)
        rng = np.random.default_rng([s.seed, step, j])
        toks.append(seq)
        anchors.append(sample_anchors(rng, len(seqs[i].prompt), len(seq), s.block_size,
                                      s.anchors))
    B, S, N = len(toks), max(len(t) for t in toks), max(len(a) for a in anchors)
    padded = np.zeros((B, S), dtype=np.int32)
    blocks = np.zeros((B, N, s.block_size), dtype=np.int32)
    labels = np.zeros((B, N, s.block_size - 1), dtype=np.int32)
    anc = np.zeros((B, N), dtype=np.int32)
    valid = np.zeros((B, N), dtype=np.float32)
    for j, (t, a) in enumerate(zip(toks, anchors)):
        padded[j, : len(t)] = t
        full = np.concatenate([a, np.full(N - len(a), a[0])]) if len(a) < N else a
        ids, lab = block_inputs(t, full, s.block_size, s.mask_token_id)
        blocks[j], labels[j], anc[j], valid[j, : len(a)] = ids, lab, full, 1.0
    return Batch(mx.array(padded), mx.array(blocks), mx.array(labels), anc, mx.array(valid),
                 sum(len(t) for t in toks), int(valid.sum()))


def target_features(target: nn.Module, layer_ids: list[int], tokens: mx.array) -> mx.array:
    """One frozen target forward -> features of every position ``[B, S, n·H]``."""
    tm = text_model(target)
    body = getattr(tm, "model", None)  # the decoder stack without the LM head, when exposed
    with FeatureCapture(target, layer_ids) as cap:
        out = body(tokens) if body is not None else target(tokens)
        feats = mx.stop_gradient(cap.features())
        mx.eval(feats)
    del out
    return feats


# -- schedule, checkpoints --------------------------------------------------------------------


class Schedule:
    """Linear warmup (`warmup_frac` of the steps) then cosine decay to 0."""

    def __init__(self, lr: float, total: int, warmup_frac: float):
        self.lr, self.warmup_frac = lr, warmup_frac
        self.total = total

    def __call__(self, step: mx.array) -> mx.array:
        warm = max(1, int(self.warmup_frac * self.total))
        s = step.astype(mx.float32)
        up = self.lr * (s + 1) / warm
        t = mx.clip((s - warm) / max(1, self.total - warm), 0.0, 1.0)
        down = self.lr * 0.5 * (1 + mx.cos(math.pi * t))
        return mx.where(s < warm, up, down)


def save_checkpoint(ckpt: Path, drafter, opt, meta: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt / "weights.safetensors"),
                        dict(tree_flatten(drafter.parameters())))
    mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    tmp = ckpt / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(ckpt / "meta.json")  # written last: a checkpoint with meta is complete


def load_checkpoint(ckpt: Path, drafter, opt) -> dict:
    meta = json.loads((ckpt / "meta.json").read_text())
    drafter.load_weights(str(ckpt / "weights.safetensors"))
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    return meta


def export_weights(drafter) -> dict[str, mx.array]:
    """Parameters under the checkpoint's key names (DFlash 2 codebooks have no `.weight`)."""
    if hasattr(drafter, "export_weights"):
        return drafter.export_weights()
    return dict(tree_flatten(drafter.parameters()))


def load_init(drafter, folder: Path) -> str:
    """Load an existing drafter's weights (strict names and shapes) as the starting point."""
    from dflash_mac.loading import load_weights

    weights = {k: v.astype(mx.float32) for k, v in load_weights(folder).items()
               if "embed_tokens" not in k and not k.startswith("lm_head")}
    expected = dict(tree_flatten(drafter.parameters()))
    bad = sorted(set(expected) ^ set(weights)) + [
        k for k in weights if k in expected and weights[k].shape != expected[k].shape]
    if bad:
        raise TrainError(f"--init-from {folder} does not match the drafter being trained "
                         f"({bad[:3]}); use the same layers and target.")
    drafter.load_weights(list(weights.items()))
    src = folder / "dflash_training.json"
    steps = json.loads(src.read_text()).get("steps") if src.exists() else None
    return f"{folder}" + (f", {steps} steps" if steps else "")


def save_drafter(drafter, config: dict, out_dir: Path, dtype=mx.float16, extra: dict | None = None):
    """The z-lab drafter folder: config.json + model.safetensors (no embed / lm_head)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in export_weights(drafter).items()}
    config = dict(config, dtype={mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(
        dtype, "float32"))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        (out_dir / "dflash_training.json").write_text(json.dumps(extra, indent=1) + "\n")


# -- the run ----------------------------------------------------------------------------------


def train_drafter(
    target: str | Path,
    prompts: str | Path,
    out_dir: str | Path,
    *,
    block_size: int = 16,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    arch: str = "dflash",
    steps: int | None = None,
    epochs: float = 6.0,
    minutes: float | None = None,
    lr: float = 6e-4,
    batch_size: int = 4,
    anchors: int = 512,
    max_length: int = 3072,
    intermediate_size: int | None = None,
    max_new_tokens: int = 256,
    temp: float = 0.0,
    gen_batch_size: int = 32,
    limit: int | None = None,
    eval_prompts: str | Path | None = None,
    eval_max_tokens: int = 256,
    eval_limit: int | None = None,
    resume: bool = False,
    seed: int = 0,
    save_every: int = 100,
    cache_dir: str | Path | None = None,
    save_dtype: str = "float16",
    init_from: str | Path | None = None,
    sliding_window: int | None = None,
    console: Any = None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train a DFlash drafter for `target` on its own responses to `prompts`; write `out_dir`.

    Length of the run: `steps` if given, else `epochs` over the sequences, capped by a
    wall-clock budget `minutes` (measured on the first steps, then fixed and checkpointed).
    `init_from`: start from an existing drafter folder of the same shape (fine-tuning; a fresh
    schedule, its own checkpoint ``<cache_dir>/checkpoint-finetune``).
    Returns a summary dict (also written to ``out_dir/dflash_training.json``)."""
    from mlx_lm.utils import load as mlx_load
    from rich.console import Console

    from dflash_mac.loading import cast_floats, default_dtype, resolve

    con = console or Console()
    if arch not in ARCHS:
        raise TrainError(f"--arch {arch} is not supported yet (choose from {', '.join(ARCHS)}).")
    if block_size < 2:
        raise TrainError(f"--block-size must be at least 2 (got {block_size}).")
    target_name, prompts, out_dir = str(target), Path(prompts), Path(out_dir)
    target = resolve(target)
    cache_dir = Path(cache_dir) if cache_dir else Path(".cache") / "dflash-train"
    ckpt = cache_dir / ("checkpoint-finetune" if init_from else "checkpoint")
    t_start = time.perf_counter()

    tcfg = target_text_config(target)
    model, tokenizer = mlx_load(str(target))
    dtype = default_dtype()
    if dtype is not None:
        cast_floats(model, dtype)
    model.freeze()
    model.eval()
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = list(target_layer_ids) if target_layer_ids else default_layer_ids(n_layers)
    if bad := [i for i in layer_ids if not 0 <= i < n_layers]:
        raise TrainError(f"target layer ids {bad} are outside the target's {n_layers} layers.")
    s = TrainSettings(block_size=block_size, num_layers=num_layers, target_layer_ids=layer_ids,
                      mask_token_id=resolve_mask_id(tokenizer, mask_token_id), arch=arch, lr=lr,
                      batch_size=batch_size, anchors=anchors, max_length=max_length, seed=seed,
                      intermediate_size=intermediate_size, sliding_window=sliding_window)
    config = drafter_config(tcfg, s)
    con.log(f"target {target_name}: {n_layers} layers, hidden {tcfg['hidden_size']}, vocab "
            f"{tcfg['vocab_size']}; drafter: {num_layers} layer(s), block {block_size}, "
            f"features from layers {layer_ids}, mask id {s.mask_token_id}, "
            f"γ {decay_gamma(block_size):.2f}")

    # -- data
    t0 = time.perf_counter()
    seqs, data_file = load_or_regenerate(
        model, tokenizer, target, prompts, cache_dir / "data", max_tokens=max_new_tokens,
        temp=temp, seed=seed, max_prompt=max(16, max_length - block_size - 1), limit=limit,
        batch_size=gen_batch_size, log=con.log,
        progress=lambda d, n, tok, t: con.log(f"regenerated {d}/{n} ({tok:,} tokens, "
                                              f"{tok / max(t, 1e-9):,.0f} tok/s)"),
    )
    regen_s = time.perf_counter() - t0
    seqs = [q for q in seqs if min(len(q.ids), max_length) - len(q.prompt) >= block_size]
    if not seqs:
        raise TrainError(f"no regenerated response is at least {block_size} tokens long.")
    n_resp = sum(len(q.response) for q in seqs)
    con.log(f"{len(seqs)} training sequences, {n_resp:,} response tokens ({data_file.name})")

    # -- model, optimizer
    mx.random.seed(seed)
    drafter = build_drafter(config, model)
    init_note = None
    if init_from:
        init_note = load_init(drafter, Path(init_from))
        con.log(f"initialised from {init_from} ({init_note})")
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    per_epoch = math.ceil(len(seqs) / batch_size)
    total = steps or max(1, math.ceil(epochs * per_epoch))
    sched = Schedule(lr, total, 0.04)
    opt = optim.AdamW(learning_rate=sched, weight_decay=s.weight_decay)
    weights = mx.array(position_weights(block_size))
    loss_fn = LOSSES[arch]
    settings_key = dict(asdict(s), data=data_file.name, init_from=init_note)
    start, losses, elapsed, budget_fixed = 0, [], 0.0, steps is not None or minutes is None
    if resume and (ckpt / "meta.json").exists():
        meta = json.loads((ckpt / "meta.json").read_text())
        if meta["settings"] != settings_key:
            raise TrainError(f"the checkpoint in {ckpt} was made with other settings; "
                             "drop --resume to start over.")
        meta = load_checkpoint(ckpt, drafter, opt)
        start, total, losses = meta["step"], meta["total_steps"], meta["losses"]
        elapsed, budget_fixed = meta["elapsed"], True
        sched.total = total
        con.log(f"resumed from step {start}/{total} ({ckpt})")
    elif ckpt.exists() and not resume:
        shutil.rmtree(ckpt)
    con.log(f"drafter {n_params / 1e6:.2f}M parameters; {total} steps of {batch_size} "
            f"sequences × ≤{anchors} blocks ({per_epoch} steps/epoch), lr {lr}")

    def objective(d, feats, b, masks):
        return loss_fn(d, feats, b.block_ids, b.labels, mx.array(b.anchors), b.valid, masks,
                       weights)

    grad_fn = nn.value_and_grad(drafter, objective)

    def meta_now(step: int) -> dict:
        return {"step": step, "total_steps": total, "settings": settings_key,
                "losses": losses, "elapsed": elapsed + time.perf_counter() - t_run}

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = [TextColumn("[bold]drafter"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("acc@1 {task.fields[acc]:.2f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn()]
    t_run = time.perf_counter()
    tok_window: list[tuple[float, int]] = []
    step = start
    with Progress(*cols, console=con, transient=False) as bar:
        task = bar.add_task("train", total=total, completed=start,
                            loss=losses[-1] if losses else float("nan"), acc=0.0, tps=0.0)
        while step < total:
            batch = make_batch(seqs, batch_indices(step, len(seqs), batch_size, seed), step, s)
            masks = layer_masks(drafter, batch.anchors, batch.tokens.shape[1], block_size)
            feats = target_features(model, layer_ids, batch.tokens)
            (loss, acc), grads = grad_fn(drafter, feats, batch, masks)
            grads, _ = optim.clip_grad_norm(grads, s.grad_clip)
            opt.update(drafter, grads)
            mx.eval(drafter.parameters(), opt.state, loss, acc)
            step += 1
            losses.append(round(loss.item(), 5))
            now = time.perf_counter()
            tok_window = (tok_window + [(now, batch.n_tokens)])[-20:]
            tps = (sum(n for _, n in tok_window[1:]) / (now - tok_window[0][0])
                   if len(tok_window) > 1 else 0.0)
            if not budget_fixed and step == min(total, 6):
                per_step = (now - t_run) / step
                cap = max(step + 1, int(minutes * 60 / per_step))
                if cap < total:
                    total = sched.total = cap
                    bar.update(task, total=total)
                    con.log(f"{minutes:g} min budget at {per_step:.2f} s/step -> {total} steps "
                            f"({total / per_epoch:.2f} epochs)")
                budget_fixed = True
            bar.update(task, completed=step, loss=float(np.mean(losses[-20:])), tps=tps,
                       acc=float(acc[0].item()))
            if not con.is_terminal and (step % 10 == 0 or step == total):  # logs, nohup
                run_s = time.perf_counter() - t_run
                eta = run_s / max(step - start, 1) * (total - step)
                con.log(f"step {step}/{total} loss {np.mean(losses[-10:]):.3f} acc "
                        + " ".join(f"{a:.2f}" for a in acc.tolist())
                        + f" | {tps:,.0f} tok/s | ETA {eta / 60:.1f} min")
            if step % save_every == 0 or step == total:
                save_checkpoint(ckpt, drafter, opt, meta_now(step))
            if on_step:
                on_step(step, losses[-1])
    train_s = elapsed + time.perf_counter() - t_run

    summary = {
        "target": target_name, "prompts": str(prompts), "sequences": len(seqs),
        "response_tokens": n_resp, "regeneration": {"max_new_tokens": max_new_tokens,
                                                    "temp": temp, "seconds": round(regen_s, 1)},
        "steps": total, "epochs": round(total * batch_size / len(seqs), 3),
        "train_seconds": round(train_s, 1), "parameters": n_params,
        "settings": asdict(s), "final_loss": float(np.mean(losses[-20:])),
        "init_from": init_note,
    }
    out_dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(save_dtype, mx.float32)
    save_drafter(drafter, config, out_dir, out_dtype, summary)
    con.log(f"drafter saved to {out_dir} ({train_s / 60:.1f} min of training)")

    if eval_prompts:
        summary["eval"] = run_eval(target, out_dir, Path(eval_prompts), block_size,
                                   eval_max_tokens, eval_limit, con)
        (out_dir / "dflash_training.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    con.print(f"\nTry it:\n  dflash-mac generate --model {target_name} --draft {out_dir} "
              f"--block-size {min(block_size, 8)} -v \"def fibonacci(n):\"")
    return summary


def run_eval(target: Path, draft: Path, prompts: Path, block_size: int, max_tokens: int,
             limit: int | None, con) -> list[dict]:
    """τ and per-position acceptance at the trained block size and at 5 (real runtime)."""
    from dflash_mac.loading import load

    from .data import encode_prompts, read_prompts
    from .evaluate import evaluate

    pair = load(target, draft)
    ids = encode_prompts(pair.tokenizer, read_prompts(prompts)[:limit], 4096)
    con.log(f"held-out evaluation: {len(ids)} prompts from {prompts}, greedy, max {max_tokens}")
    sizes = sorted({block_size, min(5, block_size)}, reverse=True)
    res = evaluate(pair, ids, sizes, max_tokens, log=con.log)
    return [r.as_dict() for r in res]


__all__ = ["TrainError", "TrainSettings", "train_drafter", "default_layer_ids",
           "drafter_config", "save_drafter"]
