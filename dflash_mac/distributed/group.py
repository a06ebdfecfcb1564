"""This process's place in an MLX distributed job, and the int32 packet the leader broadcasts.

Ranks come from MLX's own runtime (`mx.distributed`, started by `mlx.launch` or by
`dflash-mac launch`, which set `MLX_RANK` and the backend's hostfile). Rank 0 leads: it alone
holds the drafter and decides acceptance; every cycle it sends the other ranks one small int32
packet with an `all_sum` in which they contribute zeros (docs/distributed.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum

import mlx.core as mx

PARALLEL_ENV = "DFLASH_MAC_PARALLEL"  # tensor | pipeline (launch sets it; default: what fits)
PARALLEL_MODES = ("tensor", "pipeline")
READY_ENV = "DFLASH_MAC_READY_DIR"  # launch: each rank touches <dir>/<rank> once loaded

HEADER = 8  # cmd, slot, trim, n, armed, free, reserved x2
CAPACITY = 64  # tokens that ride in the packet itself; longer inputs follow in a second all_sum
PACKET = HEADER + CAPACITY


class Cmd(IntEnum):
    """What the leader asks of the workers."""

    FORWARD = 1  # trim `slot`'s cache by `trim`, then run the target on the `n` tokens
    SYNC = 2  # only trim (the end of a request: every rank's cache at the same length)
    STOP = 3  # trim, then leave the loop (exit status in `reserved`)
    PROBE = 4  # time `n` bare all_sums of a hidden-sized array (start-up measurement)


@dataclass(frozen=True)
class Header:
    cmd: int
    slot: int
    trim: int
    n: int
    armed: int = 0
    free: int = 0
    status: int = 0

    def values(self) -> list[int]:
        return [self.cmd, self.slot, self.trim, self.n, self.armed, self.free, self.status, 0]

    @classmethod
    def parse(cls, values: list[int]) -> Header:
        return cls(*values[:7])


def launched() -> bool:
    """True when an MLX launcher started this process as one rank of a job."""
    return "MLX_RANK" in os.environ


def follower() -> bool:
    """True for a rank other than 0 (it follows rank 0: no server, no report), known from the
    launcher's environment before the group is joined."""
    return launched() and os.environ["MLX_RANK"] != "0"


def world() -> mx.distributed.Group | None:
    """The job's group when this process is one of several ranks, else None."""
    if not launched():
        return None
    try:
        group = mx.distributed.init()
    except RuntimeError as e:
        raise join_error(e) from None
    return group if group.size() > 1 else None


def join_error(e: RuntimeError) -> Exception:
    """One sentence for a rank that could not join the job (the ring backend's errors)."""
    from ..errors import LoadError

    rank = os.environ.get("MLX_RANK", "?")
    if "bind" in str(e):
        where = "its ring port"
        try:
            import json

            with open(os.environ["MLX_HOSTFILE"]) as f:
                where = ", ".join(json.load(f)[int(rank)])
        except (KeyError, OSError, ValueError, IndexError):
            pass
        return LoadError(f"rank {rank} could not listen on {where}: the port is busy.")
    return LoadError(f"rank {rank} could not join the distributed job ({e}).")


READY_LINE = "DFLASH_MAC_READY"  # on stderr, for a launcher on another host


def mark_ready(rank: int) -> None:
    """Tell `dflash-mac launch` (when it started us) that this rank has loaded: a file in its
    folder when on the same host, a line on stderr when it reaches us over ssh."""
    folder = os.environ.get(READY_ENV)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, str(rank)), "w"):
            pass
    elif folder:
        import sys

        sys.stderr.write(f"{READY_LINE} {rank}\n")
        sys.stderr.flush()


def parallel_mode() -> str | None:
    """The requested parallel mode (None: tensor where the model class can, else pipeline)."""
    mode = os.environ.get(PARALLEL_ENV) or None
    if mode is not None and mode not in PARALLEL_MODES:
        from ..errors import LoadError

        raise LoadError(f"--parallel must be tensor or pipeline (got {mode}).")
    return mode


def packet(header: Header, tokens: mx.array | None = None) -> mx.array:
    """The packet [header, tokens, zero padding] (tokens may be lazy: drafts of this cycle)."""
    parts = [mx.array(header.values(), dtype=mx.int32)]
    n = 0
    if tokens is not None and tokens.size <= CAPACITY:
        parts.append(tokens.reshape(-1).astype(mx.int32))
        n = tokens.size
    parts.append(mx.zeros((CAPACITY - n,), mx.int32))
    return mx.concatenate(parts)


def count_collectives(*outputs: mx.array) -> int:
    """Collective operations (all_sum, all_gather, send, recv) in the unevaluated graph behind
    `outputs`: what one evaluation of them will exchange with the other ranks."""
    import io

    names = ("AllReduce", "AllSum", "AllGather", "Send", "Recv", "AllMax", "AllMin")
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sum(
        1
        for line in dot.getvalue().splitlines()
        if "label" in line and any(n in line for n in names)
    )


def lost_peer_message(e: BaseException) -> str | None:
    """One sentence naming the rank this one lost, for the ring backend's error."""
    if "connection to a peer was lost" not in str(e):
        return None
    rank = int(os.environ.get("MLX_RANK", 0))
    return lost_sentence(rank, ring_neighbours(rank, mx.distributed.init().size()))


def ring_neighbours(rank: int, size: int) -> list[int]:
    """The ranks `rank` exchanges with in a ring of `size` (one when there are two)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def lost_sentence(rank: int, peers: list[int]) -> str:
    """The sentence for a rank whose ring neighbours `peers` went away (said by the rank, or by
    the launcher for a rank stuck waiting on them)."""
    names = " or ".join(f"rank {p}" for p in peers)
    return f"rank {rank} lost the connection to {names} (it exited or is unreachable)."
