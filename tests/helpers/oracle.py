"""An oracle drafter that knows the target's greedy continuation (tests and the rollback
benchmark use it): drafts exactly right, or wrong at a chosen rate."""

from __future__ import annotations

import copy
import random

import mlx.core as mx
from dflash_mac.models.dflash import independent_expansion


class CountingCache:
    """Stands in for a drafter context cache: only the position count matters."""

    def __init__(self) -> None:
        self.offset = 0

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return False

    @property
    def state(self) -> mx.array:
        return mx.array(self.offset)


class OracleDrafter:
    """Proposes `sequence[start+1 : start+bs]` (the known greedy continuation), each token
    replaced by a wrong one with probability `error_rate` (1.0 = always wrong)."""

    def __init__(
        self, real, sequence: list[int], vocab: int, error_rate: float = 0.0, seed: int = 0
    ):
        self.config = real.config
        self.sequence, self.vocab, self.error_rate = sequence, vocab, error_rate
        self.rng = random.Random(seed)

    def make_cache(self) -> list[CountingCache]:
        return [CountingCache()]

    def extend_context(self, features: mx.array, cache: list[CountingCache]) -> None:
        cache[0].offset += features.shape[1]

    def drafts(self, start: int, bs: int) -> tuple[list[int], list[int]]:
        """(drafts, the right tokens) for block positions 1..bs-1 after `start`."""
        rows, right = [], []
        for pos in range(start + 1, start + bs):
            tok = self.sequence[pos] if pos < len(self.sequence) else 0
            right.append(tok)
            if self.rng.random() < self.error_rate:
                tok = (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            rows.append(tok)
        return rows, right

    def __call__(self, block: mx.array, cache: list[CountingCache]) -> mx.array:
        rows, _ = self.drafts(cache[0].offset, block.shape[1])
        return (mx.eye(self.vocab)[mx.array(rows)] * 10.0)[None]

    def expansion(self, block: mx.array, cache: list[CountingCache], k: int):
        """Tree candidates: the draft first and, where it is wrong, the right token second
        (what a drafter whose second choice is right looks like)."""
        rows, right = self.drafts(cache[0].offset, block.shape[0])
        eye = mx.eye(self.vocab)
        logits = eye[mx.array(rows)] * 10.0 + eye[mx.array(right)] * 9.0
        return independent_expansion(logits, k)


def with_drafter(pair, drafter):
    """A shallow copy of `pair` using another drafter."""
    other = copy.copy(pair)
    other.drafter = drafter
    return other
