"""Sampling distributions shared by the target (p) and the drafter (q): the request's
transforms (temperature, top-k, top-p, min-p), drawing, and DFlash 2's candidate scatter.

A leaf: the drafters (models/) and the engine (dflash_mac/engine/verify.py) both use it."""

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


# The per-token sampling ops compiled (as mlx-lm compiles its samplers): their elementwise
# chains fuse into a few kernels, which on a CPU is ~8 % of a small model's sampled step.
@mx.compile
def _softmax_scaled(logits: mx.array, inv_temp: mx.array) -> mx.array:
    return mx.softmax(logits.astype(mx.float32) * inv_temp, axis=-1)


@mx.compile
def _categorical_scaled(logits: mx.array, inv_temp: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(logits.astype(mx.float32) * inv_temp, key=key)


@mx.compile
def _categorical_probs(probs: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs), key=key)


def temperature_only(sp: SamplingParams) -> bool:
    """True when the request filters nothing (no top-k, top-p or min-p)."""
    return sp.top_k == 0 and sp.top_p >= 1.0 and sp.min_p == 0.0


def probabilities(logits: mx.array, sp: SamplingParams) -> mx.array:
    """Probabilities after temperature, top-k, top-p and min-p (last axis), in float32."""
    if temperature_only(sp):
        return _softmax_scaled(logits, mx.array(1 / sp.temperature, mx.float32))
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
    if key is None:  # the global generator (its state is not an input of the compiled op)
        return mx.random.categorical(mx.log(probs))
    return _categorical_probs(probs, key)


def sample_logits(logits: mx.array, sp: SamplingParams, key: mx.array | None = None) -> mx.array:
    """Draw from the distribution `probabilities(logits, sp)` describes; with temperature alone
    straight from the scaled logits (a plain step's few ops, as mlx-lm samples)."""
    if not temperature_only(sp):
        return sample(probabilities(logits, sp), key=key)
    if key is None:  # the global generator (its state is not an input of the compiled op)
        return mx.random.categorical(logits.astype(mx.float32) * (1 / sp.temperature))
    return _categorical_scaled(logits, mx.array(1 / sp.temperature, mx.float32), key)


def scatter_candidates(cand: mx.array, q_cand: mx.array, vocab: int) -> mx.array:
    """Dense q [n, V] from probabilities over candidate sets (DFlash 2).

    q(x) = Σ_j q_j [c_j = x]."""
    n, k = cand.shape
    dense = mx.zeros((n, vocab), dtype=mx.float32)
    rows = mx.broadcast_to(mx.arange(n)[:, None], (n, k))
    return dense.at[rows, cand].add(q_cand.astype(mx.float32))
