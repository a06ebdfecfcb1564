"""The small rules behind serve's CORS, request lines, terminal logging and `ps` / `stop`
(the installed command is driven in tests/e2e/test_serve_features.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mac.serve import command, cors, requestlog, servers


def test_origins_default_to_pages_on_this_machine():
    assert cors.parse_origins(None) == cors.LOOPBACK_ORIGINS
    pattern = re.compile(cors.origin_pattern(cors.LOOPBACK_ORIGINS))
    for origin in ("http://localhost", "http://localhost:3000", "http://[::1]:8080"):
        assert pattern.fullmatch(origin), origin
    for origin in ("http://localhost.evil.example", "https://localhost:3000", "http://x"):
        assert not pattern.fullmatch(origin), origin


def test_origin_wildcards_none_and_bad_entries():
    assert cors.parse_origins("https://a.example/, *") == ("https://a.example", "*")
    assert cors.parse_origins("none") == () and cors.cors(()) == []
    host = re.compile(cors.origin_pattern(("https://*.example.com",)))
    assert host.fullmatch("https://app.example.com")
    assert not host.fullmatch("https://example.com.evil/")
    with pytest.raises(cors.OriginError, match="'ftp://x' is not an origin"):
        cors.parse_origins("http://ok, ftp://x")


def test_request_line_and_its_level():
    result = {
        "finish_reason": "cancelled",
        "usage": {"completion_tokens": 64},
        "dflash": {"decode_tps": 95.25, "tau": 3.414},
    }
    line = requestlog.request_line("POST", "/v1/chat/completions", 200, result, 0.714)
    assert (
        line == "POST /v1/chat/completions 200 · 64 tok · 95.2 tok/s · τ 3.41 · cancelled · 0.71 s"
    )
    assert requestlog.request_line("GET", "/v1/models", 200, None, 0.0) == (
        "GET /v1/models 200 · 0.00 s"
    )
    level = requestlog.level_of
    assert level("/health", 200) == logging.DEBUG and level("/v1/models", 200) == logging.INFO
    assert level("/v1/chat/completions", 429) == logging.WARNING
    assert level("/health", 500) == logging.ERROR


@pytest.fixture
def root(monkeypatch):
    """The root logger with no handlers; the ones a test adds are closed after it."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    yield root
    for handler in root.handlers:
        handler.close()


def emit_a_few(root: logging.Logger) -> None:
    requestlog.log.debug("GET /health 200")
    requestlog.log.info("POST /x 200")
    requestlog.log.warning("POST /x 400")
    logging.getLogger("dflash_mac.serve").info("loading")
    logging.getLogger("dflash_mac.serve").warning("low memory")
    for handler in root.handlers:
        handler.flush()


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        (
            "debug",
            [
                "GET /health 200",
                "POST /x 200",
                "POST /x 400",
                "info: loading",
                "warning: low memory",
            ],
        ),
        ("info", ["POST /x 200", "POST /x 400", "warning: low memory"]),
        ("warning", ["POST /x 400", "warning: low memory"]),
        ("error", []),
    ],
)
def test_log_level_picks_the_terminal_lines(level, shown, tmp_path, monkeypatch, root):
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    command.setup_logging(tmp_path / "serve.log", command.check_log_level(level.upper()))
    emit_a_few(root)
    assert [line.split(" ", 1)[1] for line in terminal.getvalue().splitlines()] == shown
    logged = (tmp_path / "serve.log").read_text()
    assert "POST /x 200" in logged and ("GET /health" in logged) == (level == "debug")


def test_no_terminal_lines_when_stderr_is_the_log_file(tmp_path, monkeypatch, root):
    """The menu bar starts serve with stderr appended to the log: each line once."""
    path = tmp_path / "serve.log"
    with path.open("a") as log:
        monkeypatch.setattr(sys, "stderr", log)
        command.setup_logging(path)
        emit_a_few(root)
    assert path.read_text().count("POST /x 200") == 1


def test_uptime_and_stale_pid_files(tmp_path):
    assert [servers.uptime(s) for s in (5, 65, 3725, 90000)] == ["5s", "1m 05s", "1h 02m", "1d 1h"]
    (tmp_path / "serve-1.pid").write_text("999999\n")  # no such process
    (tmp_path / "serve-1.url").write_text("http://127.0.0.1:1/v1\n")
    (tmp_path / "serve-x.pid").write_text("1\n")  # not ours: left alone
    assert servers.running(tmp_path) == ([], [1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve-x.pid"]


def test_ps_and_stop_import_no_mlx():
    code = "import sys\nimport dflash_mac.serve.servers\nprint('mlx' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
    from dflash_mac import cli

    assert {"ps", "stop"} <= set(cli.NO_MATH_COMMANDS)


def test_stop_all_or_one_port_and_a_bare_stop_when_several_run(tmp_path):
    """Two stand-in servers (processes whose command line says `serve`): a bare `stop` asks
    which, `stop --all` ends both; `ps` lists them as starting (no /health answers)."""
    home = tmp_path / "home"
    home.mkdir()
    fakes = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "serve"])
        for _ in range(2)
    ]
    try:
        for port, fake in zip((1, 2), fakes):
            (home / f"serve-{port}.pid").write_text(f"{fake.pid}\n")
        exe = str(Path(sys.executable).with_name("dflash-mac"))
        env = {**os.environ, "DFLASH_MAC_HOME": str(home)}

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60)

        rows = run("ps").stdout.splitlines()[1:]
        assert [r.split()[:4] for r in rows] == [
            ["1", str(fakes[0].pid), "starting", "–"],
            ["2", str(fakes[1].pid), "starting", "–"],
        ]
        r = run("stop")
        assert (r.returncode, r.stderr) == (
            1,
            "error: 2 servers are running (ports 1, 2); pass a PORT or --all.\n",
        )
        r = run("stop", "1", "--all")
        assert (r.returncode, r.stderr) == (1, "error: pass a PORT or --all, not both.\n")
        r = run("stop", "--all")
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [
            f"stopped the server on port {p} (PID {f.pid})." for p, f in zip((1, 2), fakes)
        ]
        assert [f.wait(5) for f in fakes] == [-signal.SIGTERM] * 2
        assert list(home.iterdir()) == []
    finally:
        for fake in fakes:
            fake.kill()
            fake.wait()
