"""`--max-kv-size`: the target keeps a rotating window of its last positions, as mlx-lm's
`RotatingKVCache(max_size, keep=4)` does, in a form speculative decoding can roll back
(docs/design.md §6 step 5; docs/rollback.md).

mlx-lm's rotating cache overwrites its oldest row in place and cannot drop its last rows once
it has wrapped, but a verify pass must give back its rejected positions. `WindowKVCache` keeps
its rows in temporal order instead, with some slack behind the window, and masks every query to
exactly the positions mlx-lm's plain decoding lets it see:

- a single token, or a verify pass (`stepwise`, set by `rollback.TargetRollback.before_verify`):
  each position p sees the first `keep` positions and the last `max_size - keep` up to p (the
  in-place path that plain decoding takes for every generated token);
- a prompt chunk of several tokens: mlx-lm's concatenating path (the held rows cut to the first
  `keep` and the last `max_size - 1 - keep`, then a sliding window of `max_size` over them).

So greedy DFlash output with a window equals mlx-lm's plain decoding with the same
`max_kv_size` (tests/test_kvwindow.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import PromptError, UserError
from ..models.dflash import ContextCache

KEEP = 4  # first positions always kept (mlx-lm's make_prompt_cache: keep=4)
SLACK = 128  # rows kept behind the window: a rollback may reach this far (blocks are <= 16)
COMPACT_EVERY = 64  # stale rows dropped in one copy, not one copy per cycle
STEP = 256  # buffer growth, as mlx-lm's caches


def check_max_kv_size(value: int | None) -> int | None:
    """`--max-kv-size` checked (one sentence on a bad value); None: unbounded."""
    if value is not None and value <= KEEP:
        raise PromptError(
            f"--max-kv-size must be more than {KEEP}: the window keeps the first {KEEP} "
            f"positions and at least one recent one (got {value})."
        )
    return value


class WindowKVCache:
    """One attention layer's K/V over a rotating window of `max_size` positions (the first
    `keep` and the most recent ones), rows in temporal order, trimmable after a verify."""

    def __init__(self, max_size: int, keep: int = KEEP, slack: int = SLACK):
        self.max_size, self.keep, self.slack = max_size, keep, slack
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # positions seen (RoPE's offset)
        self.lo = keep  # first recent position held: keep..lo-1 were dropped
        self.stepwise = False  # the next update is a verify: each position as plain decoding

    @property
    def rows(self) -> int:
        return min(self.keep, self.offset) + max(0, self.offset - self.lo)

    def _lo_after(self) -> int:
        """Where the recent rows start for the next update (the same for every layer: the
        mask is built from layer 0 before any layer updates)."""
        need = self.offset - (self.max_size - self.keep - 1) - self.slack
        return need if need - self.lo >= COMPACT_EVERY else self.lo

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, lo = keys.shape[2], self._lo_after()
        if lo != self.lo:  # drop rows no query can see any more, past the slack
            cut, rows = self.keep + lo - self.lo, self.rows
            self.keys = mx.concatenate(
                [self.keys[..., : self.keep, :], self.keys[..., cut:rows, :]], axis=2
            )
            self.values = mx.concatenate(
                [self.values[..., : self.keep, :], self.values[..., cut:rows, :]], axis=2
            )
            self.lo = lo
        rows = self.rows
        if self.keys is None or rows + n > self.keys.shape[2]:
            size = (rows + n + STEP - 1) // STEP * STEP
            self.keys = self._grown(self.keys, keys, rows, size)
            self.values = self._grown(self.values, values, rows, size)
        self.keys[..., rows : rows + n, :] = keys
        self.values[..., rows : rows + n, :] = values
        self.offset += n
        self.stepwise = False
        return self.keys[..., : rows + n, :], self.values[..., : rows + n, :]

    @staticmethod
    def _grown(buf: mx.array | None, new: mx.array, rows: int, size: int) -> mx.array:
        B, H, _, D = new.shape
        pad = mx.zeros((B, H, size - rows, D), new.dtype)
        return pad if buf is None else mx.concatenate([buf[..., :rows, :], pad], axis=2)

    def positions_after(self, n: int, lo: int) -> mx.array:
        """Absolute positions of the rows once `n` more are appended (recent ones from `lo`)."""
        end = self.offset + n
        return mx.concatenate([mx.arange(min(self.keep, end)), mx.arange(lo, end)])

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ) -> mx.array | None:
        """Boolean [N, rows] mask of the next update's queries (None: every row visible)."""
        P, W, keep, lo = self.offset, self.max_size, self.keep, self._lo_after()
        if N == 1 and window_size is None and not lo <= P - (W - keep):
            return None  # a plain step with no row behind the window
        k = self.positions_after(N, lo)[None]
        q = mx.arange(P, P + N)[:, None]
        if N == 1 or self.stepwise:  # mlx-lm's in-place path, position by position
            seen = (k <= q) & ((k < keep) | (k > q - (W - keep)))
        else:  # mlx-lm's concatenating path: a window of W over its held rows + the chunk
            m = min(P, W - 1)
            if P >= W:
                sink = k < keep
                held = sink | (k >= P - (W - 1 - keep))
                r = mx.where(sink, k, k - P + m)
            else:
                held, r = mx.ones(k.shape, mx.bool_), k
            j = q - P
            seen = held & (r <= m + j) & (r > m + j - W)
        if window_size is not None:
            seen = seen & (q - k < window_size)
        return seen

    def trim(self, n: int) -> int:
        """Drop the last `n` positions, as far back as the rows kept allow; returns how many."""
        floor = 0 if self.lo == self.keep else self.lo + self.max_size - self.keep - 1
        n = max(0, min(n, self.offset - floor))
        self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        return min(self.offset, self.max_size)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def target_cache(pair: Any, max_kv_size: int) -> list[WindowKVCache]:
    """The target's cache bounded to `max_kv_size` positions (mlx-lm's `make_prompt_cache`
    with `max_kv_size`), or one sentence why this target cannot have one."""
    check_max_kv_size(max_kv_size)
    if hasattr(pair.target, "make_cache"):  # mlx-lm would ignore max_kv_size: say so instead
        raise UserError(
            "this model builds its own cache (sliding-window or linear-attention layers); "
            "--max-kv-size cannot bound it."
        )
    if pair.mirror is not None:
        raise UserError("--max-kv-size is not supported with a target sharded over ranks.")
    return [WindowKVCache(max_kv_size) for _ in pair.target.layers]


def bound_context(cache: list[Any], max_kv_size: int) -> None:
    """The drafter's context bounded alike: `max_kv_size` positions (the first `KEEP` and the
    last ones) where its own bound is larger, yet at least `SLACK` recent ones, so that a
    request's end can still cut back its last block."""
    for c in cache:
        if isinstance(c, ContextCache):
            own = c.sink + (c.window if c.window is not None else max_kv_size + 1)
            if own > max_kv_size:
                c.sink = min(c.sink, KEEP)
                c.window = max(max_kv_size - c.sink, SLACK)
