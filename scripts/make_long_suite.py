"""Write the `long` bench suite (dflash_mac/data/suites/long.jsonl): code prompts of 1,000 to
1,900 tokens for the bundled pair, whose target has a 2,048-token context.

Each prompt is one of the code suite's held-out requests ("In the Python module `m`, write the
function `f`...") preceded by source of that same held-out module as context, with the requested
function itself left out (so the answer cannot be copied). Context lengths are spread evenly
over the range so the bench can report speedup against prompt length.

    python scripts/make_long_suite.py  # needs the stdlib the bundled pair was built from
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tokenizers import Tokenizer

from dflash_mac.bundle.corpus import render_chat, split_modules

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "models" / "bundled" / "eval_prompts.jsonl"
OUT = ROOT / "dflash_mac" / "data" / "suites" / "long.jsonl"
LOW, HIGH, COUNT = 1040, 1900, 12


def context_lines(source: str, line: int) -> tuple[list[str], int]:
    """The module's lines without the function starting at `line`, and where it was."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno == line:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            return lines[:start] + lines[node.end_lineno :], start
    raise ValueError(f"no function at line {line}")


def build(target: int, request: str, module: str, lines: list[str], at: int, tok) -> dict:
    """Grow a window of lines around the function's place until the prompt has `target`
    tokens (the window ends where the function was, and extends past it only if needed)."""
    lo, hi = at, at
    best = None
    while lo > 0 or hi < len(lines):
        lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
        code = "\n".join(lines[lo:hi])
        content = f"The Python module `{module}` so far:\n\n```python\n{code}\n```\n\n{request}"
        n = len(tok.encode(render_chat([{"role": "user", "content": content}], True)).ids)
        if n > target:
            break
        best = (content, n)
    return {"content": best[0], "tokens": best[1]}


def main() -> None:
    tok = Tokenizer.from_file(str(ROOT / "models" / "bundled" / "target" / "tokenizer.json"))
    _, heldout = split_modules()
    sources = {m.name: m.source for m in heldout}
    requests = [json.loads(line) for line in CODE.read_text().splitlines() if line.strip()]
    targets = [LOW + (HIGH - LOW) * i // (COUNT - 1) for i in range(COUNT)]
    out, used = [], 0
    for rec in requests:
        if len(out) == COUNT:
            break
        module, line = rec["module"], int(rec["id"].rsplit(":", 1)[1])
        lines, at = context_lines(sources[module], line)
        built = build(targets[len(out)], rec["messages"][0]["content"], module, lines, at, tok)
        if built["tokens"] < targets[len(out)] - 60:  # the module is too short for this length
            continue
        used += 1
        out.append(
            {
                "id": f"long-{built['tokens']}:{rec['id']}",
                "module": module,
                "messages": [{"role": "user", "content": built["content"]}],
            }
        )
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"{len(out)} prompts -> {OUT}: " + ", ".join(r["id"].split(":")[0] for r in out))


if __name__ == "__main__":
    main()
