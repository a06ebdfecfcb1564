"""`dflash-mac ps` and `dflash-mac stop`: the running servers, from the `serve-PORT.pid` and
`serve-PORT.url` files `serve` writes to the data directory (serve/command.py). No MLX."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import typer

from dflash_mac.cli.console import table
from dflash_mac.host import data_dir

from .command import ServeError, pid_alive, pid_name, read_pid, url_name

NONE_RUNS = "no dflash-mac server is running."


@dataclass(frozen=True)
class Server:
    """One server's files: its port, PID, base URL and when it started."""

    port: int
    pid: int
    url: str
    started: float  # the PID file's time

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


def command_of(pid: int) -> str | None:
    """The command line of process `pid`; None when it does not run (or is a zombie), "" when
    `ps` cannot tell."""
    if not pid_alive(pid):
        return None
    try:
        out = subprocess.run(
            ["ps", "-p", str(pid), "-o", "stat=", "-o", "command="],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    if not out:
        return None
    stat, _, command = out.partition(" ")
    return None if "Z" in stat else command.strip()


def is_server(pid: int) -> bool:
    """Whether `pid` still runs `serve` (a PID file outlives a crash; its PID may be reused)."""
    command = command_of(pid)
    return command is not None and (command == "" or "serve" in command)


def forget(home: Path, port: int) -> None:
    (home / pid_name(port)).unlink(missing_ok=True)
    (home / url_name(port)).unlink(missing_ok=True)


def running(home: Path) -> tuple[list[Server], list[int]]:
    """The servers whose process runs, by port, and the ports of stale files (removed)."""
    servers, stale = [], []
    for path in home.glob("serve-*.pid"):
        digits = path.name.removeprefix("serve-").removesuffix(".pid")
        if not digits.isdigit() or path.name != pid_name(int(digits)):
            continue
        port, pid = int(digits), read_pid(path)
        if pid is None or not is_server(pid):
            forget(home, port)
            stale.append(port)
            continue
        url_path = home / url_name(port)
        url = url_path.read_text().strip() if url_path.exists() else ""
        try:
            started = path.stat().st_mtime
        except FileNotFoundError:  # it stopped just now
            continue
        servers.append(Server(port, pid, url or f"http://127.0.0.1:{port}/v1", started))
    return sorted(servers, key=lambda s: s.port), sorted(stale)


def health(server: Server) -> dict | None:
    """The server's /health answer, or None while it loads (or does not answer)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with direct.open(server.root + "/health", timeout=1) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def uptime(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def stale_note(ports: list[int]) -> None:
    if ports:
        names = ", ".join(str(p) for p in ports)
        typer.echo(f"removed the files of servers that no longer run (port {names}).", err=True)


def ps_command() -> None:
    """List the running servers: port, PID, URL, model and uptime."""
    servers, stale = running(data_dir())
    stale_note(stale)
    if not servers:
        typer.echo(NONE_RUNS)
        return
    rows = [["PORT", "PID", "STATUS", "MODEL", "URL", "UPTIME"]]
    now = time.time()
    for s in servers:
        h = health(s)
        status = (h or {}).get("status", "starting")
        model = str((h or {}).get("model", "–"))
        rows.append([str(s.port), str(s.pid), status, model, s.url, uptime(now - s.started)])
    typer.echo(table(rows))


def stop_one(home: Path, server: Server, wait_s: float) -> None:
    """SIGTERM, then wait until the process has ended (its PID file with it)."""
    try:
        os.kill(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise ServeError(
            f"cannot stop the server on port {server.port} (PID {server.pid}): it belongs to "
            "another user."
        )
    deadline = time.monotonic() + wait_s
    while command_of(server.pid) is not None:
        if time.monotonic() > deadline:
            raise ServeError(
                f"the server on port {server.port} (PID {server.pid}) did not stop within "
                f"{wait_s:g} s; kill -9 {server.pid} ends it."
            )
        time.sleep(0.1)
    forget(home, server.port)  # a server that was killed left its files
    typer.echo(f"stopped the server on port {server.port} (PID {server.pid}).")


def stop_command(
    port: int | None = typer.Argument(None, metavar="PORT", help="Port of the server to stop."),
    every: bool = typer.Option(False, "--all", help="Stop every running server."),
    wait_s: float = typer.Option(
        30.0, "--wait", help="Seconds to wait for each server to exit after SIGTERM."
    ),
) -> None:
    """Stop the server on PORT, or every running server with --all."""
    if port is not None and every:
        raise ServeError("pass a PORT or --all, not both.")
    home = data_dir()
    servers, stale = running(home)
    stale_note(stale)
    if port is not None:
        chosen = [s for s in servers if s.port == port]
        if not chosen:
            others = ", ".join(str(s.port) for s in servers)
            hint = f" (running: port {others})" if others else ""
            raise ServeError(f"no dflash-mac server is running on port {port}{hint}.")
    elif not servers:
        typer.echo(NONE_RUNS)
        return
    elif every or len(servers) == 1:
        chosen = servers
    else:
        ports = ", ".join(str(s.port) for s in servers)
        raise ServeError(
            f"{len(servers)} servers are running (ports {ports}); pass a PORT or --all."
        )
    for server in chosen:
        stop_one(home, server, wait_s)
