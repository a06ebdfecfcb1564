"""The one context rule (prompt + answer must fit the model's context) and `generate`'s cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mac.api import PromptError, TokenBudget, fit_max_tokens
from dflash_mac.loading.loader import BUNDLED_DRAFT

CLI = Path(sys.executable).with_name("dflash-mac")


def test_max_tokens_is_capped_to_the_room_left():
    assert fit_max_tokens(2048, 2000, 256) == TokenBudget(48, True)
    assert fit_max_tokens(2048, 1792, 256) == TokenBudget(256, False)
    assert fit_max_tokens(2048, 2047, 1) == TokenBudget(1, False)


def test_a_prompt_that_fills_the_context_fails_with_one_sentence():
    with pytest.raises(PromptError) as e:
        fit_max_tokens(2048, 2048, 16)
    assert str(e.value) == "the prompt has 2048 tokens but the model's context is 2048 tokens."


def test_stream_generate_stops_at_the_context(tiny_pair):
    import copy

    from dflash_mac.api import generate

    pair = copy.copy(tiny_pair)  # the same weights with a 40-token context
    pair.target_config = {**tiny_pair.target_config, "max_position_embeddings": 40}
    result = generate(pair, [5] * 37, max_tokens=50, use_eos=False)
    assert result.stats.generation_tokens == 3 and result.finish_reason == "length"


def run_generate(home: Path, prompt: str, *args: str) -> subprocess.CompletedProcess:
    """`generate` in a data home of its own (no other test's cost curve, which `auto` would
    otherwise measure and announce on first use: `-b 8` keeps stderr to what is tested)."""
    if not (BUNDLED_DRAFT / "config.json").exists():
        pytest.skip("the bundled pair is not built")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_MAC_HOME": str(home)}
    return subprocess.run(
        [str(CLI), "generate", "-", "--ignore-chat-template", "-b", "8", *args],
        input=prompt,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow
def test_generate_warns_once_and_caps_max_tokens(tmp_path):
    out = run_generate(tmp_path, "x " * 2030, "--max-tokens", "500", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    n, context = result["prompt_tokens"], 2048
    assert context - 40 < n < context
    assert out.stderr.strip() == (
        f"warning: the prompt has {n} tokens and the model's context "
        f"is {context}: --max-tokens capped to {context - n}."
    )
    assert result["generation_tokens"] <= context - n


@pytest.mark.slow
def test_generate_without_a_cap_says_nothing_and_too_long_fails(tmp_path):
    out = run_generate(tmp_path, "x " * 100, "--max-tokens", "4", "--json")
    assert out.returncode == 0 and out.stderr == ""
    out = run_generate(tmp_path, "x " * 2100, "--max-tokens", "4")
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()  # one sentence (no tokenizer warning before it)
    assert line.startswith("error: the prompt has ")
    assert line.endswith("tokens but the model's context is 2048 tokens.")
