"""Fresh `dflash-mac generate` processes, greedy, on the first N code prompts: auto with nothing
remembered, auto with the acceptance remembered, and block 8. Prints tok/s and plain steps."""

import json
import os
import shutil
import statistics
import subprocess
import sys

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
home = os.environ.get("DFLASH_MAC_HOME", "/tmp/dflash-first-generate")
prompts = [
    json.loads(l)
    for l in open(
        os.path.join(os.path.dirname(__file__), "..", "models", "bundled", "eval_prompts.jsonl")
    )
][:N]


def run(prompt, block):
    env = dict(os.environ, DFLASH_MAC_HOME=home)
    r = subprocess.run(
        ["dflash-mac", "generate", prompt, "-n", "128", "--json", "--block-size", block],
        capture_output=True,
        text=True,
        env=env,
    )
    d = json.loads(r.stdout)
    s = d.get("stats", d)
    return s["decode_tps"], s["block_sizes"].count(1), s["tau"]


rows = {"auto, nothing remembered": [], "auto, remembered": [], "block 8": []}
for p in prompts:
    text = p["messages"][-1]["content"] if "messages" in p else p["prompt"]
    shutil.rmtree(f"{home}/acceptance", ignore_errors=True)
    rows["auto, nothing remembered"].append(run(text, "auto"))
    rows["auto, remembered"].append(run(text, "auto"))
    rows["block 8"].append(run(text, "8"))
for k, v in rows.items():
    print(
        f"{k:<26} tok/s median {statistics.median(x[0] for x in v):6.1f} mean {statistics.fmean(x[0] for x in v):6.1f} · plain steps {sum(x[1] for x in v):4d} · τ mean {statistics.fmean(x[2] for x in v):.2f}"
    )
