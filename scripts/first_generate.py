"""Fresh `dflash-mac generate` processes, greedy, on the first N code prompts: `auto` with
nothing remembered, `auto` starting from the acceptance the first process saved, and block 8
(bench/results/linux-x86_64-2core-intel-xeon-first-generate.md).

    DFLASH_MAC_HOME=<dir> python scripts/first_generate.py 8
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "models" / "bundled" / "eval_prompts.jsonl"
HOME = os.environ.get("DFLASH_MAC_HOME", "/tmp/dflash-first-generate")


def run(prompt: str, block: str) -> tuple[float, int, float]:
    """(decode tok/s, plain steps, τ) of one fresh process."""
    env = dict(os.environ, DFLASH_MAC_HOME=HOME)
    cmd = ["dflash-mac", "generate", prompt, "-n", "128", "--json", "--block-size", block]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env).stdout)
    return out["decode_tps"], out["block_sizes"].count(1), out["tau"]


def main(n: int) -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:n]]
    results: dict[str, list[tuple[float, int, float]]] = {
        "auto, nothing remembered": [],
        "auto, remembered": [],
        "block 8": [],
    }
    for row in rows:
        text = row["messages"][-1]["content"]
        shutil.rmtree(Path(HOME) / "acceptance", ignore_errors=True)
        results["auto, nothing remembered"].append(run(text, "auto"))
        results["auto, remembered"].append(run(text, "auto"))
        results["block 8"].append(run(text, "8"))
    for name, runs in results.items():
        tps = [r[0] for r in runs]
        print(
            f"{name:<26} tok/s median {statistics.median(tps):6.1f} mean "
            f"{statistics.fmean(tps):6.1f} · plain steps {sum(r[1] for r in runs):4d} · "
            f"τ mean {statistics.fmean(r[2] for r in runs):.2f}"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
