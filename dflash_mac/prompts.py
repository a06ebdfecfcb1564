"""The one reader of prompt files (JSONL) for bench, train and evaluation.

Each line is an object with `messages` (a chat: a list of `{role, content}`; trailing assistant
turns are dropped, since the target answers itself), or with `prompt` / `text` (raw text), and an
optional `id`; a bare JSON string is raw text too. Blank lines are skipped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import PromptError

# 48 everyday code and chat asks, shipped: `train`'s default data, the draft vocabulary's count
STARTER_PROMPTS = Path(__file__).parent / "data" / "prompts" / "starter.jsonl"


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a file: chat messages or raw text, its line and its `id` (None if the line
    gives none)."""

    prompt: str | list[dict]
    line: int
    id: str | None = None


def parse_record(item: object) -> str | list[dict] | None:
    """The prompt of one decoded line, or None when it holds none."""
    if isinstance(item, str):
        return item or None
    if not isinstance(item, dict):
        return None
    if isinstance(msgs := item.get("messages"), list):
        msgs = list(msgs)
        while msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
            msgs.pop()
        valid = msgs and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs)
        return msgs if valid else None
    text = item.get("prompt", item.get("text"))
    return text if isinstance(text, str) and text else None


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    """All prompts of a JSONL file; `PromptError` with the file and line for anything else."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptError(f"prompts file {path} does not exist.")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"prompts file {path} cannot be read ({e}).")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path} line {n} is not valid JSON ({e.msg}).")
        prompt = parse_record(item)
        if prompt is None:
            raise PromptError(
                f'{path} line {n} needs a non-empty "messages" list or a "prompt" / "text" string.'
            )
        given = item.get("id") if isinstance(item, dict) else None
        out.append(PromptRecord(prompt, n, None if given is None else str(given)))
    if not out:
        raise PromptError(f"prompts file {path} holds no prompts.")
    return out
