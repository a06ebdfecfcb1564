"""Soft-target distillation (docs/training.md, "Losses"): match q to the target's p_T.

At a sampling temperature T a drafted token is accepted with probability 1 - TV(p_T, q), so a
drafter meant for sampling should put q where p_T is, not only on p's argmax. The targets come
from the SAME frozen target forward that gives the features: the target's hidden state at
position ``a + k - 1`` gives p for the token at ``a + k`` (block position k), the distribution
verification compares the draft against once the drafts before it are accepted.

Soft labels are the top-k of p_T plus one TAIL bucket holding the rest of the mass, so they sum
to 1 and stay small (``[.., k]`` instead of ``[.., V]``). The loss is the forward KL over the
k + 1 buckets, ``KL(p_T || q_T) = Σ_j p_j log(p_j / q_j) + p_tail log(p_tail / q_tail)``, with
``q_T = softmax(drafter logits / T)`` (the q DFlash 1 samples from at temperature T) and
``q_tail`` its mass outside the top-k ids; averaged over the training temperatures.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

LOSS_KINDS = ("ce", "kl", "mix")


@dataclass(frozen=True)
class LossSpec:
    """Which loss a run trains with: CE on the data tokens, KL to p_T, or a mix."""

    kind: str = "ce"
    temperatures: tuple[float, ...] = (1.0,)
    kl_weight: float = 0.5  # mix: (1 - w)·CE + w·KL
    top_k: int = 32

    @property
    def soft(self) -> bool:
        return self.kind != "ce"

    @property
    def ce_weight(self) -> float:
        return {"ce": 1.0, "kl": 0.0}.get(self.kind, 1.0 - self.kl_weight)

    @property
    def kl_part(self) -> float:
        return {"ce": 0.0, "kl": 1.0}.get(self.kind, self.kl_weight)

    def describe(self) -> dict:
        """What the drafter was trained for (stored in its config metadata)."""
        out: dict = {"loss": self.kind}
        if self.soft:
            out.update(
                kl_temperatures=list(self.temperatures),
                kl_weight=self.kl_part,
                top_k_soft=self.top_k,
            )
        return out


@dataclass
class SoftLabels:
    """Top-k soft labels of p_T per drafted position, one set of probabilities per T."""

    ids: mx.array  # [B, N, P, k] int32 token ids (the same for every T)
    probs: mx.array  # [nT, B, N, P, k]
    tail: mx.array  # [nT, B, N, P], 1 - Σ probs
    present: mx.array | None = None  # [B, N, P, k] bool: False for ids given no mass (a
    # draft vocabulary's outsiders, kept as id 0); None: all present

    @property
    def temperatures(self) -> int:
        return self.probs.shape[0]


def label_positions(anchors: mx.array, block_size: int) -> mx.array:
    """Positions whose target distribution block positions 1..bs-1 learn: ``a .. a+bs-2``."""
    return anchors[..., None] + mx.arange(block_size - 1)[None, None]


def top_k_logits(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ids of the top-k logits (in no particular order) and their float32 values."""
    k = min(k, logits.shape[-1])
    logits = logits.astype(mx.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    ids = top_k_ids(flat, k).reshape(*logits.shape[:-1], k)
    return ids, mx.take_along_axis(logits, ids, axis=-1)


def top_k_ids(x: mx.array, k: int, group: int = 128) -> mx.array:
    """Ids of the `k` largest of each row of ``[N, V]``, in two partitions: the `k` groups of
    `group` columns with the largest maxima hold every top-k value (a group holding one has a
    maximum at least as large), so the second partition sees ``k·group`` columns, not `V` (6x
    faster at V = 49k on a CPU). Small vocabularies take one partition."""
    n, v = x.shape
    if v < 4 * k * group:
        return mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    g = mx.pad(x, [(0, 0), (0, -v % group)], constant_values=-mx.inf).reshape(n, -1, group)
    best = mx.argpartition(-g.max(axis=-1), kth=k - 1, axis=-1)[:, :k]  # [N, k] groups
    cand = mx.take_along_axis(g, best[..., None], axis=1).reshape(n, -1)
    pick = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
    cols = (best[..., None] * group + mx.arange(group)).reshape(n, -1)
    return mx.take_along_axis(cols, pick, axis=-1).astype(mx.int32)


def soft_from_top(
    ids: mx.array, top: mx.array, lse: mx.array, temperatures: tuple[float, ...] | list[float]
) -> SoftLabels:
    """Soft labels from the top-k logits ``[..., k]`` and ``log Σ_v exp(logit_v / T)`` for each
    temperature ``[..., nT]``: ``p_T = exp(top / T - lse_T)``; the tail holds the rest."""
    probs = [mx.exp(top / t - lse[..., j : j + 1]) for j, t in enumerate(temperatures)]
    p = mx.stop_gradient(mx.stack(probs))
    return SoftLabels(ids, p, mx.clip(1.0 - p.sum(axis=-1), 0.0, 1.0))


def log_normalisers(logits: mx.array, temperatures: tuple[float, ...] | list[float]) -> mx.array:
    """``log Σ_v exp(logit_v / T)`` per temperature ``[..., nT]``."""
    logits = logits.astype(mx.float32)
    return mx.stack([mx.logsumexp(logits / t, axis=-1) for t in temperatures], axis=-1)


def host_log_normalisers(logits: np.ndarray, temperatures: tuple[float, ...] | list[float]):
    """`log_normalisers` of host logits ``[L, V]`` in NumPy, summed in float64: MLX's CPU
    `exp` is scalar, six times slower than NumPy's over a 49k vocabulary."""
    top = logits.max(axis=-1, keepdims=True)
    shifted = logits - top
    return np.stack(
        [
            top[:, 0] / t + np.log(np.exp(shifted / np.float32(t)).sum(-1, dtype=np.float64))
            for t in temperatures
        ],
        axis=-1,
    ).astype(np.float32)


def top_k_soft(
    logits: mx.array, temperatures: tuple[float, ...] | list[float], k: int
) -> SoftLabels:
    """Soft labels from target logits ``[..., V]``: the top-k ids, their p_T and the tail."""
    ids, top = top_k_logits(logits, k)
    return soft_from_top(ids, top, log_normalisers(logits, temperatures), temperatures)


def target_soft_labels(
    head, hidden: mx.array, anchors: mx.array, block_size: int, spec: LossSpec
) -> SoftLabels:
    """Soft labels of every block from the target's final hidden states ``[B, S, H]``."""
    pos = label_positions(anchors, block_size)  # [B, N, P]
    B, N, P = pos.shape
    h = mx.take_along_axis(hidden, pos.reshape(B, N * P, 1), axis=1).reshape(B, N, P, -1)
    labels = top_k_soft(head.logits(h), spec.temperatures, spec.top_k)
    mx.eval(labels.ids, labels.probs, labels.tail)
    return labels


def _xlogx(p: mx.array) -> mx.array:
    return mx.where(p > 0, p * mx.log(mx.maximum(p, 1e-30)), 0.0)


def topk_kl(
    logits: mx.array,
    ids: mx.array,
    p: mx.array,
    tail: mx.array,
    t: float,
    lse: mx.array | None = None,
    present: mx.array | None = None,
) -> mx.array:
    """KL(p_T || q_T) over the top-k ids + tail bucket, per position ``[...]``.

    logits ``[..., V]`` (drafter), ids / p ``[..., k]``, tail ``[...]``; `lse`: the
    drafter's ``log Σ exp(logits / T)`` when the caller has it. The tail's q is
    ``1 - Σ_top q`` (one pass over the vocabulary fewer than a log-sum-exp of the rest: on a
    CPU the exponentials over ``[.., V]`` are most of a training step)."""
    z = logits.astype(mx.float32) / t
    lse = mx.logsumexp(z, axis=-1) if lse is None else lse
    lq = mx.take_along_axis(z, ids, axis=-1) - lse[..., None]
    q = mx.exp(lq) if present is None else mx.where(present, mx.exp(lq), 0.0)
    lq_tail = mx.log(mx.maximum(1.0 - q.sum(axis=-1), 1e-30))
    kl = (_xlogx(p) - p * lq).sum(axis=-1)
    return kl + _xlogx(tail) - mx.where(tail > 0, tail * lq_tail, 0.0)


def vocab_index(draft_vocab: mx.array, vocab: int) -> mx.array:
    """Target id -> its row in the draft vocabulary ``[V]`` (-1 for ids outside it)."""
    rows = mx.arange(draft_vocab.shape[0], dtype=mx.int32) + 1  # added onto -1
    return mx.full((vocab,), -1, dtype=mx.int32).at[draft_vocab].add(rows)


def to_draft_space(
    index: mx.array, labels: mx.array, soft: SoftLabels | None
) -> tuple[mx.array, mx.array, SoftLabels | None]:
    """Labels and soft labels over a draft vocabulary (`vocab_index`'s map).

    Returns (labels as draft rows, -1 outside; the positions to train, whose data token is in
    the draft vocabulary (EAGLE-3 drops the others); soft labels as draft rows: p_T
    renormalised on the draft vocabulary, ids outside it given no mass and id 0, the tail
    taken to lie inside it)."""
    rows = index[labels]
    keep = rows >= 0
    if soft is None:
        return rows, keep, None
    ids = index[soft.ids]
    inside = ids >= 0
    probs = soft.probs * inside
    z = probs.sum(axis=-1) + soft.tail
    z = mx.where(z > 0, z, 1.0)
    sub = SoftLabels(mx.maximum(ids, 0), probs / z[..., None], soft.tail / z, inside)
    return rows, keep, sub


def soft_kl(
    logits: mx.array, labels: SoftLabels, spec: LossSpec, lses: dict | None = None
) -> mx.array:
    """Mean over the training temperatures of `topk_kl`, per position ``[B, N, P]``
    (`lses`: the drafter's log-normaliser by temperature, where already computed)."""
    lses = lses or {}
    kls = [
        topk_kl(logits, labels.ids, labels.probs[i], labels.tail[i], t, lses.get(t), labels.present)
        for i, t in enumerate(spec.temperatures)
    ]
    return sum(kls) / len(kls)


def position_loss(
    logits: mx.array, labels: mx.array, soft: SoftLabels | None, spec: LossSpec | None
) -> mx.array:
    """Per-position loss ``[B, N, P]``: CE, KL or their mix (as `spec` says). Each
    temperature's log-normaliser over the vocabulary is computed once (CE's is T = 1's)."""
    spec = spec or LossSpec()
    temps = set(spec.temperatures) if spec.kl_part else set()
    if spec.ce_weight:
        temps.add(1.0)
    z = logits.astype(mx.float32)
    lses = {t: mx.logsumexp(z / t if t != 1.0 else z, axis=-1) for t in sorted(temps)}
    out = 0.0
    if spec.ce_weight:  # labels outside a draft vocabulary (-1) are masked by the caller
        picked = mx.take_along_axis(z, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        out = spec.ce_weight * (lses[1.0] - picked)
    if spec.kl_part:
        if soft is None:
            raise ValueError(f"loss {spec.kind} needs the target's soft labels.")
        out = out + spec.kl_part * soft_kl(logits, soft, spec, lses)
    return out


def candidate_mass(cand: mx.array, soft: SoftLabels) -> mx.array:
    """p_T of each candidate ``[nT, ..., k_c]`` (0 for candidates outside the soft top-k)."""
    match = (cand[..., :, None] == soft.ids[..., None, :]).astype(mx.float32)  # [.., kc, k]
    return (match[None] * soft.probs[..., None, :]).sum(axis=-1)


def selector_soft_loss(scores: mx.array, cand: mx.array, soft: SoftLabels, spec: LossSpec):
    """DFlash 2's q over its candidates matched to p_T: ``-Σ_c p_T(c) log q_T(c)`` per position.

    The walk's q at temperature T is ``softmax(scores / T)`` over the k candidates and has no
    mass outside them; the residual mass ``1 - Σ_c p_T(c)`` can only be reduced by the backbone
    moving the candidate set (its own KL term), so it adds a constant here, not a gradient.
    Returns ``(loss [B, N, P], covered mass [nT, B, N, P])``."""
    pc = candidate_mass(cand, soft)  # [nT, B, N, P, kc]
    losses = []
    for i, t in enumerate(spec.temperatures):
        lq = scores / t - mx.logsumexp(scores / t, axis=-1, keepdims=True)
        losses.append(-(pc[i] * lq).sum(axis=-1))
    return sum(losses) / len(losses), pc.sum(axis=-1)
