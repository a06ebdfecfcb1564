"""A rank that waits too long inside a collective gives up with one sentence.

A peer that dies is noticed by the ring backend itself ("connection to a peer was lost"); a
peer that blocks (stopped, swapping, stuck) is not: the sockets stay open and every rank would
wait forever. Each rank arms this watchdog while a forward's collectives are in flight and
disarms it when the rank goes idle. A rank blocked in MLX holds the GIL, so no Python thread of
its own could act: the watchdog is a tiny helper process, told "armed" / "idle" through a pipe,
that prints the sentence and kills the rank past the deadline."""

from __future__ import annotations

import os
import subprocess
import sys

STALL_ENV = "DFLASH_MAC_STALL_S"
DEFAULT_STALL_S = 60.0

_HELPER = r"""
import os, select, signal, sys, time
pid, rank, secs = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
deadline = None
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if ready:
        data = os.read(0, 4096)
        if not data:
            sys.exit(0)
        deadline = time.monotonic() + secs if data[-1:] == b"a" else None
    elif deadline is not None:
        sys.stderr.write(
            f"error: rank {rank} waited more than {secs:g} s for the other ranks "
            "(one of them is blocked); stopping.\n"
        )
        sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)
        sys.exit(0)
"""


def stall_seconds() -> float:
    try:
        return float(os.environ.get(STALL_ENV, DEFAULT_STALL_S))
    except ValueError:
        return DEFAULT_STALL_S


class Watchdog:
    """Kills this rank when armed for longer than `seconds` without being re-armed."""

    def __init__(self, rank: int, seconds: float | None = None):
        self.seconds = seconds or stall_seconds()
        self._armed = False
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _HELPER, str(os.getpid()), str(rank), str(self.seconds)],
            stdin=subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        )

    def _say(self, what: bytes) -> None:
        try:
            os.write(self._proc.stdin.fileno(), what)
        except OSError:
            pass

    def arm(self) -> None:
        """Start (or restart) the deadline."""
        self._armed = True
        self._say(b"a")

    def disarm(self) -> None:
        if self._armed:
            self._armed = False
            self._say(b"d")
