"""A radix tree over token ids whose nodes hold the cache rows of their tokens, so any request
reuses the longest cached prefix, whichever conversation wrote it (SGLang's radix cache, with
DFlash's second cache beside the target's).

A node's `Span` holds, for its tokens: the target's K/V rows, the drafter's context rows (None
where the drafter's window had dropped them when they were stored) and, for hybrid targets,
the recurrent states after its last token (None where unknown: a node cut in two has no state
at the cut). Two conversations sharing a system prompt share its nodes; a request that
diverges inside a node splits it (copies of the two halves), never cutting either
conversation back. Eviction removes least recently used leaves."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from . import rows
from .rows import Rows


@dataclass
class Span:
    """The cached rows of positions [start, start + len(tokens))."""

    start: int
    tokens: list[int]
    target: list[Rows | None]  # per target layer; None for recurrent layers
    drafter: list[Rows] | None  # per drafter layer; None: not kept
    recurrent: list[Rows | None] | None = None  # recurrent states after the last token

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return rows.nbytes(self.target) + rows.nbytes(self.drafter) + rows.nbytes(self.recurrent)

    def arrays(self) -> list[mx.array]:
        parts = (self.target, self.drafter or [], self.recurrent or [])
        return [a for part in parts for r in part if r for a in r if a is not None]

    def part(self, lo: int, hi: int) -> Span:
        """Positions [lo, hi) of this span (copies); recurrent states only if hi is its end."""

        def cut(layers):
            if layers is None:
                return None
            a, b = lo - self.start, hi - self.start
            return [None if r is None else [rows.copy(x[:, :, a:b]) for x in r] for r in layers]

        keep = self.recurrent if hi == self.end else None
        toks = self.tokens[lo - self.start : hi - self.start]
        out = Span(lo, toks, cut(self.target), cut(self.drafter), keep)
        mx.eval(out.arrays())  # on this thread's stream (the disk writer must not compute)
        return out


@dataclass(eq=False)
class Node:
    span: Span | None  # None at the root
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    used: int = 0  # a tick of the tree's clock (least recently used leaves go first)
    saved: bool = False  # written to the disk tier

    @property
    def end(self) -> int:
        return 0 if self.span is None else self.span.end

    def path(self) -> list[Node]:
        """The nodes from the root's first child down to this one."""
        out, node = [], self
        while node.span is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class PrefixTree:
    """Token-id radix tree of cached spans. Not thread-safe."""

    def __init__(self) -> None:
        self.root = Node(None)
        self.clock = itertools.count(1)
        self.nbytes = 0

    def nodes(self) -> list[Node]:
        out, todo = [], list(self.root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo += node.children.values()
        return out

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes() if not n.children]

    def match(self, ids: list[int]) -> tuple[list[Node], int]:
        """The nodes `ids` runs through (the last one maybe partly) and how many ids match."""
        node, pos, path = self.root, 0, []
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            toks = child.span.tokens
            k = 0
            while k < len(toks) and pos + k < len(ids) and toks[k] == ids[pos + k]:
                k += 1
            path.append(child)
            pos += k
            if k < len(toks):
                break
            node = child
        tick = next(self.clock)
        for n in path:
            n.used = tick
        return path, pos

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` at absolute position `at`; returns the new upper part (its parent)."""
        span = node.span
        upper = Node(span.part(span.start, at), node.parent, used=node.used, saved=False)
        lower = span.part(at, span.end)
        upper.span.recurrent = None
        node.parent.children[span.tokens[0]] = upper
        node.span, node.parent, node.saved = lower, upper, False
        upper.children[lower.tokens[0]] = node
        self.nbytes += upper.span.nbytes + lower.nbytes - span.nbytes
        return upper

    def insert(self, ids: list[int], spans: list[Span]) -> list[Node]:
        """Store `ids` whose positions from `spans[0].start` on are covered by `spans` (in order,
        contiguous); positions before it must already be in the tree. Existing nodes keep their
        rows but gain drafter rows or recurrent states they lacked. Returns the path of `ids`
        (empty when the tree no longer holds the positions before the spans)."""
        path, pos = self.match(ids)
        start = spans[0].start if spans else len(ids)
        if pos < min(start, len(ids)):
            return []
        if path and pos < path[-1].end:  # diverges (or ends) inside a node: split it
            path[-1] = self.split(path[-1], pos)
        for node in path:
            self.upgrade(node, spans)
        parent = path[-1] if path else self.root
        tick = next(self.clock)
        for span in spans:
            if span.end <= pos:
                continue
            piece = span if span.start >= pos else span.part(pos, span.end)
            node = Node(piece, parent, used=tick)
            parent.children[piece.tokens[0]] = node
            self.nbytes += piece.nbytes
            path.append(node)
            parent, pos = node, piece.end
        return path

    def upgrade(self, node: Node, spans: list[Span]) -> None:
        """Give `node` the drafter rows / recurrent state that a covering span has and it lacks."""
        s = node.span
        for span in spans:
            if span.start <= s.start and s.end <= span.end:
                if s.drafter is None and span.drafter is not None:
                    before = s.nbytes
                    s.drafter = span.part(s.start, s.end).drafter
                    self.nbytes += s.nbytes - before
                    node.saved = False
            if span.end == s.end and s.recurrent is None and span.recurrent is not None:
                s.recurrent = span.recurrent
                self.nbytes += rows.nbytes(s.recurrent)
                node.saved = False

    def remove(self, node: Node) -> None:
        """Drop a leaf."""
        assert not node.children
        del node.parent.children[node.span.tokens[0]]
        self.nbytes -= node.span.nbytes

    def evict(self, max_bytes: int | None, max_leaves: int | None) -> list[Node]:
        """Drop least recently used leaves until both bounds hold."""
        dropped = []
        while True:
            leaves = self.leaves()
            over_bytes = max_bytes is not None and self.nbytes > max_bytes
            over_count = max_leaves is not None and len(leaves) > max_leaves
            if not (over_bytes or over_count) or not leaves:
                return dropped
            victim = min(leaves, key=lambda n: n.used)
            self.remove(victim)
            dropped.append(victim)

    def clear(self) -> None:
        self.root = Node(None)
        self.nbytes = 0


def usable(path: list[Node], reach: int, drafter_cache: list[Any], hybrid: bool) -> int:
    """The longest prefix (at most `reach` positions along `path`) a state can be rebuilt at:
    hybrid targets need recurrent states there, and the drafter every row its window holds."""
    ends = [n.end for n in path if n.end < reach]
    for n in sorted({reach, *ends}, reverse=True):
        if n <= 0:
            break
        if hybrid and not any(x.end == n and x.span.recurrent is not None for x in path):
            continue
        needs = rows.drafter_needs(drafter_cache, n)
        if all(
            x.span.drafter is not None
            for x in path
            for lo, hi in needs
            if x.span.start < min(hi, n) and lo < x.end and x.span.start < n
        ):
            return n
    return 0


class SpanRecorder:
    """Collects the spans a request's prefill and decoding write, for the tree (kept by the
    request's `DecodeState`). `max_chunk`: the longest prefill chunk whose drafter rows all
    stay in the drafter's window."""

    def __init__(self, start: int, max_chunk: int):
        self.start, self.max_chunk = start, max_chunk
        self.spans: list[Span] = []

    @property
    def end(self) -> int:
        return self.spans[-1].end if self.spans else self.start

    def chunk(self, ids: list[int], target_cache: list[Any], draft_cache: list[Any]) -> None:
        """Record the positions after `end` up to len(ids), all just written by one pass."""
        lo, hi = self.end, len(ids)
        if hi > lo:
            target = rows.target_rows(target_cache, lo, hi)
            drafter = rows.drafter_rows(draft_cache, lo, hi)
            recurrent = rows.recurrent_state(target_cache)
            span = Span(lo, ids[lo:hi], target, drafter, recurrent)
            mx.eval(span.arrays())  # now: a lazy copy would hold the cache's buffer as it was
            self.spans.append(span)

    def finish(self, ids: list[int], target_cache: list[Any], draft_cache: list[Any]) -> None:
        """Record what decoding committed after the prefill: the drafter's rows only from where
        its window still holds them."""
        lo, hi = self.end, len(ids)
        if hi <= lo:
            return
        offsets = [c.offset for c in target_cache + draft_cache if hasattr(c, "offset")]
        if any(o != hi for o in offsets):  # stopped mid-cycle: keep only what prefill wrote
            return
        kept = min(hi, rows.drafter_kept(draft_cache, lo))
        if kept > lo:
            target = rows.target_rows(target_cache, lo, kept)
            last = rows.recurrent_state(target_cache) if kept == hi else None
            self.spans.append(Span(lo, ids[lo:kept], target, None, last))
        self.chunk(ids, target_cache, draft_cache)
