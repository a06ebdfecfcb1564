"""Committed tokens -> streamed text, with EOS, stop strings and the token budget."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def held_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: what a
    streamer must hold back because the next chunk may complete a tag (a stop string, </think>)."""
    tags = [t for t in tags if t]
    for n in range(min(max((len(t) for t in tags), default=1) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class NoText:
    """The detokenizer of a pair without a tokenizer (random weights of a real model's shape,
    `bench --cost-curve --shape`): ids only, no text."""

    text = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class TextStream:
    """Feeds COMMITTED tokens only; decides when generation ends and what text to emit."""

    def __init__(self, tokenizer: Any, stop: list[str], eos_ids: set[int]):
        self.detok = tokenizer.detokenizer if tokenizer is not None else NoText()
        self.stop = [s for s in stop if s]
        self.eos = set(eos_ids)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._emitted = 0
        self._cut: int | None = None  # text length kept after a stop string
        self.stopped_by: str | None = None  # the stop string that ended the text

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def text(self) -> str:
        text = self.detok.text
        return text if self._cut is None else text[: self._cut]

    def push(self, ids: list[int], max_tokens: int) -> str:
        """Consume committed ids in order; returns the newly printable text."""
        for t in ids:
            if self.finish_reason is not None:
                break
            if t in self.eos:
                self.finish_reason = "stop"
                break
            self.tokens.append(t)
            self.detok.add_token(t)
            if self.stop and self._find_stop() is not None:
                self.finish_reason = "stop"
            elif len(self.tokens) >= max_tokens:
                self.finish_reason = "length"
        if self.finish_reason is not None:
            return self.flush()
        return self._delta(final=False)

    def flush(self) -> str:
        """Finish the text (detokenizer tail, stop-string cut) and return what is left."""
        self.detok.finalize()
        if self.stop:
            self._cut = self._find_stop()
        return self._delta(final=True)

    def _find_stop(self) -> int | None:
        text = self.detok.text
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        at, self.stopped_by = min(hits)
        return at

    def _delta(self, final: bool) -> str:
        text = self.text
        end = len(text)
        if not final:  # hold back a possible start of a stop string
            end -= held_suffix(text, self.stop)
        end = max(end, self._emitted)
        delta, self._emitted = text[self._emitted : end], end
        return delta
