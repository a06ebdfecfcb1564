"""A request's caches: the target's, the drafter's context, and the ids they hold."""

from __future__ import annotations

from typing import Any, Protocol

from mlx_lm.models.cache import make_prompt_cache

from ..pair import Pair
from ..target.kvwindow import bound_context, target_cache
from ..target.rollback import TargetRollback, trim_caches


class Recorder(Protocol):
    """What the prompt cache records of a request while it prefills (`prefix.tree.SpanRecorder`;
    prefix/ builds on the engine, which imports nothing of it)."""

    max_chunk: int  # the longest prefill chunk whose drafter rows all stay in its window

    def chunk(self, ids: list[int], target_cache: list[Any], draft_cache: list[Any]) -> None:
        """Record the positions after the last recorded one up to len(ids), all just written."""
        ...


class DecodeState:
    """Target cache, drafter context cache and the ids they hold (kept by sessions).

    `max_kv_size`: the target keeps a rotating window of that many positions, as mlx-lm's
    (`target/kvwindow.py`), and the drafter's context is bounded alike; None: unbounded."""

    def __init__(self, pair: Pair, max_kv_size: int | None = None):
        if max_kv_size is None:
            self.target_cache = make_prompt_cache(pair.target)
        else:
            self.target_cache = target_cache(pair, max_kv_size)
        self.rollback = TargetRollback(pair.target, self.target_cache)
        self.draft_cache = pair.drafter.make_cache()
        if max_kv_size is not None:
            bound_context(self.draft_cache, max_kv_size)
        self.max_kv_size = max_kv_size
        self.ids: list[int] = []
        self.record: Recorder | None = None  # what the prompt cache keeps of this request

    def trim_to(self, n: int) -> None:
        """Keep the first `n` cached positions in both caches."""
        extra = len(self.ids) - n
        if extra > 0:
            self.rollback.trim(extra)  # hybrids: only within the last verify, else RollbackError
            trim_caches(self.draft_cache, extra)
            self.ids = self.ids[:n]
