"""Issue 55, a new user's first minutes, each met through the installed command in a fresh
process: what a first run prints, what the defaults are, and one sentence for nonsense."""

from __future__ import annotations

import json
import re

import pytest

from .conftest import one_error

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

SOURCE_TAG = re.compile(r"\b\w+\.py:\d+\b")  # rich's `trainer.py:205` log-line tags


@pytest.mark.parametrize(
    ("args", "stdin", "said"),
    [
        (("generate", ""), "", "the prompt is empty"),
        (("generate", "   \n"), "", "the prompt is empty"),
        (("generate", "-"), "", "stdin was empty"),
        (("generate", "-"), " \n\t", "stdin was empty"),
    ],
)
def test_an_empty_prompt_is_one_sentence(cli, args, stdin, said):
    """It answered 'I'm here to help you with whatever' and exited 0."""
    res = cli(*args, stdin=stdin)
    assert one_error(res) == f"{said}; give the text to answer, or - to read it from stdin."
    assert res.stdout == ""


def test_a_prompt_on_stdin_is_answered(cli):
    """The control: stdin with text is read and answered."""
    res = cli("generate", "-", "-n", "4", "-b", "1", stdin="def add(a, b):")
    assert res.returncode == 0 and res.stdout.strip(), res.stderr


def test_train_defaults_are_the_recommended_recipe(cli, tmp_path):
    """No --data, --arch or --block-size: the shipped starter prompts train a DFlash 2 drafter
    at block 8 (they were --arch dflash at block 16), the output says how little 48 prompts
    are, and its log lines carry no source-file tags."""
    out = tmp_path / "drafter"
    res = cli(
        *("train", "-m", "tiny-code", "--out", str(out), "--steps", "2"),
        *("--gen-max-tokens", "8", "--batch-size", "2", "--anchors", "4"),
        *("--cache-dir", str(tmp_path / "cache")),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    said = res.stdout + res.stderr
    assert "the shipped starter prompts, 48 prompts" in said
    assert "a drafter that pays needs thousands" in said
    assert not SOURCE_TAG.search(said), said
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["architectures"] == ["DFlash2DraftModel"], cfg
    assert cfg["dflash_training"]["loss"] == "mix", cfg["dflash_training"]
