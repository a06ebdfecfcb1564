"""Multi-turn sessions with prefix reuse: only the uncached suffix of a new prompt is prefilled.

A session keeps an LRU of decode states (`prefix.cache.PromptCache`), one per conversation
by default one, so several conversations can each keep their own prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .api import PromptError, prompt_ids, stream_generate
from .engine.decode import GenerationEvent
from .pair import Pair
from .prefix.cache import PromptCache, common_prefix
from .prefix.disk import DiskTier
from .sizing.files import load_tuning
from .sizing.tuning import AutoTuning

__all__ = ["Session", "common_prefix"]


class Session:
    """Keeps target caches, drafter context caches and the ids they hold between turns.

    A prompt that extends cached ids prefills only its new suffix; an edit, regenerate or
    system-prompt change falls back to the longest common prefix (trim) or a fresh prefill.
    `cache_size` / `cache_bytes` bound how many states (conversations) are kept;
    `max_kv_size` gives each a rotating window (`target/kvwindow.py`).
    Not thread-safe: serve one request at a time."""

    def __init__(
        self,
        pair: Pair,
        cache_size: int = 1,
        cache_bytes: int | None = None,
        tuning: AutoTuning | None = None,
        max_kv_size: int | None = None,
        disk: DiskTier | None = None,
    ):
        self.pair = pair
        # what `--block-size auto` learns, continued from request to request
        self.tuning = tuning if tuning is not None else load_tuning(pair)
        self.cache = PromptCache(pair, cache_size, cache_bytes, max_kv_size, disk)
        self.state = self.cache.fresh()  # the state of the latest request

    def reset(self) -> None:
        """Drop every cached state (after a failure, or to free memory)."""
        self.cache.clear()
        self.state = self.cache.fresh()

    def reuse(self, ids: list[int]) -> int:
        """Take the cached state sharing the longest prefix with `ids` as `self.state` (cut back
        to that prefix, or a fresh one); returns the number of reused tokens."""
        self.state, keep = self.cache.take(ids)
        return keep

    def tokenize(self, prompt: str | list[dict] | list[int], **template: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        return prompt_ids(self.pair.tokenizer, prompt, **template)

    def stream(
        self,
        prompt: str | list[dict] | list[int],
        should_stop: Callable[[], bool] | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationEvent]:
        """Like `stream_generate`, reusing whatever prefix of the prompt is already cached."""
        keys = ("system", "ignore_chat_template", "reasoning", "chat_template_args")
        ids = self.tokenize(prompt, **{k: kwargs.pop(k) for k in keys if k in kwargs})
        self.reuse(ids)
        state = self.state
        try:
            yield from stream_generate(
                self.pair, ids, state=state, should_stop=should_stop, tuning=self.tuning, **kwargs
            )
        except (GeneratorExit, PromptError):  # between cycles / before any: caches match ids
            self.cache.put(state)
            raise
        # any other failure (mid-cycle) leaves the state out of the cache
        self.cache.put(state)
