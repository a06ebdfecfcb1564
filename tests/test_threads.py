"""A pair loaded on one thread decodes on another (the `serve` and chat app set-up).

Each case runs in a fresh interpreter so nothing else (another test, a main-thread generate)
has computed the weights first: MLX arrays are bound to the stream of the thread that built
them, and a weight left lazy at load fails on the generation thread."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_mac.loading.loader import BUNDLED_DRAFT, BUNDLED_TARGET

pytestmark = pytest.mark.slow  # every case runs in a fresh interpreter

SCRIPT = r"""
import json, sys, threading
from dflash_mac.api import generate
from dflash_mac.loading.loader import load, quantize_drafter

target, draft, bits = sys.argv[1], sys.argv[2], int(sys.argv[3])
pair = load(target, draft)  # main thread, default dtype (fp32 cast on the CPU)
if bits:
    quantize_drafter(pair.drafter, bits)
out = {}

def run():
    return generate(pair, "def add(a, b):", max_tokens=12, temp=0.0, use_eos=False).tokens

def work():
    try:
        out["thread"] = run()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"

t = threading.Thread(target=work)
t.start()
t.join()
if "thread" in out:  # the same pair, now on the main thread: the same greedy tokens
    out["main"] = run()
print(json.dumps(out))
"""


@pytest.mark.parametrize("draft, bits", [("dflash", 0), ("dflash2", 0), ("dflash", 8)])
def test_generate_on_a_fresh_thread_after_loading_on_main(draft, bits):
    folder = BUNDLED_DRAFT.parent / draft
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(BUNDLED_TARGET), str(folder), str(bits)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    assert len(out["thread"]) == 12 and out["thread"] == out["main"]
