"""Loading: pair validation, strict drafter weights, clear one-sentence errors (API and CLI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_mac.loading.loader import LoadError, load, resolve
from dflash_mac.target.hooks import is_hooked


def copy_pair(tiny_dirs, tmp_path):
    t, d = tiny_dirs
    shutil.copytree(t, tmp_path / "t")
    shutil.copytree(d, tmp_path / "d")
    return tmp_path / "t", tmp_path / "d"


def edit_json(path, fn):
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def test_loads_fp32_and_unhooked(tiny_pair):
    assert tiny_pair.target.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert tiny_pair.drafter.fc.weight.dtype == mx.float32
    assert not is_hooked(tiny_pair.target)
    assert tiny_pair.kind == "DFlash"


def test_stray_embed_and_lm_head_keys_are_dropped(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    w = mx.load(str(d / "model.safetensors"))
    stray = {"embed_tokens.weight": mx.zeros((320, 64)), "lm_head.weight": mx.zeros((320, 64))}
    mx.save_safetensors(str(d / "model.safetensors"), {**w, **stray})
    # the drafter holds exactly its own saved weights; embedding and head stay the target's
    got = dict(tree_flatten(load(t, d, dtype=mx.float32).drafter.parameters()))
    assert sorted(got) == sorted(w)
    assert all(mx.array_equal(got[k], w[k]).item() for k in w)


def test_unexpected_or_missing_keys_fail(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    w = mx.load(str(d / "model.safetensors"))
    w["layers.0.extra.weight"] = mx.zeros((2,))
    del w["norm.weight"]
    mx.save_safetensors(str(d / "model.safetensors"), w)
    with pytest.raises(LoadError) as e:
        load(t, d)
    assert "missing ['norm.weight']" in str(e.value)
    assert "unexpected ['layers.0.extra.weight']" in str(e.value)


def test_wrong_pairing_is_caught_before_weights(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    edit_json(d / "config.json", lambda c: c.update(hidden_size=128))
    edit_json(d / "config.json", lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]))
    (d / "model.safetensors").write_bytes(b"not even read")
    with pytest.raises(LoadError) as e:
        load(t, d)
    assert str(e.value) == (
        f"drafter '{d}' does not fit target '{t}' (hidden size 128 vs 64; layer ids [9] beyond "
        "the target's 4 layers); use the drafter trained for this target."
    )


def test_corrupt_weights(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoadError, match="is not a readable safetensors file"):
        load(t, d)


def test_offline_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LoadError) as e:
        resolve("z-lab/Qwen3-4B-DFlash-b16")
    assert str(e.value) == (
        "'z-lab/Qwen3-4B-DFlash-b16' is not in the local Hugging Face cache and the Hub cannot "
        "be reached (HF_HUB_OFFLINE is set); unset it and run "
        "`dflash-mac pull z-lab/Qwen3-4B-DFlash-b16`, or pass a local folder."
    )


def cli(*args, env=None):
    e = {**os.environ, "DFLASH_MAC_BLAS": "reference", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dflash_mac", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=120,
    )


@pytest.mark.slow
def test_cli_generate_json(tiny_dirs, tiny_pair):
    t, d = tiny_dirs
    r = cli(
        "generate", "def add(a, b):", "-m", str(t), "-d", str(d), "-n", "12", "--json", "-b", "4"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in (
        "text",
        "tokens",
        "prompt_tokens",
        "generation_tokens",
        "acceptance_lengths",
        "tau",
        "histogram",
        "prefill_tps",
        "decode_tps",
        "peak_memory_gb",
        "finish_reason",
    ):
        assert key in out
    from dflash_mac.api import generate

    ref = generate(tiny_pair, "def add(a, b):", max_tokens=12, block_size=4)
    assert out["tokens"] == ref.tokens
    assert out["generation_tokens"] == 12 and out["finish_reason"] == "length"
    assert len(out["histogram"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["--temp", "-1"], "error: --temp must be >= 0 (got -1.0)."),
        (["--max-tokens", "0"], "error: --max-tokens must be at least 1 (got 0)."),
        (
            ["--reasoning", "on"],
            "error: this model's chat template has no thinking switch; "
            "--reasoning on is not supported.",
        ),
        (["--chat-template-args", "[1]"], "error: --chat-template-args must be a JSON object."),
        (["--draft-bits", "3"], "error: --draft-bits must be 4 or 8 (got 3)."),
    ],
)
def test_cli_bad_flags(tiny_dirs, args, message):
    t, d = tiny_dirs
    r = cli("generate", "hi", "-m", str(t), "-d", str(d), *args)
    assert r.returncode == 1
    assert " ".join(r.stderr.split()) == message
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_prompt_over_context(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    edit_json(t / "config.json", lambda c: c.update(max_position_embeddings=16))
    r = cli("generate", "x" * 40, "-m", str(t), "-d", str(d))
    assert r.returncode == 1
    assert "error: the prompt has" in r.stderr and "context is 16 tokens" in r.stderr


@pytest.mark.slow
def test_cli_missing_field_and_unknown_model(tiny_dirs, tmp_path):
    t, d = copy_pair(tiny_dirs, tmp_path)
    edit_json(d / "config.json", lambda c: c["dflash_config"].pop("mask_token_id"))
    r = cli("generate", "hi", "-m", str(t), "-d", str(d))
    assert r.returncode == 1
    assert " ".join(r.stderr.split()) == (
        f"error: {d}/config.json is missing the required field 'dflash_config.mask_token_id'."
    )
    r = cli("generate", "hi", "-m", "nobody/nothing-here", "-d", str(d))
    assert r.returncode == 1 and "not in the local Hugging Face cache" in r.stderr
