"""Multi-turn sessions with prefix reuse: only the uncached suffix of a new prompt is prefilled."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .decode import DecodeState, GenerationEvent
from .generate import prompt_ids, stream_generate
from .pair import Pair
from .rollback import RollbackError


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    """Keeps the target cache, the drafter context cache and the ids they hold between turns.

    A prompt that extends the cached ids prefills only its new suffix; an edit, regenerate or
    system-prompt change falls back to the longest common prefix (trim) or a fresh prefill.
    Not thread-safe: serve one request at a time."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.state = DecodeState(pair)

    def reset(self) -> None:
        self.state = DecodeState(self.pair)

    def reuse(self, ids: list[int]) -> int:
        """Trim the caches to the longest common prefix with `ids` (at least one token is left
        to prefill); returns the number of reused tokens."""
        keep = common_prefix(self.state.ids, ids)
        keep = min(keep, len(ids) - 1)
        if keep < len(self.state.ids):
            try:
                self.state.trim_to(keep)
            except RollbackError:  # caches that cannot be cut: start over
                self.reset()
                keep = 0
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
        yield from stream_generate(
            self.pair, ids, state=self.state, should_stop=should_stop, **kwargs
        )
