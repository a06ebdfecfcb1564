"""`dflash-mac doctor`: every check's pass / warn / fail path, the self-test, the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mac import cli
from dflash_mac.cli import checks, doctor, machine, selftest
from dflash_mac.cli.checks import FAIL, PASS, WARN
from dflash_mac.cli.machine import Facts
from dflash_mac.loading import loader as loading
from dflash_mac.loading.registry import load_registry

runner = CliRunner()
GB = 10**9


@pytest.fixture
def mac(tmp_path) -> Facts:
    return Facts(
        system="darwin",
        machine="arm64",
        chip="Apple M3 Pro",
        macos="15.1",
        mlx="0.32.4",
        mlx_lm="0.32.2",
        metal=True,
        kernels="metal",
        kernels_error="",
        blas="Accelerate",
        memory_bytes=36 * GB,
        budget_bytes=27 * GB,
        hf_cache=tmp_path / "hub",
        offline=False,
    )


def status(check) -> str:
    assert check.message
    if check.status != PASS:
        assert check.advice  # every warning and failure says what to do
    return check.status


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, PASS),
        ({"macos": "13.6"}, WARN),
        ({"macos": "13.0"}, FAIL),
        ({"machine": "x86_64"}, FAIL),
        ({"system": "linux", "machine": "x86_64", "macos": ""}, WARN),
        ({"system": "win32"}, FAIL),
    ],
)
def test_platform(mac, change, expected):
    assert status(checks.check_platform(replace(mac, **change))) == expected


@pytest.mark.parametrize(
    "mlx_lm, expected", [("0.32.2", PASS), ("0.29.1", FAIL), ("missing", FAIL)]
)
def test_mlx(mac, mlx_lm, expected):
    assert status(checks.check_mlx(replace(mac, mlx_lm=mlx_lm))) == expected


@pytest.mark.parametrize(
    "change, expected",
    [({}, PASS), ({"system": "linux", "metal": False}, WARN), ({"metal": False}, FAIL)],
)
def test_metal(mac, change, expected):
    assert status(checks.check_metal(replace(mac, **change))) == expected


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, PASS),
        ({"kernels": "reference", "metal": False}, PASS),
        ({"kernels": "reference"}, WARN),
        ({"kernels": "error", "kernels_error": "DFLASH_MAC_KERNELS='x' is not valid"}, FAIL),
    ],
)
def test_kernels(mac, change, expected):
    assert status(checks.check_kernels(replace(mac, **change))) == expected


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, PASS),
        ({"system": "linux", "blas": "OpenBLAS"}, PASS),
        ({"system": "linux", "blas": "reference BLAS (MLX wheel)"}, WARN),
    ],
)
def test_blas(mac, change, expected):
    assert status(checks.check_blas(replace(mac, **change))) == expected


def test_memory_estimate():
    q8 = load_registry().get("qwen3-8b")
    need = checks.memory_need_gb(q8, 8192)
    assert need["target"] == q8.mlx_4bit_gb and need["drafter"] == q8.draft_gb
    assert need["kv"] == pytest.approx(144 * 1024 * 8192 / 1e9)
    assert need["total"] == pytest.approx(sum(v for k, v in need.items() if k != "total"))
    assert checks.memory_need_gb(q8, 8192, full=True)["target"] == q8.target_gb


@pytest.mark.parametrize(
    "pair, context, memory, expected",
    [
        ("qwen3-8b", 4096, 36, PASS),
        ("qwen3-8b", 4096, 8, WARN),  # fits the RAM, not the GPU budget
        ("qwen3.5-27b", 32768, 16, FAIL),
        ("qwen3-8b", 4096, 0, WARN),  # memory size unknown
    ],
)
def test_memory(mac, pair, context, memory, expected):
    f = replace(mac, memory_bytes=memory * GB, budget_bytes=int(0.75 * memory * GB))
    check = checks.check_memory(f, load_registry().get(pair), context)
    assert status(check) == expected
    assert pair in check.message


def test_hf_cache(mac, monkeypatch):
    entry = load_registry().get("qwen3-8b")
    check = checks.check_hf_cache(mac, entry)
    assert status(check) == PASS and str(mac.hf_cache) in check.message
    assert status(checks.check_hf_cache(replace(mac, offline=True), entry)) == WARN
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: Usage(10 * GB, 9 * GB, GB))
    assert status(checks.check_hf_cache(mac, entry)) == WARN
    assert status(checks.check_hf_cache(mac, load_registry().get("bundled"))) == PASS
    monkeypatch.setattr(checks.os, "access", lambda p, mode: False)
    assert status(checks.check_hf_cache(mac, entry)) == FAIL


@pytest.fixture
def tiny_loader(tiny_dirs):
    def loader(tmp: str):
        return loading.load(*tiny_dirs, dtype=mx.float32), True

    return loader


def test_selftest_pass(tiny_loader):
    check = selftest.check_selftest(tiny_loader, n=12)
    assert status(check) == PASS and "losslessly on a worker thread" in check.message


def test_selftest_uses_the_bundled_pair_and_reports_its_tau(monkeypatch):
    seen = []
    real = selftest.dflash_tokens

    def spy(pair, ids, n):
        seen.append((pair.model_id, pair.draft_id, ids))
        return real(pair, ids, n)

    monkeypatch.setattr(selftest, "dflash_tokens", spy)
    check = selftest.check_selftest(n=16)
    assert status(check) == PASS and check.message.startswith("bundled pair decodes")
    ((target, draft, _ids),) = seen
    assert (target, draft) == (str(loading.BUNDLED_TARGET), str(loading.BUNDLED_DRAFT))
    # A chat-formatted prompt in the drafter's domain: the trained drafter's drafts are
    # accepted (a raw-text prompt gave τ 1.00, no draft ever accepted).
    tau = float(check.message.split("τ ")[1].split(",")[0])
    assert tau > 1.5


def test_selftest_tau_is_the_drafters_whatever_the_cost_curve(monkeypatch, tmp_path):
    """A saved cost curve that prices drafting out (as a quick curve timed on a loaded machine
    did in the suite: block 8 = 5.5 plain steps) must not turn the self-test into plain steps:
    its τ reports the drafter (it read 1.07 under `auto`), and it leaves no acceptance memory."""
    from dflash_mac.calibrate import save
    from dflash_mac.sizing.files import acceptance_path, cost_curve_path

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    pair, _ = selftest.load_selftest_pair(str(tmp_path))
    dear = {"1": 1.0} | {str(b): 1.0 + 0.7 * (b - 1) for b in range(2, 17)}
    save({"ratios": dear, "sampled": {"ratios": dear}}, cost_curve_path(pair))
    _, tau = selftest.dflash_tokens(pair, selftest.selftest_ids(pair), 16)
    assert tau > 1.5
    assert not acceptance_path(pair).exists()


LAZY = """
from mlx.utils import tree_map
from dflash_mac.loading import loader
from dflash_mac.cli import selftest

def lazy_loader(tmp):
    pair = loader.load()
    # Weights left lazy on this thread, as load() left the fp32 cast before the fix.
    pair.target.update(tree_map(lambda p: p * 1, pair.target.parameters()))
    return pair, True

check = selftest.check_selftest(lazy_loader, n=4)
print(check.status, check.message)
"""


@pytest.mark.slow
def test_selftest_fails_when_weights_are_lazy_on_the_loading_thread():
    # A fresh interpreter: MLX aborts at exit after a thread hit the missing-stream error.
    r = subprocess.run(
        [sys.executable, "-c", LAZY],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{FAIL} decoding on a worker thread failed"), (line, r.stderr)
    assert "no Stream" in line and "`serve` and `chat` would fail" in line


def test_selftest_warns_and_builds_a_tiny_pair_without_the_bundle(monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "BUNDLED_DRAFT", tmp_path / "absent")
    check = selftest.check_selftest(n=8)
    assert status(check) == WARN and "tiny random pair" in check.message


def test_selftest_fails_on_divergence(tiny_loader, monkeypatch):
    real = selftest.reference_tokens
    monkeypatch.setattr(
        selftest, "reference_tokens", lambda pair, ids, n: [t + 1 for t in real(pair, ids, n)]
    )
    check = selftest.check_selftest(tiny_loader, n=8)
    assert status(check) == FAIL and "differs from mlx-lm at token 0" in check.message


def test_selftest_fails_when_the_pair_cannot_load():
    def broken(tmp: str):
        raise loading.LoadError("weights missing")

    check = selftest.check_selftest(broken)
    assert status(check) == FAIL and "weights missing" in check.message


def test_run_checks_on_this_machine():
    found = doctor.run_checks("qwen3-4b", 2048, selftest=False)
    assert [c.name for c in found] == [
        "platform",
        "mlx",
        "metal",
        "kernels",
        "blas",
        "memory",
        "hf cache",
    ]
    by_name = {c.name: c for c in found}
    assert by_name["mlx"].status == PASS and all(c.message for c in found)
    if sys.platform != "darwin":  # this Linux box: CPU only, no Metal, a warning each
        assert by_name["platform"].status == WARN and by_name["metal"].status == WARN
        assert by_name["kernels"].status == PASS and "reference" in by_name["kernels"].message
    unknown = doctor.run_checks("no-such-pair", selftest=False)
    assert [c.status for c in unknown if c.name == "memory"] == [FAIL]


def test_doctor_command_json_and_exit_code(mac, monkeypatch):
    monkeypatch.setattr(doctor, "gather_facts", lambda: mac)
    res = runner.invoke(cli.app, ["doctor", "--json", "--no-selftest", "--pair", "qwen3-8b"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ok"] and {c["status"] for c in data["checks"]} == {PASS}
    assert data["facts"]["chip"] == "Apple M3 Pro"
    monkeypatch.setattr(doctor, "gather_facts", lambda: replace(mac, mlx_lm="0.20.0"))
    res = runner.invoke(cli.app, ["doctor", "--no-selftest"])
    assert res.exit_code == 1
    assert "✗ mlx" in res.output and "1 failed" in res.output
    res = runner.invoke(
        cli.app, ["doctor", "--no-selftest", "--pair", "qwen3.5-27b", "--context", "500000"]
    )
    assert res.exit_code == 1 and "does not fit" in res.output


def test_facts_of_this_machine():
    f = machine.gather_facts()
    assert f.mlx == mx.__version__ and f.memory_bytes > 0
    assert isinstance(f.hf_cache, Path) and f.kernels in ("metal", "reference", "error")


def test_the_default_pair_is_sized_at_its_gguf_files_context_once_pulled(tmp_path, monkeypatch):
    from gguf_files import CONTEXT, write_gguf

    from dflash_mac.loading.sources import PypiSource

    entry = load_registry().get("smollm2-135m")
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    assert checks.model_context(entry) is None  # not pulled: nothing to read, no traceback
    src = PypiSource.parse(entry.file_spec)
    src.file.parent.mkdir(parents=True)
    write_gguf(src.file, "llama", "Q8_0")  # the pinned file's place in the data dir
    assert src.cached() and checks.model_context(entry) == CONTEXT


def test_a_linux_machine_without_openblas_gets_one_line_with_the_command(mac, monkeypatch):
    """Issue 55: without OpenBLAS `make run` decoded at 8.0 tok/s against 18.4 and nothing said
    why; every command now starts with one line naming the install command doctor gives."""
    from dflash_mac import host as plat

    monkeypatch.setattr(plat.sys, "platform", "linux")
    monkeypatch.delenv("DFLASH_MAC_BLAS", raising=False)
    monkeypatch.delenv(plat.OPENBLAS_ENV, raising=False)
    monkeypatch.setattr(plat, "find_openblas", lambda: None)
    note = plat.slow_blas_note()
    assert note and note.endswith(f"`{plat.OPENBLAS_INSTALL}`.")
    linux = replace(mac, system="linux", blas="reference BLAS (MLX wheel)")
    assert plat.OPENBLAS_INSTALL in checks.check_blas(linux).advice  # one rule, two places
    monkeypatch.setenv("DFLASH_MAC_BLAS", "reference")  # asked for: nothing to say
    assert plat.slow_blas_note() is None
    monkeypatch.delenv("DFLASH_MAC_BLAS")
    monkeypatch.setattr(plat, "find_openblas", lambda: "/usr/lib/libopenblas.so.0")
    assert plat.slow_blas_note() is None


def test_an_openblas_outside_the_system_folders_is_found_where_the_user_says(tmp_path, monkeypatch):
    """DFLASH_MAC_OPENBLAS names the library (conda, a build of one's own); naming a file
    that is not there finds none, and the start-up line says which setting is wrong."""
    from dflash_mac import host as plat

    monkeypatch.setattr(plat.sys, "platform", "linux")
    monkeypatch.delenv("DFLASH_MAC_BLAS", raising=False)
    lib = tmp_path / "libopenblas.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv(plat.OPENBLAS_ENV, str(lib))
    assert plat.find_openblas() == str(lib) and plat.slow_blas_note() is None
    monkeypatch.setenv(plat.OPENBLAS_ENV, str(tmp_path / "missing.so"))
    assert plat.find_openblas() is None
    assert plat.slow_blas_note().startswith(f"{plat.OPENBLAS_ENV} names {tmp_path}/missing.so")
    monkeypatch.delenv(plat.OPENBLAS_ENV)
    assert plat.find_openblas() in (*plat.OPENBLAS_CANDIDATES, None)  # the system's, if any
