"""`dflash-mac launch`: start one dflash-mac command as the ranks of an MLX distributed job.

Ranks on 127.0.0.1 / localhost run here, each with `MLX_RANK` and a ring hostfile of free
loopback ports; other hosts are reached over ssh with the launch script of MLX's own launcher
(`mlx._distributed_utils`), from a hostfile in MLX's format. Unlike `mlx.launch`, the exit status
is non-zero when any rank fails, the ranks must be ready within `--timeout`, and a rank that
dies takes the others down within a few seconds (docs/distributed.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import typer

from dflash_mac.distributed.group import (
    READY_ENV,
    READY_LINE,
    lost_sentence,
    ring_neighbours,
)
from dflash_mac.errors import UserError

LOCAL = ("127.0.0.1", "localhost", "::1")
GRACE_S = 8.0  # after one rank fails, the others get this long to exit on their own


class LaunchError(UserError):
    """A job that cannot be started (one sentence)."""


@dataclass
class Rank:
    """One started rank."""

    rank: int
    host: str
    proc: subprocess.Popen
    relays: list[threading.Thread] = field(default_factory=list)
    own_group: bool = True  # started in a process group of its own

    def signal(self, sig: int) -> None:
        try:
            if self.own_group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    @property
    def local(self) -> bool:
        return self.host in LOCAL


def hosts_from(n: int | None, hostfile: Path | None) -> tuple[list, str, list[str]]:
    """(hosts, backend, env) from `--hosts FILE` (MLX's hostfile format) or `-n N` local."""
    from mlx._distributed_utils.common import Host, Hostfile

    if hostfile is None:
        if not n or n < 2:
            raise LaunchError("pass -n N (at least 2 local ranks) or --hosts hosts.json.")
        return [Host(i, "127.0.0.1", ["127.0.0.1"], []) for i in range(n)], "ring", []
    try:
        parsed = Hostfile.from_file(hostfile)
    except ValueError as e:
        raise LaunchError(f"{hostfile} is not an MLX hostfile ({e.__cause__ or e}).")
    if len(parsed.hosts) < 2:
        raise LaunchError(f"{hostfile} lists {len(parsed.hosts)} host; a job needs at least 2.")
    if n is not None and n != len(parsed.hosts):
        raise LaunchError(f"-n {n} does not match the {len(parsed.hosts)} hosts in {hostfile}.")
    backend = parsed.backend or "ring"
    if backend != "ring":
        raise LaunchError(f"backend '{backend}' is started with mlx.launch; launch runs 'ring'.")
    missing = [h.ssh_hostname for h in parsed.hosts if not h.ips]
    if missing:
        raise LaunchError(f"host {missing[0]} has no 'ips' in {hostfile}; the ring needs IPs.")
    return parsed.hosts, backend, list(parsed.envs)


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def check_port(ip: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            raise LaunchError(f"port {port} on {ip} is busy; pass another --starting-port.")


def check_reachable(host: str, timeout: float = 8.0) -> None:
    """ssh to `host` once, without a password prompt; one sentence when it fails."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", host, "true"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 2)
    except FileNotFoundError:
        raise LaunchError(f"host {host} needs ssh, and there is no ssh command here.")
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["timed out"])[-1] if done else "timed out"
        raise LaunchError(f"host {host} is unreachable over ssh ({why}).")


def ring_file(hosts: list, starting_port: int | None) -> list[list[str]]:
    """The per-rank address lists of the ring backend (free ports for local ranks)."""
    ring, port = [], starting_port
    for h in hosts:
        ip = h.ips[0]
        if port is None:
            ring.append([f"{ip}:{free_port(ip)}"])
            continue
        if h.ssh_hostname in LOCAL:
            check_port(ip, port)
        ring.append([f"{ip}:{port}"])
        port += 1
    return ring


@dataclass
class Errors:
    """The ranks' error sentences: rank 0's pass through; a worker's are held and shown at
    the end unless rank 0 said the same (all ranks refuse a bad flag alike)."""

    leader: set[bytes] = field(default_factory=set)
    held: list[tuple[str, bytes]] = field(default_factory=list)

    def take(self, prefix: str, line: bytes) -> bool:
        """True when `line` is held back here."""
        if not line.startswith(b"error:"):
            return False
        if not prefix:
            self.leader.add(line.strip())
            return False
        self.held.append((prefix, line))
        return True

    def flush(self, out) -> bool:
        """Show the held worker errors that rank 0 did not print; whether any error showed."""
        shown = [(p, line) for p, line in self.held if line.strip() not in self.leader]
        for prefix, line in shown:
            out.buffer.write(prefix.encode() + line)
        out.buffer.flush()
        return bool(shown or self.leader)


# The ring backend's own lines when not verbose (a peer's socket failing). MLX writes each word
# of one to an unbuffered std::cerr separately, so a rank's sentence written at that moment can
# land inside one: "[ring]error: rank 0 lost ...", then " Sending to socket 4 failed ...".
RING_CHATTER = re.compile(
    rb"(?:\[ring\]|Socket|Sending to socket|Receiving from socket|failed with errno"
    rb"|made no progress|was closed by the peer"
    rb"|Too many send/recv errors\. Failing pending tasks\.\.\.|-?\d+| )*"
)


@dataclass
class RingFilter:
    """Drops the ring backend's words from a rank's lines; a line it cut short is kept whole."""

    cut: bool = False  # the last line ended in another write: its ring message goes on here

    def __call__(self, line: bytes) -> bytes | None:
        """`line` less the ring's words at its start (None when nothing else is left)."""
        body = line.rstrip(b"\n")
        end = RING_CHATTER.match(body).end()
        head, rest = body[:end], body[end:]
        ring = b"[ring]" in head
        cut, self.cut = self.cut, ring and bool(rest)
        if ring:
            return rest + b"\n" if rest else None
        # a line of ring words alone is the end of a message another write cut short
        return None if not rest and (cut or head.strip(b" -0123456789")) else line


def relay(
    stream,
    out,
    prefix: str,
    verbose: bool,
    skip: int = 0,
    ready: Path | None = None,
    errors: Errors | None = None,
):
    """Copy a rank's output line by line; the ring backend's socket chatter only if verbose;
    `skip` first lines dropped (MLX's remote launch script prints its PID file first); a
    remote rank's ready line becomes its ready file in `ready`."""
    ring = RingFilter()
    for line in iter(stream.readline, b""):
        if not verbose and (line := ring(line)) is None:
            continue
        if errors is not None and out is sys.stderr and errors.take(prefix, line):
            continue
        if skip and (line.startswith(b"stty:") or b" " not in line.strip()):
            skip -= line.startswith(b"/")  # the PID file's path; stty's complaint without a tty
            continue
        if ready is not None and line.startswith(READY_LINE.encode()):
            (ready / line.split()[-1].decode()).touch()
            continue
        out.buffer.write(prefix.encode() + line if prefix else line)
        out.buffer.flush()


def start(
    hosts, ring, args, env_extra, python, ready: Path, verbose: bool, errors: Errors
) -> list[Rank]:
    from mlx._distributed_utils.launch import RemoteProcess

    ranks: list[Rank] = []
    command = [python, "-m", "dflash_mac", *args]
    text = json.dumps(ring)
    local_file = Path(ready) / "hostfile.json"
    local_file.write_text(text)
    for i, h in enumerate(hosts):
        env_list = [*env_extra, f"{READY_ENV}={ready}"]
        if h.ssh_hostname in LOCAL:
            env = dict(os.environ, MLX_RANK=str(i), MLX_HOSTFILE=str(local_file))
            env.update(e.split("=", 1) for e in env_list if "=" in e)
            cmd = command
        else:
            script = RemoteProcess.make_launch_script(
                i, None, None, {"MLX_HOSTFILE": text}, env_list, command, False
            )
            cmd = ["ssh", "-tt", "-o", "LogLevel=QUIET", h.ssh_hostname, script]
            env = dict(os.environ)
        local = h.ssh_hostname in LOCAL
        screen = i == 0 and local and args[0] == "chat"  # the chat UI needs the terminal
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=None if screen else subprocess.DEVNULL,
            stdout=None if i == 0 and local else subprocess.PIPE,
            stderr=None if screen else subprocess.PIPE,
            start_new_session=not screen,
        )
        rank = Rank(i, h.ssh_hostname, proc, own_group=not screen)
        prefix = "" if i == 0 else f"[rank {i}] "
        pipes = [] if screen else [(proc.stderr, sys.stderr, 0)]
        pipes += [] if i == 0 and local else [(proc.stdout, sys.stdout, 0 if local else 1)]
        for stream, out, skip in pipes:
            t = threading.Thread(
                target=relay,
                args=(stream, out, prefix, verbose, skip, None if local else ready, errors),
                daemon=True,
            )
            t.start()
            rank.relays.append(t)
        ranks.append(rank)
    return ranks


def describe(rank: Rank) -> str:
    code = rank.proc.returncode
    if code is not None and code < 0:
        return f"rank {rank.rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank.rank} exited with status {code}"


def stop(ranks: list[Rank]) -> None:
    """SIGTERM to rank 0 (it releases the workers), then to every rank still running, then
    SIGKILL (by process group)."""
    steps = ((ranks[:1], signal.SIGTERM, 5.0), (ranks, signal.SIGTERM, 2.0))
    for group, sig, wait in (*steps, (ranks, signal.SIGKILL, 2.0)):
        alive = [r for r in group if r.proc.poll() is None]
        if not alive:  # a rank 0 already gone releases no one: go straight to the next step
            continue
        for r in alive:
            r.signal(sig)
        deadline = time.monotonic() + wait
        while any(r.proc.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)


def supervise(ranks: list[Rank], ready: Path, timeout: float) -> tuple[int, list[str]]:
    """Wait for the job: (exit status, the sentences for a failure; none on success)."""
    started = time.monotonic()
    failed: Rank | None = None
    failed_at = 0.0
    stopped: set[int] = set()  # ranks still running when the launcher stopped them
    while True:
        codes = [r.proc.poll() for r in ranks]
        if all(c is not None for c in codes):
            break
        bad = [r for r, c in zip(ranks, codes) if c not in (None, 0)]
        if bad and failed is None:
            failed, failed_at = bad[0], time.monotonic()
        if failed is not None and time.monotonic() - failed_at > GRACE_S:
            stopped = {r.rank for r in ranks if r.proc.poll() is None}
            stop(ranks)
            break
        waiting = [r.rank for r in ranks if not (ready / str(r.rank)).exists()]
        if waiting and time.monotonic() - started > timeout:
            stop(ranks)
            return 1, [
                f"rank {waiting[0]} was not ready within {timeout:g} s "
                "(raise --timeout for a large model, or check that the hosts reach each other)."
            ]
        time.sleep(0.05)
    for r in ranks:
        for t in r.relays:
            t.join(timeout=2)
    bad = [r for r in ranks if r.proc.returncode not in (0,)]
    if not bad:
        return 0, []
    # a rank killed by a signal is the cause the others followed (they noticed it at once, so
    # the poll above may have seen them end in the same instant); not one the launcher stopped
    killed = [r for r in bad if (r.proc.returncode or 0) < 0 and r.rank not in stopped]
    first = killed[0] if killed else failed or bad[0]
    code = ranks[0].proc.returncode if ranks[0].proc.returncode not in (0, None) else 1
    # a neighbour still running when stopped was stuck on the lost rank: MLX's ring can wait
    # forever in a collective queued behind the one that failed, so it could not say so itself
    stuck = sorted(stopped & set(ring_neighbours(first.rank, len(ranks))))
    return (code if code > 0 else 1), [
        *(lost_sentence(r, [first.rank]) for r in stuck),
        f"{describe(first)}.",
    ]


def forward_term(ranks: list[Rank]) -> None:
    """SIGTERM to the launcher: rank 0 stops as it would alone (serve finishes cleanly) and
    releases the workers; the job's status is theirs."""
    if ranks[0].proc.poll() is None:
        ranks[0].signal(signal.SIGTERM)


def check_separator(argv: list[str], command: list[str]) -> None:
    """The command must follow `--`: without it, its own options (`generate hi -n 5`) would be
    read as launch's (`-n` ranks)."""
    if "--" in argv and argv[argv.index("--") + 1 :] == command:
        return
    raise LaunchError(
        f"put -- before the command to run, e.g. launch -n 2 -- {command[0]} ...; without it, "
        "the command's own options (such as -n) are taken as launch's."
    )


def launch(
    command: list[str] = typer.Argument(
        None, help="The dflash-mac command to run on every rank, after --."
    ),
    n: int | None = typer.Option(None, "-n", help="Local ranks on 127.0.0.1 (loopback)."),
    hosts: Path | None = typer.Option(
        None, "--hosts", help='An MLX hostfile: [{"ssh": ..., "ips": [...]}, ...].'
    ),
    parallel: str | None = typer.Option(
        None, "--parallel", help="tensor or pipeline (default: tensor where the model has it)."
    ),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds for every rank to load."),
    stall: float = typer.Option(
        60.0, "--stall-timeout", help="Seconds a rank may wait in one collective, then it stops."
    ),
    starting_port: int | None = typer.Option(
        None, "--starting-port", help="First ring port (default: free ports on loopback)."
    ),
    python: str = typer.Option(sys.executable, "--python", help="Python on every host."),
    verbose: bool = typer.Option(False, "--verbose", help="Show the ring backend's messages."),
) -> None:
    """Run generate, serve, chat or bench over several ranks (MLX distributed, sharded target).

    The target is sharded over the ranks, the drafter runs on rank 0 (docs/distributed.md)."""
    from dflash_mac.distributed.group import PARALLEL_ENV, PARALLEL_MODES
    from dflash_mac.distributed.watchdog import STALL_ENV

    from . import err

    if not command:
        raise LaunchError("give the command to run after --, e.g. launch -n 2 -- generate Hi.")
    check_separator(sys.argv[1:], command)
    if command[0] not in ("generate", "serve", "bench", "chat"):
        raise LaunchError(f"launch runs generate, serve, bench or chat, not '{command[0]}'.")
    if parallel is not None and parallel not in PARALLEL_MODES:
        raise LaunchError(f"--parallel must be tensor or pipeline (got {parallel}).")
    host_list, _, env = hosts_from(n, hosts)
    for h in host_list:
        if h.ssh_hostname not in LOCAL:
            check_reachable(h.ssh_hostname)
    ring = ring_file(host_list, starting_port)
    if parallel:
        env.append(f"{PARALLEL_ENV}={parallel}")
    env.append(f"{STALL_ENV}={stall:g}")
    with tempfile.TemporaryDirectory(prefix=f"dflash-launch-{os.getpid()}-") as tmp:
        errors = Errors()
        ranks = start(host_list, ring, command, env, python, Path(tmp), verbose, errors)
        signal.signal(signal.SIGTERM, lambda *_: forward_term(ranks))
        try:
            code, why = supervise(ranks, Path(tmp), timeout)
        finally:  # Ctrl-C, SIGTERM: the ranks go too
            stop(ranks)
    said = errors.flush(sys.stderr)
    killed = any((r.proc.returncode or 0) < 0 for r in ranks)
    if why and (killed or not said or "not ready" in why[-1]):  # else the ranks said why
        for sentence in why:
            err.print(f"[bold red]error:[/] {sentence}", highlight=False)
    raise typer.Exit(code)
