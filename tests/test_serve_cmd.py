"""`dflash-mac serve` plumbing: PID file, port check, clean CLI errors (no model needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mac.serve.command import PidFile, ServeError, check_free, data_dir


def test_data_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path / "h"))
    assert data_dir() == tmp_path / "h" and data_dir().is_dir()


def test_pid_file_written_and_removed(tmp_path):
    with PidFile(tmp_path, "http://127.0.0.1:1/v1", 1):
        assert (tmp_path / "serve-1.pid").read_text().strip() == str(os.getpid())
        assert (tmp_path / "serve-1.url").read_text().strip() == "http://127.0.0.1:1/v1"
    assert not (tmp_path / "serve-1.pid").exists() and not (tmp_path / "serve-1.url").exists()


def test_pid_file_refuses_a_live_server(tmp_path):
    other = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "serve-8080.pid").write_text(f"{other.pid}\n")
        with pytest.raises(ServeError, match="already running on port 8080"):
            with PidFile(tmp_path, "u", 8080):
                pass
        assert (tmp_path / "serve-8080.pid").read_text().strip() == str(other.pid)  # left alone
        with PidFile(tmp_path, "u", 8081):  # another port: side by side
            assert (tmp_path / "serve-8081.pid").exists()
    finally:
        other.kill()
        other.wait()
    with PidFile(tmp_path, "u", 8080):  # a dead PID is stale: taken over
        pass


@pytest.mark.slow
def test_busy_port_is_one_clean_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServeError, match="cannot listen"):
            check_free("127.0.0.1", port)
        exe = Path(sys.executable).with_name("dflash-mac")  # the installed command
        result = subprocess.run(
            [str(exe), "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot listen on 127.0.0.1:") and "Traceback" not in line
