"""The optimisation loop: AdamW with warmup + cosine, grad clip, checkpoints, reports.

The loop prints nothing; it reports every step (and the time-budget decision) through a
`TrainingCallback`, which the command layer turns into a progress bar and log lines.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn

from dflash_mac.target.structure import target_head

from .args import TrainSettings
from .batches import Batch, batch_indices, make_batch, target_forward
from .blocks import position_weights
from .callback import StepReport, TrainingCallback
from .checkpoint import LoopState, save_checkpoint
from .data import Sequence
from .dflash2_loss import dflash2_loss
from .features import StoreSet
from .forward import LOSSES, layer_masks
from .soft import LossSpec, SoftLabels, target_soft_labels

LOSSES.setdefault("dflash2", dflash2_loss)


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


@dataclass
class Trainee:
    """The drafter being trained, its optimizer and schedule, and what feeds it."""

    drafter: nn.Module
    opt: optim.Optimizer
    sched: Schedule
    target: nn.Module  # frozen; gives the features
    seqs: list[Sequence]
    settings: TrainSettings
    spec: LossSpec = LossSpec()
    store: StoreSet | None = None  # the target's side precomputed (`features.py`)


def make_optimizer(s: TrainSettings, total: int) -> tuple[optim.Optimizer, Schedule]:
    sched = Schedule(s.lr, total, s.warmup_frac)
    return optim.AdamW(learning_rate=sched, weight_decay=s.weight_decay), sched


def target_side(
    t: Trainee, idx: list[int], batch: Batch, head
) -> tuple[mx.array, SoftLabels | None]:
    """Features ``[B, S, n·H]`` and soft labels of a batch: read from the store, else one
    frozen target forward."""
    spec, bs = t.spec, t.settings.block_size
    if t.store is not None:
        feats = t.store.features(idx, batch.tokens.shape[1])
        return feats, t.store.soft(idx, batch.anchors, bs) if spec.soft else None
    feats, hidden = target_forward(
        t.target, t.settings.target_layer_ids, batch.tokens, want_hidden=spec.soft
    )
    if not spec.soft:
        return feats, None
    return feats, target_soft_labels(head, hidden, mx.array(batch.anchors), bs, spec)


def train_loop(
    t: Trainee,
    state: LoopState,
    ckpt: Path,
    settings_key: dict,
    save_every: int,
    minutes: float | None,
    callback: TrainingCallback,
) -> float:
    """Run steps `state.step`..`state.total` (updating `state`); return the training seconds
    of the whole run, earlier processes included."""
    s, drafter = t.settings, t.drafter
    weights = mx.array(position_weights(s.block_size))
    loss_fn = LOSSES[s.arch]

    spec = t.spec
    head = target_head(t.target) if spec.soft and t.store is None else None  # live labels only

    def objective(d, feats, b, masks, soft):
        anchors = mx.array(b.anchors)
        return loss_fn(
            d, feats, b.block_ids, b.labels, anchors, b.valid, masks, weights, soft, spec
        )

    grad_fn = nn.value_and_grad(drafter, objective)
    per_epoch = math.ceil(len(t.seqs) / s.batch_size)
    start = state.step
    t_run = time.perf_counter()
    tok_window: list[tuple[float, int]] = []
    callback.on_start(start, state.total, state.losses)
    try:
        while state.step < state.total:
            step = state.step
            idx = batch_indices(step, len(t.seqs), s.batch_size, s.seed)
            batch = make_batch(t.seqs, idx, step, s)
            masks = layer_masks(drafter, batch.anchors, batch.tokens.shape[1], s.block_size)
            feats, soft = target_side(t, idx, batch, head)
            (loss, acc), grads = grad_fn(drafter, feats, batch, masks, soft)
            grads, _ = optim.clip_grad_norm(grads, s.grad_clip)
            t.opt.update(drafter, grads)
            mx.eval(drafter.parameters(), t.opt.state, loss, acc)
            state.step = step = step + 1
            state.losses.append(round(loss.item(), 5))
            state.blocks += int(batch.valid.sum().item())
            now = time.perf_counter()
            tok_window = (tok_window + [(now, batch.n_tokens)])[-20:]
            tps = (
                sum(n for _, n in tok_window[1:]) / (now - tok_window[0][0])
                if len(tok_window) > 1
                else 0.0
            )
            if not state.budget_fixed and step == min(state.total, 6):
                per_step = (now - t_run) / step
                cap = max(step + 1, int(minutes * 60 / per_step))
                if cap < state.total:
                    state.total = t.sched.total = cap
                    callback.log(
                        f"{minutes:g} min budget at {per_step:.2f} s/step -> "
                        f"{cap} steps ({cap / per_epoch:.2f} epochs)"
                    )
                state.budget_fixed = True
            if step % save_every == 0 or step == state.total:
                save_checkpoint(
                    ckpt, drafter, t.opt, state.meta(settings_key, time.perf_counter() - t_run)
                )
            callback.on_step(
                StepReport(
                    step,
                    state.total,
                    start,
                    state.losses,
                    acc.tolist(),
                    tps,
                    time.perf_counter() - t_run,
                )
            )
    finally:
        callback.on_end()
    return state.elapsed + time.perf_counter() - t_run
