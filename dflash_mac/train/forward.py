"""Training forward of the DFlash 1 drafter: the inference math, many blocks in one pass.

Layout per sequence (batch row): queries are the blocks laid flat, ``[block 0 | block 1 | ...]``
(``N·bs`` rows); keys are ``[context positions 0..S-1 | the same flat blocks]``; the block-sparse
mask (`blocks.dense_block_mask`) lets a block see the context strictly before its anchor and
itself only. The math is the drafter's own, module by module (docs/design.md §4):
`project_context` (fc + hidden_norm); context K/V from each layer's `self_attn.keys_values` at
absolute positions ``0..S-1``; block queries / K / V with the SAME projections and norms, RoPE at
``a..a+bs-1`` per block (MLX RoPE takes one offset per batch row, so blocks are rows while RoPE is
applied); `o_proj`, the layer norms and the MLP as in `DraftLayer`. `tests/test_train.py` checks
the result equals `drafter(block, cache)` block by block.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .blocks import dense_block_mask
from .soft import LossSpec, SoftLabels, position_loss, to_draft_space, vocab_index


def layer_masks(drafter, anchors: np.ndarray, n_ctx: int, block_size: int) -> list[mx.array]:
    """Per-layer boolean masks ``[B, 1, N·bs, n_ctx + N·bs]`` for anchors ``[B, N]``."""
    cfg = drafter.config
    anchors = np.asarray(anchors).reshape(len(anchors), -1)
    cache: dict = {}
    out = []
    for causal, window in zip(cfg.layer_causal, cfg.layer_window):
        key = (causal, window)
        if key not in cache:
            m = np.stack([dense_block_mask(a, n_ctx, block_size, causal, window) for a in anchors])
            cache[key] = mx.array(m)[:, None]
        out.append(cache[key])
    return out


def _flat(t: mx.array, B: int, N: int) -> mx.array:
    """[B·N, heads, bs, hd] (blocks as rows) -> [B, heads, N·bs, hd] (blocks laid flat)."""
    _, nh, bs, hd = t.shape
    return t.reshape(B, N, nh, bs, hd).transpose(0, 2, 1, 3, 4).reshape(B, nh, N * bs, hd)


def _attention(attn, x: mx.array, ctx: mx.array, offsets: mx.array, mask: mx.array, N: int):
    """`DraftAttention.__call__` for all blocks of a sequence at once (flat layout)."""
    B, L, H = x.shape
    bs = L // N
    xb = x.reshape(B * N, bs, H)
    q = attn.q_norm(attn.q_proj(xb).reshape(B * N, bs, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=offsets)
    k, v = attn.keys_values(xb, offsets)  # block K/V at a..a+bs-1
    ctx_k, ctx_v = attn.keys_values(ctx, 0)  # context K/V at 0..S-1
    keys = mx.concatenate([ctx_k, _flat(k, B, N)], axis=2)
    values = mx.concatenate([ctx_v, _flat(v, B, N)], axis=2)
    out = mx.fast.scaled_dot_product_attention(
        _flat(q, B, N), keys, values, scale=attn.scale, mask=mask
    )
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def train_hidden(
    drafter, features: mx.array, block_ids: mx.array, anchors: mx.array, masks: list[mx.array]
) -> mx.array:
    """Final-normed drafter hidden states ``[B, N, bs, H]``.

    features ``[B, S, n·H]`` (target features of every position); block_ids ``[B, N, bs]``;
    anchors ``[B, N]`` (absolute anchor positions); masks from `layer_masks`."""
    B, N, bs = block_ids.shape
    ctx = drafter.project_context(features)  # [B, S, H]
    h = drafter.head.embed(block_ids.reshape(B, N * bs)) * drafter.config.input_embedding_scale
    offsets = anchors.reshape(-1)
    for layer, mask in zip(drafter.layers, masks):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, offsets, mask, N)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(B, N, bs, -1)


def weighted_mean(per_pos: mx.array, valid: mx.array, weights: mx.array) -> mx.array:
    """Σ w_k·L_k / Σ w_k over the trained positions of per-position losses ``[B, N, P]``;
    `valid`: real blocks ``[B, N]`` or trained positions ``[B, N, P]``."""
    if valid.ndim < per_pos.ndim:
        valid = valid[..., None]
    w = mx.broadcast_to(valid, per_pos.shape) * weights
    return (per_pos * w).sum() / mx.maximum(w.sum(), 1e-6)


def top1_accuracy(logits: mx.array, labels: mx.array, valid: mx.array, keep=None) -> mx.array:
    """Per-position top-1 accuracy ``[P]`` over real blocks (a cheap proxy of acceptance);
    `keep` ``[B, N, P]``: positions a draft can hit (a draft vocabulary's)."""
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32) * valid[..., None]
    hit = hit if keep is None else hit * keep
    return mx.stop_gradient(hit.sum(axis=(0, 1)) / mx.maximum(valid.sum(), 1))


def draft_space(
    drafter, labels: mx.array, valid: mx.array, soft: SoftLabels | None
) -> tuple[mx.array, mx.array | None, SoftLabels | None]:
    """Labels and soft labels as rows of the drafter's logits, and the positions that train
    ``[B, N, P]`` (None: every position of the real blocks). A drafter over the whole
    vocabulary takes them as they are."""
    vocab = drafter.get("draft_vocab")
    if vocab is None:
        return labels, None, soft
    rows, keep, sub = to_draft_space(vocab_index(vocab, drafter.config.vocab_size), labels, soft)
    return rows, keep, sub


def dflash_loss(
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
    """Position-decayed loss, mean over real blocks of Σ_k w_k·L_k / Σ_k w_k; L_k is CE on
    the data token, KL(p_T || q_T) to the target's soft labels, or a mix (`spec`).

    labels ``[B, N, bs-1]``; valid ``[B, N]`` (0 for padding blocks); weights ``[bs-1]``.
    Returns (loss, per-position top-1 accuracy ``[bs-1]``, a cheap proxy of acceptance)."""
    hidden = train_hidden(drafter, features, block_ids, anchors, masks)
    logits = drafter.draft_logits(hidden[:, :, 1:])  # [B, N, bs-1, K]
    rows, keep, soft = draft_space(drafter, labels, valid, soft)
    trained = valid if keep is None else valid[..., None] * keep
    loss = weighted_mean(position_loss(logits, rows, soft, spec), trained, weights)
    return loss, top1_accuracy(logits, rows, valid, keep)


# The per-architecture training loss. DFlash 2 adds its selector loss here (docs/design.md §10):
# register "dflash2" with a function of the same signature returning (loss, acc).
LOSSES = {"dflash": dflash_loss}
