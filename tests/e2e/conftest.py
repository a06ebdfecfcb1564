"""Fixtures for the end-to-end tests: the installed `dflash-mac` command, run as a user runs it.

The rule for the whole suite: no front-end test may depend on another test having warmed the
model on the main thread. Loading a pair in one thread and generating in another only works
when loading materialised every weight (MLX arrays belong to the stream of the thread that made
them), and an in-process test whose process already generated once on the main thread hides
that bug. So these tests never import the engine: every case starts the console script that
`pip install` put next to this Python (`.venv/bin/dflash-mac`) in a fresh subprocess, on the
bundled pair, offline (HF_HUB_OFFLINE=1), with its data directory (DFLASH_MAC_HOME) in a
temporary folder, servers on a free loopback port, every process bounded in time and stopped by
its PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

TIMEOUT_S = 120  # any one command; the tiny bundled pair needs a few seconds


def installed_command() -> str:
    """`dflash-mac` from this interpreter's bin folder (the venv the tests run in)."""
    bin_dir = Path(sys.executable).parent
    found = shutil.which("dflash-mac", path=str(bin_dir))
    if not found:
        pytest.fail(f"no dflash-mac console script in {bin_dir}; run pip install -e '.[test]'.")
    return found


_CURVES: list[Path] = []  # the tiny pair's cost curves, measured once per test process


def user_env(home: Path, measured: bool = True) -> dict[str, str]:
    """The environment of a user: no dflash-mac settings but the data directory, offline, on
    the tiny pair (the real default pair is pulled and run in test_default_pair.py). With
    `measured`, the data directory is one where `auto` already measured its cost curve (a
    user's second run; `measured_curves`): the first `auto` run of every fresh home would time
    the block sizes again, 10-25 s each on a loaded two-core machine. First use has its tests."""
    env = {k: v for k, v in os.environ.items() if not k.lstrip("_").startswith("DFLASH_MAC_")}
    env.update(DFLASH_MAC_HOME=str(home), HF_HUB_OFFLINE="1", NO_COLOR="1", COLUMNS="200")
    env.update(DFLASH_MAC_PAIR="tiny-code")
    if measured and _CURVES and not (home / "cost-curves").exists():
        shutil.copytree(_CURVES[0], home / "cost-curves")
    return env


@pytest.fixture(scope="session", autouse=True)
def measured_curves(tmp_path_factory) -> None:
    """Measure the tiny pair's quick cost curve once, as a user's first `auto` run does, for
    `user_env` to hand to fresh homes."""
    home = tmp_path_factory.mktemp("measured-home")
    r = Cli(installed_command(), user_env(home, measured=False))("generate", "hi", "-n", "1")
    assert r.returncode == 0, r.stderr
    assert list(home.glob("cost-curves/*/*.json")), r.stderr  # auto measured at first use
    _CURVES[:] = [home / "cost-curves"]


@dataclass
class Cli:
    """Runs `dflash-mac ARGS` to completion in a fresh process."""

    command: str
    env: dict[str, str]

    def __call__(
        self, *args: str, timeout: float = TIMEOUT_S, stdin: str = ""
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.command, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
        )


def one_error(res: subprocess.CompletedProcess) -> str:
    """The one sentence of a command that failed as it should: exit 1, one stderr line."""
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 1, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> Cli:
    return Cli(installed_command(), user_env(tmp_path_factory.mktemp("home")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `dflash-mac serve` process on loopback."""

    proc: subprocess.Popen
    root: str
    home: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"serve did not answer /health within {seconds} s:\n{self.output()}")

    def terminate(self, seconds: float = 20) -> int:
        """SIGTERM, as a launcher stops it; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(seconds)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, seconds: float = 10) -> None:
        """SIGTERM, then SIGKILL if it is still running after `seconds` (test teardown)."""
        try:
            self.terminate(seconds)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def start_serve(cli: Cli, log: Path, *args: str) -> Server:
    """`dflash-mac serve ARGS` on a free loopback port, its output in `log` (not yet healthy:
    call `wait_healthy`)."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [cli.command, "serve", "--port", str(port), *args],
            env=cli.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return Server(proc, f"http://127.0.0.1:{port}", Path(cli.env["DFLASH_MAC_HOME"]), log)


@pytest.fixture(scope="module")
def server(cli: Cli, tmp_path_factory):
    """One `dflash-mac serve` per module (bundled pair, free loopback port)."""
    log = tmp_path_factory.mktemp("serve") / "serve.out"
    srv = start_serve(cli, log, "--host", "127.0.0.1", "--max-tokens", "64")
    try:
        srv.wait_healthy(60)
        yield srv
    finally:
        srv.stop()
