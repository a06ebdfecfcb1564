"""Lone requests through `serve`: `--max-batch 1` (one at a time) against `--max-batch 4` (the
batch engine, where a request with the server to itself runs the one-request loop), the code
suite sent one request at a time, greedy and at T 0.7, servers in the order 1, 4, 4, 1.

    python scripts/lone_serve.py [PROMPTS] [OUT.csv]

Each server starts on a copy of the data directory (cost curve and acceptance memory as they
were), answers one warm-up request, then the prompts; prints each answer's decode tok/s and τ,
the per-prompt ratios and their geometric mean, and whether greedy texts agree."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dflash_mac.bench.inputs import suite_prompts
from dflash_mac.platform import data_dir

ORDER = [1, 4, 4, 1]


def serve(home: Path, port: int, max_batch: int) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).with_name("dflash-mac")), "serve", "--port", str(port)]
    env = dict(os.environ, DFLASH_MAC_HOME=str(home))
    cmd += ["--max-batch", str(max_batch)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ready(root: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"error: the server at {root} did not start.")


def ask(root: str, messages: list[dict], temp: float, max_tokens: int) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": temp}
    r = httpx.post(root + "/v1/chat/completions", json=body | {"seed": 1}, timeout=600)
    return r.json()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    out_csv = sys.argv[2] if len(sys.argv) > 2 else None
    prompts = suite_prompts("code")[:n]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, mb in enumerate(ORDER):
            home = Path(tmp) / f"home-{k}"
            shutil.copytree(data_dir(), home)
            port = 8190 + k
            root = f"http://127.0.0.1:{port}"
            proc = serve(home, port, mb)
            try:
                ready(root)
                ask(root, [{"role": "user", "content": "hi"}], 0.0, 16)  # warm-up
                for temp in (0.0, 0.7):
                    for p in prompts:
                        msgs = (
                            p.prompt
                            if isinstance(p.prompt, list)
                            else [{"role": "user", "content": p.prompt}]
                        )
                        r = ask(root, msgs, temp, 96)
                        d = r["dflash"]
                        text = r["choices"][0]["message"]["content"]
                        rows.append((k, mb, temp, p.id, d["decode_tps"], d["tau"], text))
                        print(k, mb, temp, p.id, d["decode_tps"], d["tau"], flush=True)
                batch = httpx.get(root + "/v1/dflash/stats", timeout=10).json().get("batch")
                print("batch:", batch, flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    for temp in (0.0, 0.7):
        ratios = []
        for p in prompts:
            tps = {
                mb: sum(r[4] for r in rows if r[2] == temp and r[3] == p.id and r[1] == mb)
                for mb in (1, 4)
            }
            ratios.append(tps[4] / tps[1])
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        shown = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"T {temp}: --max-batch 4 / --max-batch 1 decode tok/s: {mean:.3f} ({shown})")
    same = all(len({r[6] for r in rows if r[2] == 0 and r[3] == p.id}) == 1 for p in prompts)
    print("greedy texts identical in every server:", same)
    if out_csv:
        with open(out_csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["server_run", "max_batch", "temperature", "prompt", "decode_tps", "tau"])
            w.writerows(r[:6] for r in rows)


if __name__ == "__main__":
    main()
