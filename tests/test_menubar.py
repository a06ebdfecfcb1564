"""The SwiftBar / xbar plugin (POSIX sh + curl) against a stopped and a running server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

PLUGIN = Path(__file__).resolve().parents[1] / "app" / "menubar" / "dflash-mac.5s.sh"
ACTION = re.compile(
    r'^[^|]+\| bash="[^"]+" param1=[a-z-]+( param2=\d+)? terminal=false refresh=true$'
)

pytestmark = pytest.mark.skipif(not shutil.which("curl"), reason="the plugin needs curl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env(tmp_path, tiny_dirs):
    """Plugin settings: a temp data dir, the tiny pair, `python -m dflash_mac` as the command,
    and fake pbcopy / osascript that record what they were given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("pbcopy", "osascript"):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\n{{ echo "$@"; cat; }} > "{tmp_path}/{name}.out"\n')
        fake.chmod(0o755)
    port = free_port()
    return {
        **os.environ,
        "DFLASH_MAC_HOME": str(tmp_path / "home"),
        "DFLASH_MAC_CMD": f"{sys.executable} -m dflash_mac",
        "DFLASH_MAC_PORT": str(port),
        "DFLASH_MAC_BLAS": "reference",  # skip the OpenBLAS re-exec: one import, not two
        "DFLASH_MAC_MODEL": str(tiny_dirs[0]),
        "DFLASH_MAC_DRAFT": str(tiny_dirs[1]),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TMP_OUT": str(tmp_path),
    }


def plugin(env: dict, *args: str) -> str:
    r = subprocess.run(
        ["sh", str(PLUGIN), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def check_format(out: str) -> list[str]:
    lines = out.splitlines()
    assert lines[0] and not lines[0].startswith("-") and "|" not in lines[0]  # the title
    assert lines[1] == "---"
    actions = [line for line in lines if "bash=" in line]
    assert actions and all(ACTION.match(line.removeprefix("--")) for line in actions), actions
    return lines


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def healthy(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def alive(pid: int) -> bool:
    """A running (not zombie) process."""
    r = subprocess.run(["ps", "-p", str(pid), "-o", "stat="], capture_output=True, text=True)
    return r.returncode == 0 and "Z" not in r.stdout


def test_stopped_menu_and_simple_actions(env, tmp_path):
    lines = check_format(plugin(env))
    assert "stopped" in lines[0]
    assert any(line.startswith("Start server |") for line in lines)
    assert not any(line.startswith("Stop server") for line in lines)
    url = f"http://127.0.0.1:{env['DFLASH_MAC_PORT']}/v1"
    plugin(env, "copy-url")
    assert (tmp_path / "pbcopy.out").read_text().strip() == url
    plugin(env, "chat")
    assert "dflash_mac chat --model" in (tmp_path / "osascript.out").read_text()
    home = Path(env["DFLASH_MAC_HOME"])
    home.mkdir()
    (home / f"serve-{env['DFLASH_MAC_PORT']}.pid").write_text("999999\n")  # stale: no such process
    assert "stopped" in plugin(env).splitlines()[0]


@pytest.mark.slow
def test_start_and_stop_really_run_the_server(env):
    port, home = env["DFLASH_MAC_PORT"], Path(env["DFLASH_MAC_HOME"])
    pid_file, log_file = home / f"serve-{port}.pid", home / f"serve-{port}.log"
    started = time.time()
    assert "started" in plugin(env, "start")
    assert time.time() - started < 5  # backgrounded, no terminal
    pid = int(pid_file.read_text())
    try:
        assert plugin(env).splitlines()[0] in ("◐ dflash starting", "● dflash running")
        assert wait_for(lambda: healthy(port), 60), log_file.read_text()
        assert int(pid_file.read_text()) == pid
        lines = check_format(plugin(env))
        assert lines[0] == "● dflash running"
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200
        lines = check_format(plugin(env))
        assert re.fullmatch(r"● dflash [\d.]+ tok/s · τ [\d.]+", lines[0]), lines[0]
        assert any(line.startswith("Server: running") for line in lines)
        assert any(line.startswith("Stop server |") for line in lines)
        assert any(line.startswith("Model: ") and "DFlash" in line for line in lines)
        assert any("chat: prompt" in line for line in lines)  # recent log
        assert "Requests: 1, 0 failed, 4 tokens generated" in lines
        log = log_file.read_text()
        assert "POST /v1/chat/completions" in log  # access lines, but not the polling ones
        assert "GET /health" not in log and "GET /metrics" not in log
        assert "stopped" in plugin(env, "stop")
        assert not alive(pid) and not pid_file.exists()
        assert not healthy(port)
        assert "stopped" in check_format(plugin(env))[0]
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


class FakeServer(ThreadingHTTPServer):
    """Answers /health and /metrics?format=prometheus with canned bodies (a failing server is
    hard to make for real)."""

    health: dict = {}
    prometheus = ""


class FakeHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        srv = self.server
        body = (json.dumps(srv.health) if self.path == "/health" else srv.prometheus).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_failing_server_is_shown_red_with_its_error_and_counts(env):
    srv = FakeServer(("127.0.0.1", int(env["DFLASH_MAC_PORT"])), FakeHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.prometheus = (
        'dflash_info{model="m",model_id="t",draft="d",drafter="DFlash"} 1\n'
        "dflash_requests_total 3\ndflash_failed_total 2\n"
        "dflash_completion_tokens_total 7\ndflash_degraded 1\n"
    )
    try:
        srv.health = {
            "status": "degraded",
            "last_error": "generation failed: boom | bang",
            "requests": 3,
            "completed": 1,
            "failed": 2,
        }
        lines = check_format(plugin(env))
        assert lines[0] == "▲ dflash failing"
        server_line = next(line for line in lines if line.startswith("Server: "))
        assert "failing" in server_line and "color=red" in server_line
        assert not any("color=green" in line for line in lines)
        assert "--generation failed: boom ¦ bang | color=red font=Menlo size=11" in lines
        assert "Requests: 3, 2 failed, 7 tokens generated" in lines
        srv.health = {"status": "ok", "requests": 4, "completed": 2, "failed": 2}
        lines = check_format(plugin(env))
        assert lines[0] == "● dflash running"
        assert any(line.startswith("Server: running") and "color=green" in line for line in lines)
        assert not any("color=red" in line for line in lines)
    finally:
        srv.shutdown()
        srv.server_close()


def fake_serve_process() -> subprocess.Popen:
    """A live process whose command line says `serve`, as the plugin checks."""
    code = "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code, "serve"], stdin=subprocess.DEVNULL)


def test_each_running_server_is_listed_and_can_be_stopped(env):
    home = Path(env["DFLASH_MAC_HOME"])
    home.mkdir()
    port, other = int(env["DFLASH_MAC_PORT"]), free_port()
    servers, procs = [], []
    try:
        for p, model in ((port, "first"), (other, "second")):
            srv = FakeServer(("127.0.0.1", p), FakeHandler)
            srv.health = {"status": "ok", "requests": 1, "completed": 1, "failed": 0}
            srv.prometheus = (
                f'dflash_info{{model="{model}",model_id="t",draft="d",drafter="DFlash"}} 1\n'
                "dflash_requests_total 5\ndflash_failed_total 0\n"
                "dflash_last_decode_tps 12.5\ndflash_last_tau 3.25\n"
            )
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
            procs.append(fake_serve_process())
            (home / f"serve-{p}.pid").write_text(f"{procs[-1].pid}\n")
            (home / f"serve-{p}.url").write_text(f"http://127.0.0.1:{p}/v1\n")
        lines = check_format(plugin(env))
        assert lines[0] == "● dflash 12.5 tok/s · τ 3.25 · +1"
        assert any(line.startswith("Server: running at") for line in lines)
        want = f"Server on port {other}: second at http://127.0.0.1:{other}/v1 (PID {procs[1].pid})"
        assert f"{want} | color=green" in lines
        assert "--Last request: 12.5 tok/s, τ 3.25" in lines
        assert any(f"param1=stop param2={other} " in line for line in lines)
        assert f"stopped dflash-mac serve on port {other}" in plugin(env, "stop", str(other))
        procs[1].wait(10)
        lines = check_format(plugin(env))
        assert lines[0] == "● dflash 12.5 tok/s · τ 3.25"
        assert not any(line.startswith("Server on port") for line in lines)
        assert alive(procs[0].pid)
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for proc in procs:
            proc.kill()
            proc.wait(10)
