"""Lossless verification: greedy longest prefix and rejection sampling with the residual
(docs/design.md §7), compiled (one fused graph per block size). The transforms themselves live
in models/distribution.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@mx.compile
def acceptance_odds(drafts: mx.array, q: mx.array, p: mx.array) -> mx.array:
    """[2n] float32: each draft's acceptance probability min(1, p(d) / q(d)), then each
    position's expected acceptance sum(min(p, q)) (drafts, q and p as `accept_sampled`): what
    `auto` counts a sampled cycle by (sizing.acceptance.positions), not the draws themselves."""
    n = drafts.shape[0]
    idx = drafts[:, None]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    took = mx.minimum(p_d / mx.maximum(q_d, 1e-30), 1.0)
    expect = mx.minimum(p[:n], q).sum(axis=-1)
    return mx.concatenate([took, expect]).astype(mx.float32)


def accept_sample_match(drafts: mx.array, p: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Sample-and-match (what other MLX ports ship): the target samples its own token at every
    position and a draft is accepted on equality. Lossless but far lower acceptance; kept for
    comparison only."""
    n = drafts.shape[0]
    own = sample(p, key=key)  # [n + 1]
    acc = mx.cumprod((drafts == own[:n]).astype(mx.int32)).sum()
    return acc, own[acc]


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (after logit bias, penalties and
    the grammar, before temperature and the filters: mlx-lm's `generate_step` logprobs), and
    the `top` most likely tokens there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_rows(logits: mx.array, tokens: mx.array, k: int) -> mx.array:
    """Per row of ``logits [R, V]``: the log-probability of ``tokens [R]`` and the top k (ids,
    then values), flat float32 ``[R * (1 + 2k)]`` (ids are exact in float32 below 2**24)."""
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    cols = [mx.take_along_axis(lp, tokens.astype(mx.int32)[:, None], axis=-1)]
    k = min(k, lp.shape[-1])
    if k:
        idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        cols += [
            mx.take_along_axis(idx, order, axis=-1).astype(mx.float32),
            mx.take_along_axis(vals, order, axis=-1),
        ]
    return mx.concatenate(cols, axis=-1).reshape(-1)


def read_logprobs(flat: list[float], rows: int, tokens: list[int]) -> list[TokenLogprob]:
    """The `TokenLogprob`s of `tokens` (the first rows) out of `logprob_rows`' output for
    `rows` rows, read on the host; tokens the grammar refused (-inf) are left out of `top`."""
    width = len(flat) // rows
    k, out = (width - 1) // 2, []
    for j, token in enumerate(tokens):
        row = flat[j * width : (j + 1) * width]
        top = tuple((int(i), v) for i, v in zip(row[1 : 1 + k], row[1 + k :]) if v > -math.inf)
        out.append(TokenLogprob(token, row[0], top))
    return out
