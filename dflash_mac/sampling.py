"""Sampling transforms shared by target (p) and drafter (q), and lossless verification (SPEC §7)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    """Request transforms; `temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> SamplingParams:
        if self.temperature < 0:
            raise ValueError(f"--temp must be >= 0 (got {self.temperature}).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p}).")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (got {self.top_k}).")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"--min-p must be in [0, 1) (got {self.min_p}).")
        return self


def probabilities(logits: mx.array, sp: SamplingParams) -> mx.array:
    """Probabilities after temperature, top-k, top-p and min-p (last axis), in float32."""
    logits = logits.astype(mx.float32) / sp.temperature
    V = logits.shape[-1]
    if 0 < sp.top_k < V:
        kth = mx.sort(logits, axis=-1)[..., V - sp.top_k : V - sp.top_k + 1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if sp.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < sp.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    if sp.min_p > 0.0:
        probs = mx.where(probs >= sp.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)


def sample(probs: mx.array, key: mx.array | None = None) -> mx.array:
    """Draw one index per row from `probs` (zeros never drawn)."""
    return mx.random.categorical(mx.log(probs), key=key)


def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Longest prefix of `drafts` [n] equal to the target's argmax, and the bonus token.

    `target_logits` [n + 1, V] are the verify logits at [anchor, d1..dn]."""
    posterior = mx.argmax(target_logits, axis=-1)  # [n + 1]
    acc = mx.cumprod((drafts == posterior[:-1]).astype(mx.int32)).sum()
    return acc, posterior[acc]


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


def scatter_candidates(cand: mx.array, q_cand: mx.array, vocab: int) -> mx.array:
    """Dense q [n, V] from probabilities over candidate sets (DFlash 2).

    q(x) = Σ_j q_j [c_j = x]."""
    n, k = cand.shape
    dense = mx.zeros((n, vocab), dtype=mx.float32)
    rows = mx.broadcast_to(mx.arange(n)[:, None], (n, k))
    return dense.at[rows, cand].add(q_cand.astype(mx.float32))


def accept_sample_match(drafts: mx.array, p: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Sample-and-match (what other MLX ports ship): the target samples its own token at every
    position and a draft is accepted on equality. Lossless but far lower acceptance; kept for
    comparison only."""
    n = drafts.shape[0]
    own = sample(p, key=key)  # [n + 1]
    acc = mx.cumprod((drafts == own[:n]).astype(mx.int32)).sum()
    return acc, own[acc]
