"""`dflash-mac bench`'s inputs: the shipped suites, prompt and transcript files, and the
options that need no model. Light (no mlx-lm, no engine), so a bad option or a missing file
gets its sentence before the slow imports."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_mac.errors import PromptError
from dflash_mac.loading.sources import PACKAGE_MODELS
from dflash_mac.prompts import read_prompt_file
from dflash_mac.settings import AUTO

SUITES = ("code", "math", "chat", "long", "edit")
# `--suite all`; `long` (1,000-1,900 tokens) and `edit` (copy-heavy rewrites) run alone
ALL_SUITES = ("code", "math", "chat")
SUITE_DIR = Path(__file__).resolve().parent.parent / "data" / "suites"
FORMATS = ("md", "json", "jsonl", "csv")
AGENT_SUITE = SUITE_DIR / "agent.json"


def size_label(bs: int | str | None) -> str:
    return str(bs)


def size_order(bs: int | str) -> tuple[int, int]:
    """Sort key of block sizes: "auto" first, then the fixed sizes in order."""
    return (0, 0) if bs == AUTO else (1, int(bs))


class BenchError(PromptError):
    """A bench option or prompt file that cannot be used; one sentence for the user."""


# -- prompts ------------------------------------------------------------------------------


@dataclass
class BenchPrompt:
    """One benchmark prompt: chat messages or raw text."""

    id: str
    suite: str
    prompt: str | list[dict]

    @property
    def title(self) -> str:
        """What a person reads: the code suite's `module:Class.name:line` ids as the function
        asked for (`bz2.BZ2File.fileno()`), others as they are (`chat-03`)."""
        return readable_id(self.id)


def readable_id(prompt_id: str) -> str:
    """`_py_abc:get_cache_token:4` → `_py_abc.get_cache_token()`; any other id unchanged."""
    parts = prompt_id.split(":")
    if len(parts) == 3 and parts[2].isdigit() and all(parts[:2]):
        return f"{parts[0]}.{parts[1]}()"
    return prompt_id


def code_suite_path() -> Path:
    """The bundled pair's held-out prompts (the `code` suite)."""
    return PACKAGE_MODELS / "bundled" / "eval_prompts.jsonl"


def read_prompts(path: str | Path, suite: str | None = None) -> list[BenchPrompt]:
    """A prompts file (dflash_mac/prompts.py) as bench prompts of `suite` (the file's stem)."""
    suite = suite or Path(path).stem
    try:
        records = read_prompt_file(path)
    except PromptError as e:
        raise BenchError(str(e))
    return [BenchPrompt(r.id or f"{suite}-{r.line}", suite, r.prompt) for r in records]


def suite_prompts(name: str, warn: Callable[[str], Any] = print) -> list[BenchPrompt]:
    """Prompts of a shipped suite (`code`, `math`, `chat`, `long` or `all`)."""
    if name not in (*SUITES, "all"):
        raise BenchError(f"--suite must be one of {', '.join(SUITES)}, all (got {name!r}).")
    out = []
    for suite in ALL_SUITES if name == "all" else (name,):
        path = code_suite_path() if suite == "code" else SUITE_DIR / f"{suite}.jsonl"
        if suite == "code" and not path.exists():
            fallback = "the math and chat suites only" if name == "all" else "the math suite"
            warn(f"the code suite ({path}) is missing; benchmarking {fallback} instead.")
            if name == "code":
                out += read_prompts(SUITE_DIR / "math.jsonl", "math")
            continue
        out += read_prompts(path, suite)
    return out


BlockSize = int | str  # a fixed size, or AUTO ("auto")


def parse_block_sizes(text: str | None) -> list[BlockSize] | None:
    """`"5"`, `"auto"` or `"auto,2,5,8"` → "auto" first, then the sorted unique sizes; None
    when not given."""
    if text is None or not str(text).strip():
        return None
    try:
        parts = [p.strip() for p in str(text).split(",")]
        sizes = [AUTO if p == AUTO else int(p) for p in parts]
    except ValueError:
        raise BenchError(
            f"--block-size must be auto, an integer or a comma-separated list such as "
            f"auto,2,5,8 (got {text!r})."
        )
    fixed = sorted({s for s in sizes if s != AUTO})
    if any(s < 1 for s in fixed):
        raise BenchError(f"every --block-size must be at least 1 (got {text!r}).")
    return ([AUTO] if AUTO in sizes else []) + fixed


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise BenchError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r}).")
    return fmt


# -- agent transcripts ---------------------------------------------------------------------


def read_transcripts(path: Path | None = None) -> dict:
    """The transcripts file (the shipped one by default): system prompt and conversations."""
    path = path or AGENT_SUITE
    try:
        doc = json.loads(Path(path).read_text())
        assert isinstance(doc["system"], str)
        assert all(isinstance(t, str) for c in doc["conversations"] for t in c["turns"])
        assert all(isinstance(c["id"], str) for c in doc["conversations"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise BenchError(
            f"{path} is not an agent transcripts file "
            f'({{"system", "conversations": [{{"id", "turns"}}]}}): {e}'
        )
    return doc
