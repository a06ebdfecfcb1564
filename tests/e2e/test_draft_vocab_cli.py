"""`dflash-mac train --draft-vocab K` as a user runs it: the installed command trains a DFlash 2
drafter over the K ids the tiny target's answers use most, and `generate` with it gives the
target's own greedy text."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses


def test_train_with_a_draft_vocabulary_then_generate(cli, tmp_path):
    data = tmp_path / "prompts.jsonl"
    asks = ["def add(a, b):", "class Stack:", "import os", "for i in range(3):"]
    data.write_text("".join(json.dumps({"prompt": a}) + "\n" for a in asks))
    out = tmp_path / "drafter"
    res = cli(
        *("train", "-m", "tiny-code", "--data", str(data), "--out", str(out)),
        *("--arch", "dflash2", "--draft-vocab", "64", "--steps", "3", "--block-size", "4"),
        *("--gen-max-tokens", "24", "--batch-size", "2", "--anchors", "4"),
        *("--loss", "mix", "--cache-features", "--cache-dir", str(tmp_path / "cache")),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    assert "draft vocabulary: 64 of" in res.stdout + res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["draft_vocab_size"] == 64
    vocab = mx.load(str(out / "model.safetensors"))["draft_vocab"]
    assert vocab.dtype == mx.int32 and len(set(vocab.tolist())) == 64

    prompt = "def add(a, b):"
    common = ("--max-tokens", "24", "--temp", "0", "--no-copy", "--model", "tiny-code")
    plain = cli("generate", prompt, *common, "-b", "1")
    drafted = cli("generate", prompt, *common, "--draft", str(out), "-b", "4")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout


def test_generate_cuts_a_published_drafter_to_a_draft_vocabulary(cli):
    """FR-Spec at load: the tiny pair's drafter has no draft vocabulary; `--draft-vocab 64`
    counts its target's answers once, says so, and the text is the target's own."""
    prompt = "class Stack:"
    common = ("--max-tokens", "24", "--temp", "0", "--no-copy", "--model", "tiny-code")
    plain = cli("generate", prompt, *common, "-b", "1")
    cut = cli("generate", prompt, *common, "-b", "4", "--draft-vocab", "64")
    assert plain.returncode == 0 and cut.returncode == 0, plain.stderr + cut.stderr
    assert cut.stdout == plain.stdout
    assert "drafting over the 64 ids" in cut.stderr and "counted" in cut.stderr
    again = cli("generate", prompt, *common, "-b", "4", "--draft-vocab", "64")
    assert "counted" not in again.stderr and again.stdout == plain.stdout  # saved ranking
    bad = cli("generate", prompt, "--draft-vocab", "5")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "error: --draft-vocab must be at least 16 (got 5)."
