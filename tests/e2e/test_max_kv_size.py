"""`--max-kv-size` as a user starts it: `generate` keeps a rotating window and its greedy
output equals mlx-lm's plain decoding with the same max_kv_size on the same weights; a bad
value is one sentence before anything loads, for generate, serve and chat alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
N, WINDOW = 48, 16

# mlx-lm's own decoding of the bundled target (the weights as dflash-mac loads them, the BLAS
# it re-executes itself with), in a fresh process: unbounded and with max_kv_size
REFERENCE = """
import sys
from dflash_mac.host import maybe_reexec_with_openblas

maybe_reexec_with_openblas(sys.argv[1:])
import json
import mlx.core as mx
from mlx_lm.generate import generate_step
from dflash_mac.loading.loader import load

pair = load()
ids = list(pair.tokenizer.encode(sys.argv[1]))
def run(window):
    steps = generate_step(mx.array(ids), pair.target, max_tokens=int(sys.argv[2]),
                          max_kv_size=window)
    return [t for t, _ in steps]
print(json.dumps({"window": run(int(sys.argv[3])), "unbounded": run(None),
                  "eos": sorted(pair.eos_ids)}))
"""


def reference(env: dict, folder: Path) -> dict:
    script = folder / "reference.py"
    script.write_text(REFERENCE)
    r = subprocess.run(
        [sys.executable, str(script), PROMPT, str(N), str(WINDOW)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.slow
def test_generate_with_a_window_matches_mlx_lm(cli, tmp_path):
    ref = reference(cli.env, tmp_path)
    assert ref["window"] != ref["unbounded"]  # the window changes what the target says
    args = ["generate", PROMPT, "--ignore-chat-template", "-n", str(N), "-b", "4", "--json"]
    r = cli(*args, "--max-kv-size", str(WINDOW))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tokens = out["tokens"]
    assert tokens == ref["window"][: len(tokens)]
    if out["finish_reason"] == "stop":  # the bundled model said EOS where mlx-lm did
        assert ref["window"][len(tokens)] in ref["eos"]
    else:
        assert len(tokens) == N


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_a_bad_window_is_one_sentence(cli, command):
    args = [command, "hi"] if command == "generate" else [command]
    r = cli(*args, "--max-kv-size", "3", timeout=60)
    assert r.returncode == 1
    assert "--max-kv-size must be more than 4" in r.stderr and "Traceback" not in r.stderr
    assert not r.stdout.strip()


def test_help_lists_the_option(cli):
    for command in ("generate", "serve", "chat"):
        r = cli(command, "--help")
        assert "--max-kv-size" in r.stdout, command
