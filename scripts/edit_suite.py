"""Writes dflash_mac/data/suites/edit.jsonl: the copy-heavy `bench --suite edit` prompts, built
here from the standard library's own functions (no network).

Each prompt pastes a function and asks for the whole function back with one change (a rename,
a docstring, a bug fixed, type hints): most of the answer repeats the prompt, as edits do in
coding assistants. Run it again only to change the suite."""

from __future__ import annotations

import fnmatch
import inspect
import json
import shlex
import string
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "dflash_mac" / "data" / "suites" / "edit.jsonl"

FUNCTIONS = [
    (textwrap, "indent"),
    (textwrap, "dedent"),
    (shlex, "quote"),
    (shlex, "join"),
    (fnmatch, "filter"),
    (fnmatch, "fnmatchcase"),
    (string, "capwords"),
    (textwrap, "shorten"),
    (shlex, "split"),
    (fnmatch, "fnmatch"),
]


def tasks(name: str, src: str) -> list[tuple[str, str]]:
    """(kind, request) pairs for one function."""
    broken = src.replace(" == ", " != ", 1) if " == " in src else src.replace(" + ", " - ", 1)
    return [
        (
            "rename",
            f"Rename the function `{name}` to `{name}_v2` and return the whole function, "
            f"changed nowhere else:\n\n```python\n{src}```",
        ),
        (
            "docstring",
            f"Add a one-line comment above every `return` in this function and return "
            f"the whole function:\n\n```python\n{src}```",
        ),
        (
            "fix",
            f"This function has one bug (one operator was changed). Return the corrected "
            f"function in full:\n\n```python\n{broken}```",
        ),
    ]


def main() -> None:
    rows = []
    for module, name in FUNCTIONS:
        try:
            src = textwrap.dedent(inspect.getsource(getattr(module, name)))
        except (OSError, TypeError):  # implemented in C on this Python
            print(f"skipped {module.__name__}.{name}: no Python source")
            continue
        for kind, text in tasks(name, src):
            rows.append(
                {
                    "id": f"edit-{module.__name__}.{name}-{kind}",
                    "messages": [{"role": "user", "content": text}],
                }
            )
    rows = rows[::3] + rows[1::3] + rows[2::3]  # the first prompts cover every kind
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {OUT}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
