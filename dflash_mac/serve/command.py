"""`dflash-mac serve`: load a pair and run the OpenAI-compatible server (uvicorn).

Writes `serve.pid` and `serve.url` to the data directory (`DFLASH_MAC_HOME`, else the platform
user data dir) so a launcher can find and stop it, logs to `serve.log` there, and removes the
PID file on exit."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

import typer
from rich.console import Console

from dflash_mac.platform import data_dir

PID_NAME, URL_NAME, LOG_NAME = "serve.pid", "serve.url", "serve.log"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
err = Console(stderr=True)


class ServeError(RuntimeError):
    """The server cannot start; one sentence for the user."""


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_free(host: str, port: int) -> None:
    """Fail early (before loading the model) when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(
                f"cannot listen on {host}:{port} ({e.strerror}); pass another "
                "--port or stop what is using it."
            )


POLLED = ("/health", "/metrics")


def not_polling(record: logging.LogRecord) -> bool:
    """Drop uvicorn's access lines for /health and /metrics: launchers (the menu bar) poll them
    every few seconds and would push everything else out of the log's tail."""
    if record.name != "uvicorn.access" or not isinstance(record.args, tuple):
        return True
    path = str(record.args[2]) if len(record.args) > 2 else ""
    return path.split("?")[0] not in POLLED


def setup_logging(path: Path) -> None:
    """Server, request and uvicorn logs go to `path` (appended), without polling lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.addFilter(not_polling)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


class PidFile:
    """`serve.pid` (this process) and `serve.url` while the server runs; refuses to start
    over a live server's PID file."""

    def __init__(self, home: Path, url: str):
        self.pid_path, self.url_path, self.url = home / PID_NAME, home / URL_NAME, url

    def __enter__(self) -> PidFile:
        other = read_pid(self.pid_path)
        # The launcher writes the PID it started (this process, or a wrapper that runs it).
        if other and other not in (os.getpid(), os.getppid()) and pid_alive(other):
            raise ServeError(
                f"a dflash-mac server is already running (PID {other}); stop it "
                f"first, e.g. kill {other}."
            )
        self.url_path.write_text(self.url + "\n")
        self.pid_path.write_text(f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc: object) -> None:
        if read_pid(self.pid_path) == os.getpid():
            self.pid_path.unlink(missing_ok=True)
            self.url_path.unlink(missing_ok=True)


def run_server(app, host: str, port: int) -> None:
    """uvicorn until SIGINT/SIGTERM; a signal first cancels the running generation so the
    shutdown is prompt."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            app.state.worker.stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=5)
    # uvicorn re-raises the signal after shutting down: make SIGTERM a clean exit so that
    # `finally` blocks (the PID file) run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Server(config).run()


def serve(
    model: str | None = typer.Option(
        None, "--model", "-m", help="Target model (folder or Hub id; default: the bundled pair)."
    ),
    draft: str | None = typer.Option(
        None, "--draft", "-d", help="DFlash drafter (folder or Hub id; default: the bundled pair)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to bind (loopback only by default)."
    ),
    port: int = typer.Option(8080, "--port", "-p", help="Port to listen on."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="DFLASH_MAC_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/*.",
    ),
    max_tokens: int = typer.Option(
        4096, "--max-tokens", "-n", help="Default and upper limit of a request's max_tokens."
    ),
    block_size: str | None = typer.Option(
        None,
        "--block-size",
        "-b",
        help="Block size (draft tokens + 1 per cycle), or auto (the default: chosen each "
        "cycle, up to the drafter's block, min(5, it) when quantized).",
    ),
    draft_bits: int | None = typer.Option(
        None, "--draft-bits", help="Quantize the drafter to 4 or 8 bits."
    ),
    temp: float = typer.Option(
        0.0, "--temp", help="Temperature for requests that do not set one (0 = greedy)."
    ),
    log_file: Path | None = typer.Option(
        None, "--log-file", help="Log file (default: serve.log in the data directory)."
    ),
) -> None:
    """Serve the pair as an OpenAI-compatible API (for Continue, Cline, Aider, Zed, ...)."""
    from dflash_mac.cli.terminal import load_pair

    from .app import create_app

    try:
        home = data_dir()
        log_path = log_file or home / LOG_NAME
        check_free(host, port)
        setup_logging(log_path)
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        if host not in LOOPBACK and not api_key:
            err.print(
                f"[yellow]warning:[/] listening on {host} without --api-key: anyone who "
                "can reach this machine can use the model."
            )
        with PidFile(home, url):  # during loading too: a launcher sees "starting"
            pair = load_pair(model, draft, block_size=block_size, draft_bits=draft_bits)
            fixed = pair.block_size if block_size not in (None, "auto") else None  # else auto
            app = create_app(
                pair, api_key=api_key, max_tokens=max_tokens, default_temp=temp, block_size=fixed
            )
            logging.getLogger("dflash_mac.serve").info(
                "serving %s + %s at %s (block %d, pid %d)",
                pair.model_id,
                pair.draft_id,
                url,
                pair.block_size,
                os.getpid(),
            )
            err.print(
                f"dflash-mac serve: {url}  (model {app.state.model_name}, log {log_path})",
                highlight=False,
                soft_wrap=True,
            )
            run_server(app, host, port)
    except ServeError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1)
