"""Rank 0 of a distributed pair: every target forward is mirrored on the other ranks.

The leader runs the ordinary single-process decode cycle (dflash_mac/engine/decode.py): it
drafts, decides acceptance (q never leaves it), detokenises and stops. A per-instance hook on its
target (target/hooks.py, as target/capture.py does for layers) turns each forward into
"broadcast a packet, then run the forward on the broadcast tokens": the packet tells the workers
how far to trim the cache first (what the leader rolled back since their last forward), which
cache (slot), and the tokens. Because the leader's forward reads its input from the packet's
`all_sum`, the packet is ordered before the forward's own collectives on every rank
(docs/distributed.md).

The leader is also rank 0's `pair.mirror` (`pair.Mirror`): the decode cycle tells it when a
request ends and asks it for the facts of the stats and, pipeline parallel, the features."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from ..target import hooks
from .group import CAPACITY, HEADER, Cmd, Header, count_collectives, packet
from .watchdog import Watchdog


def cache_length(cache: list[Any]) -> int:
    """Positions a target cache holds (from its first trimmable, i.e. attention, cache)."""
    for c in cache:
        if c.is_trimmable():
            return int(c.offset)
    raise ValueError("a distributed target needs at least one attention (trimmable) cache.")


@dataclass(frozen=True)
class Facts:
    """What the leader measured at start-up, shown by --verbose, bench and the stats."""

    ranks: int
    parallel: str
    collectives_per_cycle: int  # per target forward, the packet included
    collective_ms: float  # one all_sum of a [1, block, hidden] array, mean of a probe

    def as_dict(self) -> dict:
        return {
            "ranks": self.ranks,
            "parallel": self.parallel,
            "collectives_per_cycle": self.collectives_per_cycle,
            "collective_ms_per_cycle": self.collective_ms * self.collectives_per_cycle,
        }


class Leader:
    """The hook on rank 0's target (slots of the caches the workers mirror) and its pair's
    `Mirror`."""

    def __init__(self, group: mx.distributed.Group, model: nn.Module, parallel: str, stages=None):
        self.group, self.model, self.parallel = group, model, parallel
        self.stages = stages  # pipeline: the features gathered across stages (stages.py)
        # Mirror.features: pipeline stages gather them; tensor parallel captures them as usual
        self.features: Callable[[], mx.array] | None = stages.features if stages else None
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._held: dict[int, int] = {}  # slot -> positions the workers' cache holds
        self._freed: list[int] = []
        self._ids = itertools.count(1)
        self.probed = Facts(group.size(), parallel, 0, 0.0)
        self.packets = 0
        self.stopped = False
        self.watchdog = Watchdog(group.rank())

    # -- the hook ------------------------------------------------------------------------
    def attach(self) -> Leader:
        """Hook the target for the life of the process (never removed)."""
        hooks.install(self.model, self)
        return self

    def __call__(self, model: nn.Module, call: Callable, inputs: mx.array, cache=None, **kwargs):
        """The hook: every forward of the target (target/hooks.py)."""
        return self.forward(call, model, inputs, cache, kwargs)

    def slot(self, cache: list[Any]) -> int:
        key = cache[0]
        slot = self._slots.get(key)
        if slot is None:
            slot = next(self._ids)
            self._slots[key] = slot
            weakref.finalize(key, self._freed.append, slot)
        return slot

    def forward(self, call: Callable, model: nn.Module, inputs: mx.array, cache, kwargs: dict):
        """Broadcast the packet, then run `call` (the target's own forward) on its tokens."""
        if cache is None:
            raise ValueError("a distributed target runs with a cache.")
        from ..target.hybrid import armed

        self.watchdog.arm()  # re-armed by every forward; disarmed when the request ends
        slot, now, n = self.slot(cache), cache_length(cache), inputs.shape[-1]
        trim = self._held.get(slot, 0) - now
        assert trim >= 0, "the leader's cache grew without a forward pass"
        head = Header(Cmd.FORWARD, slot, trim, n, int(armed(model, cache)), self._next_free())
        tokens = inputs.reshape(-1)
        pkt = mx.distributed.all_sum(packet(head, tokens), group=self.group)
        if n <= CAPACITY:
            tokens = pkt[HEADER : HEADER + n]
        else:  # a long prefill chunk: the tokens follow the header, after it on every rank
            tokens = mx.depends(tokens.astype(mx.int32), pkt)
            tokens = mx.distributed.all_sum(tokens, group=self.group)
        if self.stages is not None:  # rank 0's first stage op, a recv, reads no input: send now
            mx.eval(tokens)
        self._held[slot] = now + n
        self.packets += 1
        logits = call(tokens.reshape(inputs.shape), cache=cache, **kwargs)
        if self.stages is not None:
            logits = self.stages.gather(logits)
        # A caller that evaluates only the caches (mlx-lm's prefill does) must still run the
        # last layer's collectives, as the workers do: tie the last cache to the logits.
        last = cache[-1]
        if isinstance(getattr(last, "keys", None), mx.array):
            last.keys = mx.depends(last.keys, logits)
        return logits

    def _next_free(self) -> int:
        while self._freed:
            slot = self._freed.pop()
            if self._held.pop(slot, None) is not None:
                return slot
        return 0

    # -- commands without a forward ----------------------------------------------------------
    def send(self, cmd: Cmd, cache: list[Any] | None = None, n: int = 0, status: int = 0):
        """Broadcast a packet that runs no forward (evaluated now). PROBE: `n` all_sums of a
        [1, status, hidden] array follow."""
        slot = trim = 0
        if cache is not None and (slot := self._slots.get(cache[0], 0)):
            trim = self._held[slot] - cache_length(cache)
            self._held[slot] -= trim
        head = Header(cmd, slot, trim, n, 0, self._next_free(), status)
        self.watchdog.arm()
        mx.eval(mx.distributed.all_sum(packet(head), group=self.group))
        self.watchdog.disarm()
        self.packets += 1

    # -- pair.Mirror -------------------------------------------------------------------------
    def facts(self) -> dict:
        """The distributed facts for the pair's stats."""
        return self.probed.as_dict()

    def idle(self) -> None:
        """A request ended (also by an error or a closed stream): nothing is in flight any more."""
        self.watchdog.disarm()

    def settle(self, cache: list[Any]) -> None:
        """The end of a request: the workers trim `cache`'s mirror to the leader's length."""
        slot = self._slots.get(cache[0])
        if slot and self._held.get(slot, 0) != cache_length(cache):
            self.send(Cmd.SYNC, cache)
        self.watchdog.disarm()

    def stop(self, status: int = 0) -> None:
        """Release the workers (they exit with `status`); idempotent."""
        if not self.stopped:
            self.stopped = True
            self.send(Cmd.STOP, status=status)

    def probe(self, block: int, hidden: int, repeats: int = 8) -> Facts:
        """Count the collectives of one verify-sized forward and time bare all_sums."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.zeros((1, block), mx.int32), cache=cache)
        count = count_collectives(logits) + (self.stages is not None)  # + the eager packet
        mx.eval(logits)
        del cache, logits
        self.send(Cmd.PROBE, n=repeats, status=block)
        x = mx.zeros((1, block, hidden))
        mx.eval(mx.distributed.all_sum(x, group=self.group))  # warm-up, not timed
        t = time.perf_counter()
        for _ in range(repeats):
            mx.eval(mx.distributed.all_sum(x, group=self.group))
        ms = 1000 * (time.perf_counter() - t) / repeats
        self.probed = Facts(self.group.size(), self.parallel, count, ms)
        self.watchdog.disarm()
        return self.probed


_ACTIVE: list[Leader] = []


def register(lead: Leader) -> None:
    _ACTIVE.append(lead)


def stop_all(status: int = 0) -> None:
    """Release the workers of every leader of this process (the command's end)."""
    while _ACTIVE:
        _ACTIVE.pop().stop(status)
