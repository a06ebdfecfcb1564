"""`dflash-mac serve`: load a pair and run the OpenAI-compatible server (uvicorn).

Writes `serve-PORT.pid` and `serve-PORT.url` to the data directory (`DFLASH_MAC_HOME`, else the
platform user data dir) so a launcher (or `dflash-mac ps` / `stop`) can find and stop it, logs
to `serve-PORT.log` there and a line per request to the terminal (`--log-level`), and removes
the PID file on exit. One server per port: several models can be served side by side."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import typer
from rich.console import Console

from dflash_mac.cli import check_pair_names, options
from dflash_mac.errors import UserError
from dflash_mac.host import data_dir

from .cors import LOOPBACK_ORIGINS, parse_origins
from .requestlog import log as request_log
from .tools import ToolSupport


def pid_name(port: int) -> str:
    return f"serve-{port}.pid"


def url_name(port: int) -> str:
    return f"serve-{port}.url"


def log_name(port: int) -> str:
    return f"serve-{port}.log"


LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_BATCH = 4  # measured on the default pair: docs/bench.md "Concurrency"
DISK_BYTES = 4 << 30  # the prompt cache on disk, per pair (agent prefixes of ~100k tokens)
err = Console(stderr=True)


class ServeError(UserError, RuntimeError):
    """The server cannot start."""


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
    """Fail early (before loading the model), in one sentence, when --port is out of range,
    --host is no address of this machine, or the address is taken."""
    if not 1 <= port <= 65535:
        raise ServeError(f"--port must be between 1 and 65535 (got {port}).")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ServeError(f"cannot listen on {host} ({e.strerror}); pass another --host.")
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:  # resolves, but to no address of this machine
                raise ServeError(
                    f"cannot listen on {host} ({e.strerror}): it is not an address of this "
                    "machine; pass another --host."
                )
            raise ServeError(
                f"cannot listen on {host}:{port} ({e.strerror}); pass another "
                "--port or stop what is using it."
            )


LOG_LEVELS = ("debug", "info", "warning", "error")


def check_log_level(value: str) -> str:
    """`--log-level`, checked while the options are parsed."""
    if value.lower() not in LOG_LEVELS:
        raise ServeError(f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {value!r}).")
    return value.lower()


class TerminalFormat(logging.Formatter):
    """`12:03:04 POST /v1/chat/completions 200 · …`; other records with their level, and
    tracebacks left to the log file."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name != request_log.name:
            message = f"{record.levelname.lower()}: {message}"
        if record.exc_info:
            message += " (traceback in the log file)"
        return f"{self.formatTime(record, '%H:%M:%S')} {message}"


def for_terminal(level: int) -> Callable[[logging.LogRecord], bool]:
    """Request lines and warnings at info and above; every record at debug."""

    def keep(record: logging.LogRecord) -> bool:
        return (
            level == logging.DEBUG
            or record.name == request_log.name
            or record.levelno >= logging.WARNING
        )

    return keep


def same_file(stream: TextIO, path: Path) -> bool:
    """Whether `stream` writes to `path` (a launcher that sends stderr to the log file)."""
    try:
        a, b = os.fstat(stream.fileno()), path.stat()
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def setup_logging(path: Path, level: str = "info") -> None:
    """Logs go to `path` (appended: server, requests, uvicorn; the polled routes' lines only
    at debug) and, from `level` up, one line per request and warnings to the terminal."""
    chosen = getattr(logging, level.upper())
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if not same_file(sys.stderr, path):
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setLevel(chosen)
        terminal.addFilter(for_terminal(chosen))
        terminal.setFormatter(TerminalFormat())
        root.addHandler(terminal)
    root.setLevel(min(chosen, logging.INFO))


class PidFile:
    """`serve-PORT.pid` (this process) and `serve-PORT.url` while the server runs; refuses to
    start over the PID file of a live server on the same port."""

    def __init__(self, home: Path, url: str, port: int):
        self.pid_path, self.url_path = home / pid_name(port), home / url_name(port)
        self.url, self.port = url, port

    def __enter__(self) -> PidFile:
        other = read_pid(self.pid_path)
        # The launcher writes the PID it started (this process, or a wrapper that runs it).
        if other and other not in (os.getpid(), os.getppid()) and pid_alive(other):
            raise ServeError(
                f"a dflash-mac server is already running on port {self.port} (PID {other}); "
                f"stop it first (kill {other}) or pass another --port."
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

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,  # requestlog.py writes each request's line, with its numbers
        timeout_graceful_shutdown=5,
    )
    # uvicorn re-raises the signal after shutting down: make SIGTERM a clean exit so that
    # `finally` blocks (the PID file) run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Server(config).run()


def check_options(
    prompt_cache_size: int, prompt_cache_bytes: int | None, prompt_cache_disk_bytes: int = 0
) -> None:
    if prompt_cache_size < 1:
        raise ServeError(f"--prompt-cache-size must be at least 1 (got {prompt_cache_size}).")
    if prompt_cache_bytes is not None and prompt_cache_bytes < 0:
        raise ServeError(f"--prompt-cache-bytes must be >= 0 (got {prompt_cache_bytes}).")
    if prompt_cache_disk_bytes < 0:
        raise ServeError(f"--prompt-cache-disk-bytes must be >= 0 (got {prompt_cache_disk_bytes}).")


def server_url(host: str, port: int) -> str:
    """The OpenAI base URL clients use (an IPv6 host in brackets)."""
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"


def announce(prepared, name: str, url: str, log_path: Path) -> None:
    """What is served where: a log line and one line on the terminal (two when the model
    cannot call tools, which agents need)."""
    pair = prepared.pair
    logging.getLogger("dflash_mac.serve").info(
        "serving %s + %s at %s (block %s, pid %d)",
        pair.model_id,
        pair.draft_id,
        url,
        prepared.block.label,
        os.getpid(),
    )
    err.print(
        f"dflash-mac serve: {url}  (model {name}, log {log_path})",
        highlight=False,
        soft_wrap=True,
    )
    if problem := ToolSupport.of(pair.tokenizer).problem():
        err.print(f"no tool calls: {problem}", highlight=False, soft_wrap=True)


def serve(
    model: str | None = options.MODEL,
    draft: str | None = options.DRAFT,
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
    block_size: str | None = options.BLOCK_SIZE,
    draft_bits: int | None = options.DRAFT_BITS,
    draft_vocab: int | None = options.DRAFT_VOCAB,
    temp: float = typer.Option(
        0.0, "--temp", help="Temperature for requests that do not set one (0 = greedy)."
    ),
    max_queue: int = typer.Option(
        8,
        "--max-queue",
        min=0,
        help="Requests that may wait behind the running one; more get HTTP 429 + Retry-After.",
    ),
    max_batch: int = typer.Option(
        DEFAULT_MAX_BATCH,
        "--max-batch",
        min=1,
        help="Requests that decode together (continuous batching with DFlash; 1: one at a "
        "time). Structured-output requests take plain steps in the batch.",
    ),
    log_file: Path | None = typer.Option(
        None, "--log-file", help="Log file (default: serve-PORT.log in the data directory)."
    ),
    prompt_cache_size: int = typer.Option(
        4, "--prompt-cache-size", help="Conversations whose cached prefix is kept (LRU)."
    ),
    prompt_cache_bytes: int | None = typer.Option(
        None, "--prompt-cache-bytes", help="Memory cap of the prompt cache in bytes (LRU)."
    ),
    prompt_cache_disk_bytes: int = typer.Option(
        DISK_BYTES,
        "--prompt-cache-disk-bytes",
        help="Disk cap of the prompt cache in the data directory, kept across restarts "
        "(0: memory only). See `dflash-mac cache ls`.",
    ),
    chat_template: str | None = options.CHAT_TEMPLATE,  # the file's text
    max_kv_size: int | None = options.MAX_KV_SIZE,
    copy: bool | None = options.COPY,
    suffix: str | None = options.SUFFIX,  # parsed: bool | None
    tree_budget: str = options.TREE_BUDGET,  # parsed: int | None
    cors_origins: str | None = typer.Option(
        None,
        "--cors-origins",
        help="Browser origins that may call the server, comma-separated (* is a wildcard: "
        "http://localhost:*), * for any, none for no CORS. Default: pages on this machine "
        f"({', '.join(LOOPBACK_ORIGINS)}).",
    ),
    log_level: str = typer.Option(
        "info",
        "--log-level",
        help="What the terminal shows: debug (also the polled /health and /metrics), info "
        "(a line per request), warning (failed requests and warnings), error.",
        callback=check_log_level,
    ),
) -> None:
    """Serve the pair as an OpenAI-compatible API (for Continue, Cline, Aider, Zed, ...)."""
    from dflash_mac.distributed.group import follower  # MLX: not at import (`ps`, `stop`)

    # bad options, a taken port or a missing model: one sentence before the slow imports
    check_options(prompt_cache_size, prompt_cache_bytes, prompt_cache_disk_bytes)
    origins = parse_origins(cors_origins)
    if not follower():  # the job's other ranks serve nothing: rank 0 has the port
        check_free(host, port)
        check_pair_names(model, draft)
    from dflash_mac.cli.terminal import calibrate_auto, follow_if_worker, load_pair, warn_line

    follow_if_worker(model, draft)  # a distributed job's other ranks: no server, no PID file

    from .app import create_app

    home = data_dir()
    log_path = log_file or home / log_name(port)
    setup_logging(log_path, log_level)
    url = server_url(host, port)
    if host not in LOOPBACK and not api_key:
        warn_line(
            f"listening on {host} without --api-key: anyone who "
            "can reach this machine can use the model."
        )
    with PidFile(home, url, port):  # during loading too: a launcher sees "starting"
        prepared = load_pair(
            model,
            draft,
            block_size=block_size,
            draft_bits=draft_bits,
            draft_vocab=draft_vocab,
            chat_template=chat_template,
        )
        tuning = calibrate_auto(prepared)  # before the first request: once per pair and machine
        app = create_app(
            prepared.pair,
            block=prepared.block,
            tuning=tuning,
            api_key=api_key,
            max_tokens=max_tokens,
            default_temp=temp,
            max_queue=max_queue,
            prompt_cache_size=prompt_cache_size,
            prompt_cache_bytes=prompt_cache_bytes,
            cors_origins=origins,
            max_kv_size=max_kv_size,
            prompt_cache_disk_bytes=prompt_cache_disk_bytes,
            copy=copy,
            suffix=suffix,
            tree=tree_budget,
            max_batch=max_batch,
        )
        announce(prepared, app.state.model_name, url, log_path)
        run_server(app, host, port)
