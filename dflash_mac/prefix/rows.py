"""The rows of a decode state's caches, cut out by position and put back: what the prefix tree
(`prefix/tree.py`) keeps for each span of tokens.

Attention caches (the target's `KVCache`, the drafter's `ContextCache`) hold one row per
position on axis 2 and can be cut anywhere. Recurrent caches (the GatedDeltaNet layers of
hybrid targets) hold only the state after the last position, so they are kept whole at span
ends. Rotating windows cannot be cut by position: `cacheable` says no for them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..models.dflash import ContextCache

Rows = list[mx.array]  # one layer's arrays over a span of positions ([B, H, n, D] each)


def cacheable(target_cache: list[Any], draft_cache: list[Any]) -> bool:
    """Whether every cache can be cut by position (or, recurrent, kept at span ends)."""
    target = all(type(c) is KVCache or isinstance(c, ArraysCache) for c in target_cache)
    return target and all(position_only(c) or type(c) is ContextCache for c in draft_cache)


def position_only(c: Any) -> bool:
    """A drafter cache that keeps no rows, only how many positions it has seen."""
    return not hasattr(c, "keys") and isinstance(getattr(c, "offset", None), int)


def copy(a: mx.array | None) -> mx.array | None:
    """A copy that owns its memory (a slice would keep the whole buffer alive)."""
    return None if a is None else mx.array(a)


def nbytes(rows: list[Rows | None] | None) -> int:
    return sum(a.nbytes for r in rows or [] if r for a in r if a is not None)


def target_rows(cache: list[Any], start: int, end: int) -> list[Rows | None]:
    """Per layer: the K/V rows of positions [start, end), None for recurrent layers."""
    return [
        None
        if isinstance(c, ArraysCache)
        else [copy(c.keys[..., start:end, :]), copy(c.values[..., start:end, :])]
        for c in cache
    ]


def recurrent_state(cache: list[Any]) -> list[Rows | None] | None:
    """Per layer: a recurrent layer's state after the last cached position (None for attention
    layers); None when the target has no recurrent layers."""
    if not has_recurrent(cache):
        return None
    return [[copy(a) for a in c.cache] if isinstance(c, ArraysCache) else None for c in cache]


def has_recurrent(cache: list[Any]) -> bool:
    return any(isinstance(c, ArraysCache) for c in cache)


def kept_from(c: ContextCache) -> int:
    """The first position of a drafter cache's kept tail (its sink rows come before)."""
    return c.offset - (c.rows - min(c.sink, c.rows)) if c.rows < c.offset else 0


def drafter_rows(cache: list[Any], start: int, end: int) -> list[Rows] | None:
    """Per layer: the drafter's context rows of positions [start, end); None when its window
    dropped some of them."""
    out: list[Rows] = []
    for c in cache:
        if position_only(c):
            out.append([])
            continue
        first, sink = kept_from(c), min(c.sink, c.rows)
        if first == 0 or end <= sink:  # nothing dropped, or inside the sink
            a, b = start, end
        elif start >= first:  # inside the kept tail, which follows the sink rows
            a, b = sink + start - first, sink + end - first
        else:
            return None
        out.append([copy(c.keys[:, :, a:b]), copy(c.values[:, :, a:b])])
    return out


def drafter_kept(cache: list[Any], start: int) -> int:
    """The first position >= `start` from which the drafter still holds every row."""
    firsts = [kept_from(c) for c in cache if not position_only(c)]
    return max([start, *firsts])


def drafter_needs(cache: list[Any], n: int) -> list[tuple[int, int]]:
    """The position ranges whose rows a drafter cache of `n` positions holds (its sink and its
    window, as `ContextCache.update_and_fetch` keeps them)."""
    needs: list[tuple[int, int]] = []
    for c in cache:
        if position_only(c):
            continue
        if c.window is None or n <= c.sink + c.window:
            needs.append((0, n))
        else:
            needs += [(0, c.sink), (n - c.window, n)]
    return needs


def restore_target(cache: list[Any], spans: list[list[Rows | None]], recurrent) -> int:
    """Fill fresh target caches with the concatenated rows of `spans` (in order) and the
    recurrent states at their end; returns the positions restored."""
    n = 0
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            c.cache = [copy(a) for a in recurrent[i]]
            continue
        keys = mx.concatenate([s[i][0] for s in spans], axis=2)
        values = mx.concatenate([s[i][1] for s in spans], axis=2)
        c.keys, c.values, c.offset = keys, values, keys.shape[2]
        n = keys.shape[2]
    return n


def restore_drafter(cache: list[Any], pieces: list[tuple[int, list[Rows] | None]], n: int) -> None:
    """Fill fresh drafter caches for `n` positions from `pieces` ((start, rows) in order, rows
    None where not kept): the rows `drafter_needs` asks for, at their true positions."""
    for i, c in enumerate(cache):
        if position_only(c):
            c.offset = n
            continue
        keys, values = [], []
        for lo, hi in merged(drafter_needs([c], n)):
            for start, rows in pieces:
                end = start + (rows[i][0].shape[2] if rows else 0)
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    keys.append(rows[i][0][:, :, a - start : b - start])
                    values.append(rows[i][1][:, :, a - start : b - start])
        c.keys = mx.concatenate(keys, axis=2) if keys else None
        c.values = mx.concatenate(values, axis=2) if values else None
        c.offset = n


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out
