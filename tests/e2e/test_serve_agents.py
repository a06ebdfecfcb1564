"""Two `dflash-mac serve` processes side by side (one per port, one data directory), the
menu-bar plugin listing both, and the Ollama API of the installed command."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import ollama
import openai
import pytest

from .conftest import Server, start_serve

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

PLUGIN = Path(__file__).resolve().parents[2] / "app" / "menubar" / "dflash-mac.5s.sh"


@pytest.fixture(scope="module")
def servers(cli, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    started = [start_serve(cli, folder / f"serve{i}.out", "--max-tokens", "16") for i in range(2)]
    try:
        for srv in started:
            srv.wait_healthy(90)
        yield started
    finally:
        for srv in started:
            srv.stop()


def port_of(srv: Server) -> str:
    return srv.root.rsplit(":", 1)[1]


def test_two_servers_side_by_side(cli, servers):
    a, b = servers
    for srv in servers:
        pid_file = srv.home / f"serve-{port_of(srv)}.pid"
        assert int(pid_file.read_text()) == srv.proc.pid
        url = (srv.home / f"serve-{port_of(srv)}.url").read_text().strip()
        assert url == srv.root + "/v1"
    oa = openai.OpenAI(base_url=a.root + "/v1", api_key="x", max_retries=0, timeout=60)
    r = oa.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].message.role == "assistant"
    ol = ollama.Client(host=b.root, timeout=60)
    name = ol.list().models[0].model
    assert name == "dflash-mac-bundled:latest"
    reply = ol.chat(
        model=name, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3}
    )
    assert reply.done and reply.eval_count <= 3
    # The same port again: refused in one sentence, the running server left alone.
    again = cli("serve", "--port", port_of(a), timeout=60)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert "cannot listen" in again.stderr or "already running" in again.stderr
    assert a.proc.poll() is None


@pytest.mark.skipif(not shutil.which("curl"), reason="the plugin needs curl")
def test_menubar_lists_both(servers):
    a, b = servers
    env = {**os.environ, "DFLASH_MAC_HOME": str(a.home), "DFLASH_MAC_PORT": port_of(a)}
    out = subprocess.run(
        ["sh", str(PLUGIN)], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("● dflash") and lines[0].endswith("· +1")
    assert any(line.startswith(f"Server: running at {a.root}/v1") for line in lines)
    want = f"Server on port {port_of(b)}: dflash-mac-bundled at {b.root}/v1 (PID {b.proc.pid})"
    assert any(line.startswith(want) for line in lines), out
