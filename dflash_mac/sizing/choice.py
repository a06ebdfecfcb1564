"""The block-size policy: the one place that decides how wide a cycle's block is.

- Default: the drafter's trained block; when the target or the drafter is quantized, the
  registry's `quantized_block_size` for the pair (5 for pairs it does not know), because MLX's
  quantized matmuls lose efficiency at wide verify widths (docs/design.md §8).
- An explicit size above the drafter's trained block is clamped to it (a drafter trained at 8
  cannot draft 16), with a warning.
- An explicit size above the quantized default on a quantized pair runs, with a warning.
- `auto` (what None means): the default above is the largest size the online controller
  (dflash_mac/autoblock.py) may pick each cycle, from 1 (plain decoding) up; its cost prior is
  the curve `bench --cost-curve` saved for the pair on this machine (`cost_curve_path`),
  loaded with what earlier processes remembered (`load_tuning`, `save_acceptance`).

Front ends resolve the request once (`block_size_for`) and show `BlockChoice.warning`; the
engine prints nothing and reads no file while it decodes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..host import data_dir, machine_key, write_atomic
from ..loading.registry import PairEntry, load_registry, pair_for
from ..pair import Pair
from ..settings import AUTO, parse_block_size
from .controller import AutoTuning, CostCurve

QUANTIZED_MAX_BLOCK = 5  # for quantized pairs the registry does not list
LONG_CONTEXT = 1024  # contexts from here on get their own `auto` controller


@dataclass(frozen=True)
class BlockChoice:
    """How wide a request's blocks are: parsed and resolved against the pair once, then
    carried (`GenerationConfig.block`); `warning` says why the request was changed or is
    unwise (front ends show it)."""

    size: int  # the fixed size, or with `auto` the largest the controller may pick
    warning: str | None = None
    auto: bool = False

    @property
    def label(self) -> str:
        """ "8", or "auto ≤8"."""
        return f"{AUTO} ≤{self.size}" if self.auto else str(self.size)

    @property
    def plain(self) -> bool:
        """A fixed block of 1: plain decoding, nothing drafted (not even copies)."""
        return self.size == 1 and not self.auto


def quantized_default(trained: int, entry: PairEntry | None) -> int:
    """The default block of a quantized pair: the registry's figure, else min(5, trained)."""
    return min(entry.quantized_block_size if entry else QUANTIZED_MAX_BLOCK, trained)


def registry_entry(pair: Pair) -> PairEntry | None:
    """The registry's entry for a loaded pair (None when unknown or the registry is unreadable)."""
    try:
        return pair_for(pair.model_id, pair.draft_id)
    except Exception:  # an unreadable registry must not stop generation
        return None


def block_size_for(
    pair: Pair, requested: int | str | None, entry: PairEntry | None = None
) -> BlockChoice:
    """The block size for `pair` when the user asked for `requested` (None or "auto": the
    controller, up to the default size: the pair's block, or on a quantized pair the
    registry's quantized size). `entry`: the pair's registry entry (looked up when None)."""
    trained = pair.drafter.config.block_size
    if entry is None and pair.quantized:
        entry = registry_entry(pair)
    default = min(pair.block_size, trained)
    if pair.quantized:
        default = quantized_default(default, entry)
    requested = parse_block_size(requested)
    if requested is None:
        return BlockChoice(default, auto=True)
    if requested > trained:
        return BlockChoice(
            trained,
            warning=f"block size {requested} > the drafter's trained block {trained}; "
            f"using {trained}.",
        )
    if pair.quantized and requested > default:
        return BlockChoice(
            requested,
            warning=f"block size {requested} > {default} is slower with a "
            f"quantized model (default {default}).",
        )
    return BlockChoice(requested)


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
