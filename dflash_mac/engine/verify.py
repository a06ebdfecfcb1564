"""Lossless verification: greedy longest prefix and rejection sampling with the residual
(docs/design.md §7), compiled (one fused graph per block size). The transforms themselves live
in models/distribution.py."""

from __future__ import annotations

import mlx.core as mx

from dflash_mac.models.distribution import (  # noqa: F401  (re-exported)
    SamplingParams,
    probabilities,
    sample,
    sample_logits,
    scatter_candidates,
)


@mx.compile
def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Longest prefix of `drafts` [n] equal to the target's argmax, and the bonus token.

    `target_logits` [n + 1, V] are the verify logits at [anchor, d1..dn]."""
    posterior = mx.argmax(target_logits, axis=-1)  # [n + 1]
    acc = mx.cumprod((drafts == posterior[:-1]).astype(mx.int32)).sum()
    return acc, posterior[acc]


@mx.compile
def accept_sampled(
    drafts: mx.array, q: mx.array, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Rejection sampling with the residual (lossless for any q).

    drafts [n] sampled from q [n, V]; p [n + 1, V] target probabilities at [anchor, d1..dn].
    Accept d_i while u_i * q_i(d_i) < p_i(d_i); at the first rejection draw from
    normalize(max(p - q, 0)) (p if empty); if all are accepted draw the bonus from p_n."""
    n = drafts.shape[0]
    k_accept, k_bonus = mx.random.split(key)
    u = mx.random.uniform(shape=(n,), key=k_accept)
    idx = drafts[:, None]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    acc = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    q_ext = mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)])  # q_n = 0: bonus from p
    residual = mx.maximum(p[acc] - q_ext[acc], 0.0)
    mass = residual.sum()
    dist = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[acc])
    return acc, sample(dist, key=k_bonus)


def accept_sample_match(drafts: mx.array, p: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Sample-and-match (what other MLX ports ship): the target samples its own token at every
    position and a draft is accepted on equality. Lossless but far lower acceptance; kept for
    comparison only."""
    n = drafts.shape[0]
    own = sample(p, key=key)  # [n + 1]
    acc = mx.cumprod((drafts == own[:n]).astype(mx.int32)).sum()
    return acc, own[acc]
