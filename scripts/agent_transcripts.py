"""Writes dflash_mac/data/suites/agent.json: the agent bench's transcripts (`bench --suite
agent`), built here from the standard library's own code, no network.

Every conversation starts with the same system prompt (an agent's rules, its tool schemas and
a few thousand tokens of repository files), then turns that append tool results and ask for
edits, as coding agents send them. Run it again only to change the transcripts."""

from __future__ import annotations

import fnmatch
import inspect
import json
import shlex
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "dflash_mac" / "data" / "suites" / "agent.json"

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {
        "name": "edit_file",
        "description": "Replace `old` with `new` in a file; both must be exact text.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "old": {"type": "string"},
                "new": {"type": "string"},
            },
        },
    },
    {
        "name": "run_tests",
        "description": "Run the test suite (or one test file) and return its output.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {
        "name": "search",
        "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
    },
]


def source(module, chars: int) -> str:
    text = inspect.getsource(module)
    return text[:chars].rsplit("\n", 1)[0] + "\n"


def system_prompt() -> str:
    files = [("textwrap.py", source(textwrap, 7000)), ("shlex.py", source(shlex, 5000))]
    files.append(("fnmatch.py", source(fnmatch, 3000)))
    parts = [
        "You are a coding agent working in a Python repository. Answer with one tool call "
        "at a time, or with the edited code in a fenced block when you are done. Keep every "
        "function's behaviour unless asked to change it.",
        "Tools:\n" + json.dumps(TOOLS, indent=1),
        "Repository files:",
    ]
    parts += [f"--- {name} ---\n{text}" for name, text in files]
    return "\n\n".join(parts)


CONVERSATIONS = [
    (
        "textwrap",
        [
            "In textwrap.py, TextWrapper.wrap should raise ValueError when width is less than "
            "1. Show the edit.",
            "Tool result (run_tests tests/test_textwrap.py):\nFAILED test_width_zero - "
            "AssertionError: ValueError not raised\n1 failed, 41 passed\nFix it.",
            "Now rename the method _split to _split_chunks everywhere in textwrap.py and show "
            "every function you changed.",
        ],
    ),
    (
        "shlex",
        [
            "Add a docstring to shlex.split that explains the comments and posix arguments.",
            "Tool result (search 'def split'):\nshlex.py:305: def split(s, comments=False, "
            "posix=True):\nWrite the whole function with the docstring.",
            "Tool result (run_tests):\n57 passed\nNow make quote() accept bytes too and show "
            "the edited function.",
        ],
    ),
    (
        "fnmatch",
        [
            "fnmatch.filter should skip names that are not strings. Write the edit.",
            "Tool result (run_tests tests/test_fnmatch.py):\nFAILED test_filter_bytes - "
            "TypeError: expected str\nFix the failing test without breaking bytes patterns.",
            "Explain in three sentences what translate() returns for the pattern '*.py'.",
        ],
    ),
]


def main() -> None:
    doc = {
        "note": "Written by scripts/agent_transcripts.py from the standard library's code.",
        "system": system_prompt(),
        "conversations": [{"id": cid, "turns": turns} for cid, turns in CONVERSATIONS],
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(doc['system'])} characters of system prompt)")


if __name__ == "__main__":
    main()
