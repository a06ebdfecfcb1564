"""Ranks 1..N-1 of a distributed pair: follow the leader's packets.

Each packet names a cache (slot), how many positions to drop from it first, and the tokens of
the next forward. A worker runs that forward on its shard of the target and evaluates the
logits with the cache states, which are the same outputs the leader evaluates, so every
collective of the forward runs on every rank and in the same order. (A rank that evaluated only
its caches would skip the last layer's all-reduces, and the ranks would hang.)"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..target.rollback import TargetRollback
from .group import CAPACITY, HEADER, PACKET, Cmd, Header
from .watchdog import Watchdog


class WorkerCache:
    """One mirrored target cache, with the rollback that keeps it equal to the leader's."""

    def __init__(self, model: nn.Module):
        self.cache = make_prompt_cache(model)
        self.rollback = TargetRollback(model, self.cache)
        self._hooks = self.rollback.hooks()
        self._hooks.__enter__()
        self.recorded: int | None = None  # positions of the last armed (verify) forward

    def trim(self, n: int) -> None:
        if self.recorded is not None:  # the first trim after a verify: keep its prefix
            self.rollback.rollback(n, self.recorded - n - 1)
            self.recorded = None
        elif n:
            self.rollback.trim(n)

    def close(self) -> None:
        self._hooks.__exit__(None, None, None)


@dataclass
class Worker:
    """The follow loop of one worker rank."""

    group: mx.distributed.Group
    model: nn.Module
    hidden: int
    stages: Any = None  # pipeline: the stage capture (stages.py)
    slots: dict[int, WorkerCache] = field(default_factory=dict)
    forwards: int = 0
    wait_time: float = 0.0  # seconds blocked waiting for packets
    watchdog: Watchdog | None = None

    @property
    def rank(self) -> int:
        return self.group.rank()

    def receive(self) -> tuple[Header, mx.array]:
        t = time.perf_counter()
        pkt = mx.distributed.all_sum(mx.zeros((PACKET,), mx.int32), group=self.group)
        mx.eval(pkt)
        self.wait_time += time.perf_counter() - t
        return Header.parse(pkt[:HEADER].tolist()), pkt

    def slot(self, head: Header) -> WorkerCache | None:
        if head.free and (gone := self.slots.pop(head.free, None)) is not None:
            gone.close()
        if head.cmd == Cmd.FORWARD and head.slot not in self.slots:
            self.slots[head.slot] = WorkerCache(self.model)
        return self.slots.get(head.slot)

    def step(self, head: Header, pkt: mx.array) -> None:
        """Run one FORWARD / SYNC / PROBE packet."""
        wc = self.slot(head)
        if wc is not None:
            wc.trim(head.trim)
        if head.cmd == Cmd.PROBE:
            x = mx.zeros((1, head.status, self.hidden))
            for _ in range(head.n + 1):  # the leader's warm-up, then its timed repeats
                mx.eval(mx.distributed.all_sum(x, group=self.group))
            return
        if head.cmd != Cmd.FORWARD:
            return
        n = head.n
        if n <= CAPACITY:
            tokens = pkt[HEADER : HEADER + n]
        else:
            tokens = mx.distributed.all_sum(mx.zeros((n,), mx.int32), group=self.group)
        if head.armed:
            wc.rollback.before_verify()
            wc.recorded = n
        self.watchdog.arm()
        logits = self.model(tokens[None], cache=wc.cache)
        if self.stages is not None:
            logits = self.stages.gather(logits)
        mx.eval(logits, [c.state for c in wc.cache])
        self.watchdog.disarm()
        self.forwards += 1

    def run(self) -> int:
        """Follow packets until STOP; returns the exit status the leader sent."""
        self.watchdog = self.watchdog or Watchdog(self.rank)
        with mx.stream(generation_stream):
            while True:
                head, pkt = self.receive()
                if head.cmd == Cmd.STOP:
                    for wc in self.slots.values():
                        wc.close()
                    return head.status
                self.step(head, pkt)
