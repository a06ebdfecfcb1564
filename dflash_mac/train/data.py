"""Training data: prompts -> the target's OWN responses (docs/design.md §10), cached on disk.

Prompts come from a JSONL file, one object a line: chat ``{"messages": [...]}`` (trailing
assistant turns are dropped: the target answers itself) or plain ``{"text": ...}`` /
``{"prompt": ...}`` (a user turn through the chat template when the tokenizer has one, raw text
otherwise). The target regenerates every response with its plain decoding (mlx-lm's
`BatchGenerator`, greedy or sampled). The result is cached as JSONL of token ids under a key
that hashes the target's files, the prompts file and the generation settings, so a rerun skips
regeneration; an interrupted regeneration resumes from its ``.partial`` file.

Fixed text (`load_fixed`) is taught teacher-forced instead: ``{"messages": [...], "answer":
"..."}`` a line, the answer tokenized after the chat-templated messages and ended with the
target's EOS, with no generation (the target's features and soft labels on it are what the
drafter learns, as for its own answers).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_mac.answers import regenerate
from dflash_mac.errors import PromptError, UserError
from dflash_mac.prompts import read_prompt_file


class DataError(UserError, ValueError):
    """Unusable training data; the message is one sentence for the user."""


@dataclass
class Sequence:
    """One training sequence: prompt ids followed by the target's response ids."""

    prompt: list[int]
    response: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.response


def read_prompts(path: str | Path) -> list[dict | str]:
    """Prompts of a JSONL file (dflash_mac/prompts.py): `{"messages": [...]}` for chats, plain
    strings for text."""
    try:
        records = read_prompt_file(path)
    except PromptError as e:
        raise DataError(str(e))
    return [{"messages": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in records]


def encode_prompts(tokenizer: Any, prompts: list[dict | str], max_prompt: int) -> list[list[int]]:
    """Token ids of each prompt through the chat template (left-truncated to `max_prompt`)."""
    from dflash_mac.api import prompt_ids

    out = []
    for p in prompts:
        ids = prompt_ids(tokenizer, p["messages"] if isinstance(p, dict) else p)
        out.append(ids[-max_prompt:])
    return out


def file_digest(path: Path, h: Any | None = None) -> Any:
    h = h or hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h


def cache_key(target_dir: Path, prompts_path: Path, settings: dict) -> str:
    """Hash of the target's config/tokenizer/weights, the prompts file and the settings."""
    h = hashlib.sha256()
    files = [target_dir] if target_dir.is_file() else []  # a GGUF file holds it all
    files += sorted(target_dir.glob("*.json")) + sorted(target_dir.glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode())
        file_digest(f, h)
    file_digest(Path(prompts_path), h)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def load_or_regenerate(
    target: Any,
    tokenizer: Any,
    target_dir: Path,
    prompts_path: Path,
    cache_dir: Path,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    seed: int = 0,
    max_prompt: int = 1024,
    limit: int | None = None,
    batch_size: int = 32,
    chunk: int = 256,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int, int, float], None] | None = None,
) -> tuple[list[Sequence], Path]:
    """Cached regenerated sequences (and the cache file's path)."""
    if temp == 0:  # greedy answers do not depend on the seed: one cache for every seed
        seed = 0
    settings = {
        "max_tokens": max_tokens,
        "temp": temp,
        "seed": seed,
        "max_prompt": max_prompt,
        "limit": limit,
        "dtype": _dtype_name(target),
        "v": 1,
    }
    key = cache_key(Path(target_dir), Path(prompts_path), settings)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"regen-{key}.jsonl"
    if final.exists():
        seqs = _read_cache(final)
        log(f"regenerated data: {len(seqs)} sequences from cache {final}")
        return seqs, final
    prompts = read_prompts(prompts_path)
    if limit is not None and limit < len(prompts):  # evenly spread over the file
        prompts = [prompts[i] for i in np.linspace(0, len(prompts) - 1, limit).round().astype(int)]
    ids = encode_prompts(tokenizer, prompts, max_prompt)
    partial = final.with_suffix(".partial")
    done = _read_cache(partial) if partial.exists() else []
    _write_cache(partial, done)  # drops a torn last line before appending
    log(
        f"regenerating {len(ids) - len(done)} of {len(ids)} responses with the target "
        f"(max {max_tokens} tokens, temp {temp}) -> {final}"
    )
    t0, n_tok = time.perf_counter(), sum(len(s.response) for s in done)
    with partial.open("a", encoding="utf-8") as f:
        for start in range(len(done), len(ids), chunk):
            batch = ids[start : start + chunk]
            resp = regenerate(target, tokenizer, batch, max_tokens, temp, seed + start, batch_size)
            for p, r in zip(batch, resp):
                f.write(json.dumps({"prompt": p, "response": r}) + "\n")
                done.append(Sequence(p, r))
                n_tok += len(r)
            f.flush()
            if progress:
                progress(len(done), len(ids), n_tok, time.perf_counter() - t0)
    partial.rename(final)
    return done, final


def _dtype_name(target: Any) -> str:
    from mlx.utils import tree_flatten

    floats = [
        v.dtype for _, v in tree_flatten(target.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    ]
    return str(floats[0]) if floats else "?"


def _write_cache(path: Path, seqs: list[Sequence]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for s in seqs:
            f.write(json.dumps({"prompt": s.prompt, "response": s.response}) + "\n")


def _read_cache(path: Path) -> list[Sequence]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line of an interrupted run
            out.append(Sequence(rec["prompt"], rec["response"]))
    return out


def load_fixed(
    tokenizer: Any, path: Path, cache_dir: Path, max_prompt: int = 1024
) -> tuple[list[Sequence], Path]:
    """The sequences of a fixed-text file (module docstring), tokenized once into
    `cache_dir` (keyed by the file and the tokenizer's vocabulary), and that cache file: the
    feature store of the part is keyed by it."""
    from dflash_mac.api import prompt_ids

    h = file_digest(Path(path))
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    final = cache_dir / f"fixed-{h.hexdigest()[:16]}.jsonl"
    if final.exists():
        return _read_cache(final), final
    eos = list(tokenizer.eos_token_ids)[0]
    seqs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = prompt_ids(tokenizer, rec["messages"])[-max_prompt:]
            answer = list(tokenizer.encode(rec["answer"], add_special_tokens=False))
        except (ValueError, KeyError, TypeError, PromptError) as e:
            raise DataError(f"{path}, line {n}: not a fixed-text record ({e}).")
        seqs.append(Sequence(prompt, answer + [eos]))
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_suffix(".partial")
    _write_cache(partial, seqs)
    partial.rename(final)
    return seqs, final
