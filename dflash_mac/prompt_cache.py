"""An LRU of decode states keyed by the token prefix each one holds, so several conversations
(two editor panes, chat + autocomplete) each reuse their own cached prefix.

A request takes the state sharing the longest prefix with its prompt out of the cache, decodes
with it, and puts it back as the most recent entry; entries beyond `max_entries` or
`max_bytes` are dropped, least recently used first."""

from __future__ import annotations

from .decode import DecodeState
from .pair import Pair
from .rollback import RollbackError


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def state_bytes(state: DecodeState) -> int:
    """Memory held by a state's target and drafter caches."""
    total = 0
    for c in state.target_cache + state.draft_cache:
        try:
            total += c.nbytes
        except (AttributeError, NotImplementedError):
            pass
    return total


class PromptCache:
    """LRU of `DecodeState`s (oldest first). Not thread-safe: one decode at a time."""

    def __init__(
        self,
        pair: Pair,
        max_entries: int = 1,
        max_bytes: int | None = None,
        max_kv_size: int | None = None,
    ):
        if max_entries < 1:
            raise ValueError(f"--prompt-cache-size must be at least 1 (got {max_entries}).")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"--prompt-cache-bytes must be >= 0 (got {max_bytes}).")
        self.pair = pair
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_kv_size = max_kv_size  # every state's rotating window (None: unbounded)
        self.entries: list[DecodeState] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(state_bytes(s) for s in self.entries)

    def clear(self) -> None:
        self.entries = []

    def fresh(self) -> DecodeState:
        return DecodeState(self.pair, self.max_kv_size)

    def take(self, ids: list[int]) -> tuple[DecodeState, int]:
        """The state to decode `ids` with, removed from the cache, and how many of its tokens
        are reused (at least one token of `ids` is always left to prefill).

        An entry that is a prefix of `ids` is reused whole. One that shares only part of its
        tokens is cut back (edit, regenerate) when the shared part is at least half of it or
        the cache is full; otherwise it stays for its own conversation and `ids` start fresh."""
        best, keep = None, 0
        for state in self.entries:
            k = min(common_prefix(state.ids, ids), len(ids) - 1)
            if k > keep:
                best, keep = state, k
        if best is None:
            return self.fresh(), 0
        if keep < len(best.ids):
            if 2 * keep < len(best.ids) and len(self.entries) < self.max_entries:
                return self.fresh(), 0
            self.entries.remove(best)
            try:
                best.trim_to(keep)
            except RollbackError:  # caches that cannot be cut: start over
                return self.fresh(), 0
            return best, keep
        self.entries.remove(best)
        return best, keep

    def put(self, state: DecodeState) -> None:
        """Store `state` as the most recent entry; evict by count, then by bytes."""
        self.entries.append(state)
        del self.entries[: max(0, len(self.entries) - self.max_entries)]
        if self.max_bytes is not None:
            sizes = [state_bytes(s) for s in self.entries]
            while self.entries and sum(sizes) > self.max_bytes:
                self.entries.pop(0)
                sizes.pop(0)
