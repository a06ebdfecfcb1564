"""`--block-size auto`'s files: where a pair's cost curve and remembered acceptance live in the
data directory, and loading and saving them (`load_tuning`, `save_acceptance`). Front ends call
these at start-up and after requests; the engine reads no file while it decodes (choice.py
resolves the block size, tuning.py keeps what `auto` learns in memory)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..host import data_dir, machine_key, write_atomic
from ..loading.registry import load_registry
from ..pair import Pair
from .choice import registry_entry
from .cost import CostCurve
from .tuning import AutoTuning

LONG_CONTEXT = 1024  # contexts from here on get their own `auto` controller


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def model_key(name: str) -> str:
    """A model id for file names: a Hub id as is, a local folder by its last two parts (so the
    bundled pair has one key wherever the package lives)."""
    path = Path(name)
    return "/".join(path.parts[-2:]) if path.is_absolute() else name


def target_key(model_id: str) -> str:
    """A target for file names: the registry pair's name when the registry knows it (by id,
    pinned file or content: a renamed copy of the default GGUF shares its curves), else
    `model_key`."""
    try:
        entry = load_registry().find_target(model_id)
    except Exception:  # an unreadable registry must not stop generation
        entry = None
    return entry.name if entry is not None else model_key(model_id)


def pair_file(pair: Pair) -> str:
    """The pair's file name in the data dir's folders: <target>--<drafter>.json, and
    ``--vocab<K>`` before the suffix for a drafter over a draft vocabulary of K ids (its pass
    costs and accepts otherwise)."""
    k = getattr(getattr(pair.drafter, "config", None), "draft_vocab_size", None)
    vocab = f"--vocab{k}" if k else ""
    return f"{slug(target_key(pair.model_id))}--{slug(model_key(pair.draft_id))}{vocab}.json"


def cost_curve_path(pair: Pair, machine: str | None = None) -> Path:
    """Where `bench --cost-curve` saves the pair's curve for this machine (and `auto` reads it):
    <data dir>/cost-curves/<machine>/<target>--<drafter>.json (`machine_key`)."""
    machine = machine or machine_key()
    return data_dir() / "cost-curves" / slug(machine) / pair_file(pair)


def acceptance_path(pair: Pair) -> Path:
    """Where `auto` remembers what acceptance the pair's requests saw, per setting (the same on
    any machine): <data dir>/acceptance/<target>--<drafter>.json."""
    return data_dir() / "acceptance" / pair_file(pair)


def read_acceptance(pair: Pair) -> dict:
    """The remembered acceptance of the pair by setting ({} when none or unreadable)."""
    try:
        data = json.loads(acceptance_path(pair).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tuning(pair: Pair) -> AutoTuning:
    """What `auto` starts from for `pair` on this machine: its saved cost curves (greedy and
    sampled), the acceptance earlier processes remembered per setting, and the registry's
    context bands and acceptance guess. Front ends call it once at start-up, after any
    calibration."""
    try:
        path = cost_curve_path(pair)
        greedy, sampled = CostCurve.load(path), CostCurve.load(path, sampled=True)
    except OSError:  # no data directory: the generic guess
        greedy = sampled = None
    entry = registry_entry(pair)
    limit = entry.long_context_tokens if entry and entry.long_context_tokens else None
    return AutoTuning(
        greedy_curve=greedy,
        sampled_curve=sampled,
        remembered=read_acceptance(pair),
        long_from=min(limit or LONG_CONTEXT, LONG_CONTEXT),
        loses_from=limit,
        guess=entry.acceptance_guess if entry else None,
    )


def save_acceptance(pair: Pair, tuning: AutoTuning) -> None:
    """Remember what acceptance `auto` saw per setting, so the next process starts from it
    instead of a generic guess (a fresh `generate` that meets a few rejected blocks first would
    otherwise fall back to plain steps on text a drafter predicts well). Seeded requests'
    controllers are not kept and not saved. A data directory that cannot be written is no
    error: `auto` then starts from the guess."""
    now = tuning.acceptance()
    if not now:
        return
    try:
        write_atomic(acceptance_path(pair), json.dumps(read_acceptance(pair) | now))
    except OSError:
        pass
