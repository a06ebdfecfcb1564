"""Training blocks (docs/design.md §10): anchors, block inputs and labels, block-sparse masks,
weights.

A training block for anchor position ``a`` of a token sequence ``t`` is the drafter input
``[t[a], MASK × (bs-1)]``; block position ``k`` (1..bs-1) is trained to predict ``t[a+k]``.
Queries of a block sit at absolute positions ``a .. a+bs-1`` (as at inference, where the anchor
is the last committed token and the context cache holds positions ``0 .. a-1``).

Masks: a block sees the target-feature context STRICTLY BEFORE its anchor, sees itself
bidirectionally (unless the drafter layer is causal / windowed, as at inference), and never sees
another block. `dense_block_mask` is that definition over the flat layout
``[context | block 0 | block 1 | ...]``; the trainer uses the compact per-block layout
`block_mask` (each block row keeps only ``[context | its own block]``, i.e. the diagonal of the
dense mask, since every off-diagonal block of it is all False).
"""

from __future__ import annotations

import math

import numpy as np

# (block size, γ) from the DFlash recipe; other sizes interpolate / extrapolate linearly.
GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def decay_gamma(block_size: int) -> float:
    """γ of the position-decayed loss: 7 at bs 16, 5 at bs 10, 4 at bs 8, linear otherwise."""
    xs, ys = zip(*GAMMA_POINTS)
    if block_size <= xs[0]:
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        return max(1.0, ys[0] + (block_size - xs[0]) * slope)
    if block_size >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + (block_size - xs[-1]) * slope
    return float(np.interp(block_size, xs, ys))


def position_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k = exp(-(k-1)/γ) for block positions k = 1..bs-1 (float32, shape [bs-1])."""
    g = decay_gamma(block_size) if gamma is None else gamma
    return np.array([math.exp(-(k - 1) / g) for k in range(1, block_size)], dtype=np.float32)


def valid_anchors(prompt_len: int, length: int, block_size: int) -> np.ndarray:
    """Anchor positions in the response: ``prompt_len <= a <= length - bs``."""
    return np.arange(prompt_len, length - block_size + 1)


def sample_anchors(
    rng: np.random.Generator, prompt_len: int, length: int, block_size: int, max_anchors: int
) -> np.ndarray:
    """Up to `max_anchors` distinct random anchors in the response, sorted."""
    cand = valid_anchors(prompt_len, length, block_size)
    if len(cand) > max_anchors:
        cand = np.sort(rng.choice(cand, size=max_anchors, replace=False))
    return cand


def block_inputs(
    tokens: np.ndarray, anchors: np.ndarray, block_size: int, mask_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Block ids ``[N, bs]`` = ``[t[a], MASK...]``; labels ``[N, bs-1]`` = ``t[a+1..a+bs-1]``."""
    anchors = np.asarray(anchors)
    n = len(anchors)
    ids = np.full((n, block_size), mask_id, dtype=np.int32)
    ids[:, 0] = tokens[anchors]
    idx = anchors[:, None] + np.arange(1, block_size)[None]
    return ids, np.asarray(tokens, dtype=np.int32)[idx]


def _visible(q_pos, k_pos, causal: bool, window: int | None):
    ok = np.ones(np.broadcast(q_pos, k_pos).shape, dtype=bool)
    if causal:
        ok &= k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def block_mask(
    anchors: np.ndarray,
    n_ctx: int,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
) -> np.ndarray:
    """Compact per-block mask ``[N, bs, n_ctx + bs]`` (True = visible).

    Columns ``0..n_ctx-1`` are context positions ``0..n_ctx-1`` (visible iff ``< anchor``);
    the last ``bs`` columns are the block's own positions ``a..a+bs-1``."""
    a = np.asarray(anchors)[:, None, None]
    q = a + np.arange(block_size)[None, :, None]
    ctx = np.arange(n_ctx)[None, None, :]
    blk = a + np.arange(block_size)[None, None, :]
    ctx_ok = (ctx < a) & _visible(q, ctx, causal, window)
    blk_ok = _visible(q, blk, causal, window)
    return np.concatenate([ctx_ok, blk_ok], axis=-1)


def dense_block_mask(
    anchors: np.ndarray,
    n_ctx: int,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
) -> np.ndarray:
    """The block-sparse mask over the flat layout ``[context | block 0 | ... | block N-1]``:
    ``[N·bs, n_ctx + N·bs]``; block i's rows see context before its anchor and block i only."""
    compact = block_mask(anchors, n_ctx, block_size, causal, window)
    n, bs = len(anchors), block_size
    out = np.zeros((n * bs, n_ctx + n * bs), dtype=bool)
    for i in range(n):
        rows = slice(i * bs, (i + 1) * bs)
        out[rows, :n_ctx] = compact[i, :, :n_ctx]
        out[rows, n_ctx + i * bs : n_ctx + (i + 1) * bs] = compact[i, :, n_ctx:]
    return out
