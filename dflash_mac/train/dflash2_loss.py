"""DFlash 2 training (docs/design.md §10): the conv layers in the many-blocks pass, and the
selector loss.

`train_hidden2` is `forward.train_hidden` with each sublayer wrapped in its
`GroupedDynamicCausalConv` (per block: taps never cross blocks, block position 0 has no left
neighbour). The convs use the differentiable MLX reference op (the Metal kernel has no VJP).

`dflash2_loss` = the DFlash 1 position-decayed CE of the backbone + the selector loss (weight 1):
teacher-forced, predecessor = the true previous token (the anchor at position 1), candidates =
the backbone's real top-k; CE over the k scores against the true token where it is among them,
with the same position weights. The identity initialisation lives in the model's constructor
(`DFlash2DraftModel`), so a fresh DFlash 2 drafter starts equal to DFlash 1.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from dflash_mac.metal_kernels import reference

from .forward import _attention, dflash_loss, draft_space, weighted_mean
from .soft import LossSpec, SoftLabels, position_loss, selector_soft_loss


def dflash2_config(
    cfg: dict, kernel_size: int = 2, group_size: int = 16, rank: int | None = None, top_k: int = 16
) -> dict:
    """Turn a DFlash 1 drafter config.json dict into DFlash 2's (z-lab field names).

    Default selector rank: the published 256, scaled down for narrow drafters (``H / 8``, at
    least 16) so the two ``[V, rank]`` codebooks do not outweigh a small drafter."""
    H = cfg["hidden_size"]
    rank = rank or min(256, max(16, H // 8))
    while group_size > 1 and H % group_size:
        group_size //= 2
    out = dict(cfg, architectures=["DFlash2DraftModel"])
    out["dflash_config"] = dict(
        cfg["dflash_config"],
        conv_kernel_size=kernel_size,
        conv_group_size=group_size,
        selector_rank=rank,
        selector_top_k=min(top_k, cfg["vocab_size"]),
    )
    return out


def _conv(conv, x: mx.array, dyn: mx.array, side: int, N: int) -> mx.array:
    """One side of `conv` over the flat blocks ``x [B, N·bs, H]``; ``dyn [B, N·bs, 2, K, G]``."""
    B, L, H = x.shape
    bs = L // N
    out = reference.dynamic_conv(
        x.reshape(B * N, bs, H),
        conv.base_kernel[side],
        dyn[:, :, side].reshape(B * N, bs, *dyn.shape[3:]),
        conv.group_size,
    )
    return out.reshape(B, L, H)


def train_hidden2(
    drafter, features: mx.array, block_ids: mx.array, anchors: mx.array, masks: list[mx.array]
) -> mx.array:
    """Final-normed DFlash 2 hidden states ``[B, N, bs, H]`` (as `forward.train_hidden`)."""
    B, N, bs = block_ids.shape
    ctx = drafter.project_context(features)  # [B, S, H]
    h = drafter.head.embed(block_ids.reshape(B, N * bs)) * drafter.config.input_embedding_scale
    offsets = anchors.reshape(-1)
    for layer, mask in zip(drafter.layers, masks):
        ac, mc = layer.attention_conv, layer.mlp_conv
        x = layer.input_layernorm(h)
        dyn = ac.coefficients(x)  # [B, N·bs, 2, K, G] from the normed input
        a = _attention(layer.self_attn, _conv(ac, x, dyn, 0, N), ctx, offsets, mask, N)
        h = h + _conv(ac, a, dyn, 1, N)
        x = layer.post_attention_layernorm(h)
        dyn = mc.coefficients(x)
        h = h + _conv(mc, layer.mlp(_conv(mc, x, dyn, 0, N)), dyn, 1, N)
    return drafter.norm(h).reshape(B, N, bs, -1)


def selector_loss(
    selector,
    hidden: mx.array,
    logits: mx.array,
    predecessors: mx.array,
    labels: mx.array,
    valid: mx.array,
    weights: mx.array,
    cand: mx.array | None = None,
    vocab: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Teacher-forced selector CE (`cand`: the candidates, when the caller has them).

    hidden ``[B, N, P, H]`` (block positions 1..bs-1), logits ``[B, N, P, V]``, predecessors and
    labels ``[B, N, P]``, valid ``[B, N]``, weights ``[P]``. Positions whose label is not among
    the top-k candidates are left out. With a draft vocabulary (`vocab`: its target ids) logits,
    candidates and labels are its rows, predecessors target ids. Returns (loss, per-position
    accuracy of the selector's teacher-forced choice ``[P]``, 0 where the label is not a
    candidate)."""
    cand = candidates(selector, logits) if cand is None else cand
    s = candidate_scores(selector, hidden, logits, predecessors, cand, vocab)  # [B, N, P, k]
    match = cand == labels[..., None]  # [B, N, P, k]
    present = match.any(axis=-1).astype(mx.float32) * valid[..., None]  # [B, N, P]
    target = mx.argmax(match.astype(mx.int32), axis=-1)
    ce = nn.losses.cross_entropy(s, target, reduction="none")  # [B, N, P]
    w = present * weights
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    hit = (mx.argmax(s, axis=-1) == target).astype(mx.float32) * present
    acc = hit.sum(axis=(0, 1)) / mx.maximum(valid.sum(), 1)
    return loss, mx.stop_gradient(acc)


def selector_q(
    selector, hidden: mx.array, logits: mx.array, predecessors: mx.array, temperature: float
) -> tuple[mx.array, mx.array, mx.array]:
    """The walk's proposal at ``temperature`` for given predecessors: ``(scores [.., k],
    cand [.., k], q [.., k])`` with ``q = softmax(scores / T)``, the distribution the walk
    draws from and verification uses as q (scattered onto the vocabulary)."""
    unary, cand = selector.candidates(logits)
    s = selector.scores(unary, cand, selector.hidden_projection(hidden), predecessors)
    return s, cand, mx.softmax(s / temperature, axis=-1)


def candidate_scores(selector, hidden, logits, predecessors, cand, vocab=None) -> mx.array:
    """The walk's teacher-forced scores of candidates `cand` (rows of `logits`; target ids
    through `vocab` for the codebooks). The unary term's gradient reaches the backbone."""
    unary = mx.take_along_axis(logits, cand, axis=-1)
    ids = cand if vocab is None else vocab[cand]
    return selector.scores(unary, ids, selector.hidden_projection(hidden), predecessors)


def candidates(selector, logits: mx.array) -> mx.array:
    """The selector's candidate ids ``[.., k]`` (the backbone's top-k; no gradient)."""
    return selector.candidates(mx.stop_gradient(logits))[1]


def selector_distill_loss(
    selector,
    hidden,
    logits,
    predecessors,
    valid,
    weights,
    soft: SoftLabels,
    spec: LossSpec,
    cand: mx.array | None = None,
    vocab: mx.array | None = None,
) -> mx.array:
    """The walk's q over its candidates matched to p_T (teacher-forced predecessors), with
    the position weights; see `soft.selector_soft_loss` (`vocab` as in `selector_loss`)."""
    cand = candidates(selector, logits) if cand is None else cand
    s = candidate_scores(selector, hidden, logits, predecessors, cand, vocab)
    per_pos, _ = selector_soft_loss(s, cand, soft, spec)
    return weighted_mean(per_pos, valid, weights)


def dflash2_loss(
    drafter,
    features,
    block_ids,
    labels,
    anchors,
    valid,
    masks,
    weights: mx.array,
    soft: SoftLabels | None = None,
    spec: LossSpec | None = None,
) -> tuple[mx.array, mx.array]:
    """Backbone loss (CE / KL / mix as for DFlash 1) + selector loss (weight 1): teacher-forced
    CE on the data token and/or the walk's q matched to p_T, mixed like the backbone;
    acc = the selector's top-1."""
    spec = spec or LossSpec()
    hidden = train_hidden2(drafter, features, block_ids, anchors, masks)[:, :, 1:]
    logits = drafter.draft_logits(hidden)  # [B, N, bs-1, K]
    preds = mx.concatenate([block_ids[..., :1], labels[..., :-1]], axis=-1)  # true previous
    rows, keep, soft = draft_space(drafter, labels, valid, soft)
    trained = valid if keep is None else valid[..., None] * keep
    backbone = weighted_mean(position_loss(logits, rows, soft, spec), trained, weights)
    selector, vocab = drafter.candidate_selector, drafter.get("draft_vocab")
    cand = candidates(selector, logits)  # one top-k over the draft vocabulary for both losses
    sel_ce, acc = selector_loss(selector, hidden, logits, preds, rows, valid, weights, cand, vocab)
    sel = spec.ce_weight * sel_ce
    if spec.kl_part:
        sel = sel + spec.kl_part * selector_distill_loss(
            selector, hidden, logits, preds, trained, weights, soft, spec, cand, vocab
        )
    return backbone + sel, acc


__all__ = [
    "dflash2_config",
    "train_hidden2",
    "selector_loss",
    "selector_q",
    "dflash2_loss",
    "dflash_loss",
]
