"""The prompt cache: every request reuses the longest prefix any earlier request cached.

Caches that can be cut by position live in a radix tree of token spans (`prefix/tree.py`),
bounded by bytes and by conversations (leaves), with an optional disk tier under it
(`prefix/disk.py`) that survives restarts. A request gets a fresh `DecodeState` rebuilt from
the tree, records what its prefill and decoding write (`SpanRecorder`), and gives it back to
the tree at the end. Rotating windows (`--max-kv-size`) cannot be cut by position, and a
target sharded over ranks must keep its ranks in step: their states are kept whole in a small
LRU instead (`StateLRU`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from ..engine.decode import DecodeState
from ..pair import Pair
from ..target.rollback import RollbackError
from . import rows
from .disk import DiskTier
from .tree import PrefixTree, SpanRecorder, usable


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


@dataclass
class Lookup:
    """Where the last request's prefix came from."""

    source: str = "miss"  # "ram", "disk" or "miss"
    tokens: int = 0
    seconds: float = 0.0


class PromptCache:
    """The prefix tree (or, for rotating windows, an LRU of whole states) of one pair.
    Not thread-safe: one request at a time."""

    def __init__(
        self,
        pair: Pair,
        max_entries: int = 1,
        max_bytes: int | None = None,
        max_kv_size: int | None = None,
        disk: DiskTier | None = None,
    ):
        if max_entries < 1:
            raise ValueError(f"--prompt-cache-size must be at least 1 (got {max_entries}).")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"--prompt-cache-bytes must be >= 0 (got {max_bytes}).")
        self.pair = pair
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_kv_size = max_kv_size  # every state's rotating window (None: unbounded)
        probe = self.fresh()
        # a target sharded over ranks keeps its other ranks' caches in step through forward
        # passes: a state rebuilt from rows on rank 0 alone would leave them behind
        self.shared = pair.mirror is None and rows.cacheable(probe.target_cache, probe.draft_cache)
        self.hybrid = rows.has_recurrent(probe.target_cache)
        self.tree = PrefixTree()
        self.whole = StateLRU(self)  # rotating windows only
        self.disk = disk if self.shared else None
        self.hits: Counter[str] = Counter()
        self.reused = 0  # tokens reused over all requests
        self.last = Lookup()

    def __len__(self) -> int:
        """Conversations held (leaves of the tree)."""
        return len(self.tree.leaves()) if self.shared else len(self.whole.entries)

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes if self.shared else self.whole.nbytes

    def clear(self) -> None:
        self.tree.clear()
        self.whole.entries = []

    def fresh(self) -> DecodeState:
        return DecodeState(self.pair, self.max_kv_size)

    def max_chunk(self, state: DecodeState) -> int:
        """The longest prefill chunk whose drafter rows all stay in its window."""
        windows = [c.window for c in state.draft_cache if getattr(c, "window", None)]
        return min(windows, default=1 << 30)

    def take(self, ids: list[int]) -> tuple[DecodeState, int]:
        """A state holding the longest cached prefix of `ids` (at least one token of `ids` is
        always left to prefill), and its length."""
        t0 = time.perf_counter()
        if not self.shared:
            state, keep = self.whole.take(ids)
            source = "ram" if keep else "miss"
        else:
            state, keep, source = self.rebuild(ids)
            state.record = SpanRecorder(keep, self.max_chunk(state))
        self.hits[source] += 1
        self.reused += keep
        self.last = Lookup(source, keep, time.perf_counter() - t0)
        return state, keep

    def rebuild(self, ids: list[int]) -> tuple[DecodeState, int, str]:
        state, source = self.fresh(), "ram"
        path, reach = self.tree.match(ids)
        keep = usable(path, min(reach, len(ids) - 1), state.draft_cache, self.hybrid)
        if self.disk is not None and keep < len(ids) - 1:
            spans = self.disk.lookup(ids[: len(ids) - 1], keep)
            if spans and self.tree.insert(ids[: spans[-1].end], spans):
                path, reach = self.tree.match(ids)
                longer = usable(path, min(reach, len(ids) - 1), state.draft_cache, self.hybrid)
                keep, source = (longer, "disk") if longer > keep else (keep, source)
                self.evict()
        if keep == 0:
            return state, 0, "miss"
        nodes = [n for n in path if n.span.start < keep]
        parts = [n.span if n.end <= keep else n.span.part(n.span.start, keep) for n in nodes]
        recurrent = next((n.span.recurrent for n in nodes if n.end == keep), None)
        rows.restore_target(state.target_cache, [p.target for p in parts], recurrent)
        pieces = [(p.start, p.drafter) for p in parts]
        rows.restore_drafter(state.draft_cache, pieces, keep)
        state.ids = list(ids[:keep])
        mx.eval([c.state for c in state.target_cache + state.draft_cache if not c.empty()])
        return state, keep, source

    def put(self, state: DecodeState) -> None:
        """Keep what `state` holds: its spans into the tree (and later to disk)."""
        if not self.shared:
            self.whole.put(state)
            return
        record = state.record or SpanRecorder(0, 0)
        state.record = None
        record.finish(state.ids, state.target_cache, state.draft_cache)
        if not record.spans:
            return
        mx.eval([a for s in record.spans for a in s.arrays()])
        path = self.tree.insert(state.ids, record.spans)
        self.evict()
        if self.disk is not None and path:
            self.disk.save(state.ids, [n for n in path if not n.saved])

    def evict(self) -> None:
        self.tree.evict(self.max_bytes, self.max_entries)

    def stats(self) -> dict:
        """Hits by tier, tokens reused and bytes held (the server's stats and metrics)."""
        disk = self.disk.stats() if self.disk is not None else {"bytes": 0, "files": 0}
        return {
            "hits_ram": self.hits["ram"],
            "hits_disk": self.hits["disk"],
            "misses": self.hits["miss"],
            "tokens_reused": self.reused,
            "bytes": self.nbytes,
            "conversations": len(self),
            "disk_bytes": disk["bytes"],
            "disk_files": disk["files"],
            "last": self.last.source,
        }

    def close(self) -> None:
        """Finish pending disk writes."""
        if self.disk is not None:
            self.disk.close()


class StateLRU:
    """Whole decode states (oldest first), for caches that cannot be cut by position: a state
    sharing the longest prefix with a prompt is taken out, cut back if need be, and put back."""

    def __init__(self, owner: PromptCache):
        self.owner = owner
        self.entries: list[DecodeState] = []

    @property
    def nbytes(self) -> int:
        return sum(state_bytes(s) for s in self.entries)

    def take(self, ids: list[int]) -> tuple[DecodeState, int]:
        """An entry that is a prefix of `ids` is reused whole. One that shares only part of its
        tokens is cut back (edit, regenerate) when the shared part is at least half of it or
        the cache is full; otherwise it stays for its own conversation and `ids` start fresh."""
        best, keep = None, 0
        for state in self.entries:
            k = min(common_prefix(state.ids, ids), len(ids) - 1)
            if k > keep:
                best, keep = state, k
        if best is None:
            return self.owner.fresh(), 0
        if keep < len(best.ids):
            if 2 * keep < len(best.ids) and len(self.entries) < self.owner.max_entries:
                return self.owner.fresh(), 0
            self.entries.remove(best)
            try:
                best.trim_to(keep)
            except RollbackError:  # caches that cannot be cut: start over
                return self.owner.fresh(), 0
            return best, keep
        self.entries.remove(best)
        return best, keep

    def put(self, state: DecodeState) -> None:
        """Store `state` as the most recent entry; evict by count, then by bytes."""
        self.entries.append(state)
        del self.entries[: max(0, len(self.entries) - self.owner.max_entries)]
        if self.owner.max_bytes is not None:
            sizes = [state_bytes(s) for s in self.entries]
            while self.entries and sum(sizes) > self.owner.max_bytes:
                self.entries.pop(0)
                sizes.pop(0)
