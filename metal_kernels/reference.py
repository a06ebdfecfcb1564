"""Exact MLX reference ops for the DFlash 2 kernels.

These define the semantics the Metal kernels reproduce (see docs/kernels.md). They run on
any MLX device and are what `dflash_mac.metal_kernels` dispatches to without Metal.
"""

from __future__ import annotations

import mlx.core as mx


def dynamic_conv(x: mx.array, base: mx.array, dyn: mx.array, group_size: int) -> mx.array:
    """Grouped dynamic causal conv over the block axis.

    Args:
        x: ``[B, L, H]`` activations; the block is the whole ``L`` axis.
        base: ``[K, H]`` one side's base kernel (cast to ``x.dtype``).
        dyn: ``[B, L, K, G]`` per-position group coefficients, ``G = H // group_size``
            (cast to ``x.dtype``); each covers ``group_size`` contiguous channels.
        group_size: channels per group.

    Returns:
        ``[B, L, H]`` in ``x.dtype``: for each tap in order,
        ``out = out + base[tap] * xs`` then ``out = out + dyn[..., tap, :] * xs`` with
        ``xs`` = ``x`` shifted by ``tap`` along ``L`` (zeros for ``t < tap``).
    """
    B, L, H = x.shape
    K = base.shape[0]
    base = base.astype(x.dtype)
    dyn = dyn.astype(x.dtype)
    G = dyn.shape[-1]
    dyn = mx.broadcast_to(dyn[..., None], (B, L, K, G, group_size)).reshape(B, L, K, H)
    out = mx.zeros_like(x)
    for tap in range(K):
        if tap == 0:
            xs = x
        elif tap >= L:
            xs = mx.zeros_like(x)
        else:
            xs = mx.pad(x[:, : L - tap], [(0, 0), (tap, 0), (0, 0)])
        out = out + base[tap] * xs
        out = out + dyn[:, :, tap, :] * xs
    return out


def selector_walk(
    unary: mx.array,
    cand: mx.array,
    g: mx.array,
    pred_codebook: mx.array,
    succ_codebook: mx.array,
    anchor: mx.array,
    temperature: float | mx.array | None = None,
    uniforms: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Sequential candidate-selector walk over one block.

    ``s_j = unary[t, j] + sum_r (PC[pred, r] * g[t, r]) * SC[cand[t, j], r]`` with
    ``pred = anchor`` then the chosen token. Greedy (``temperature`` None or 0):
    ``i = argmax_j s_j``. Sampling: ``q_t = softmax(s / T)``, ``i`` = first ``j`` with
    ``cumsum(q_t)[j] > uniforms[t]`` (``k - 1`` if none).

    Returns:
        ``(path [B, P] int32 tokens, index [B, P] int32 into cand, q [B, P, k] float32 or
        None)``; ``q`` only when sampling. ``uniforms`` is required when sampling.
    """
    B, P, k = unary.shape
    unary = unary.astype(mx.float32)
    g = g.astype(mx.float32)
    cand = cand.astype(mx.int32)
    # a scalar array temperature samples (one compiled walk serves every temperature)
    sample = isinstance(temperature, mx.array) or bool(temperature)
    if sample and uniforms is None:
        raise ValueError("selector_walk needs uniforms [B, P] when sampling.")
    sc_rows = succ_codebook[cand].astype(mx.float32)  # [B, P, k, R]
    pred = anchor.astype(mx.int32).reshape(B)
    paths, indices, qs = [], [], []
    for t in range(P):
        pg = pred_codebook[pred].astype(mx.float32) * g[:, t]  # [B, R]
        s = unary[:, t] + (pg[:, None, :] * sc_rows[:, t]).sum(axis=-1)  # [B, k]
        if sample:
            z = s / temperature
            e = mx.exp(z - z.max(axis=-1, keepdims=True))
            q = e / e.sum(axis=-1, keepdims=True)
            below = mx.cumsum(q, axis=-1) <= uniforms[:, t : t + 1].astype(mx.float32)
            i = mx.minimum(below.astype(mx.int32).sum(axis=-1), k - 1)
            qs.append(q)
        else:
            i = mx.argmax(s, axis=-1).astype(mx.int32)
        pred = mx.take_along_axis(cand[:, t], i[:, None], axis=-1)[:, 0]
        paths.append(pred)
        indices.append(i)
    path = mx.stack(paths, axis=1) if P else mx.zeros((B, 0), mx.int32)
    index = mx.stack(indices, axis=1) if P else mx.zeros((B, 0), mx.int32)
    q = (mx.stack(qs, axis=1) if P else mx.zeros((B, 0, k), mx.float32)) if sample else None
    return path, index, q
