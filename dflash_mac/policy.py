"""The block-size policy: the one place that decides how wide a cycle's block is.

- Default: the drafter's trained block; when the target or the drafter is quantized, the
  registry's `quantized_block_size` for the pair (5 for pairs it does not know), because MLX's
  quantized matmuls lose efficiency at wide verify widths (docs/design.md §8).
- An explicit size above the drafter's trained block is clamped to it (a drafter trained at 8
  cannot draft 16), with a warning.
- An explicit size above the quantized default on a quantized pair runs, with a warning.
- `auto` (what None means): the default above is the largest size the online controller
  (dflash_mac/autoblock.py) may pick each cycle, from 1 (plain decoding) up; its cost prior is
  the curve `bench --cost-curve` saved for the pair on this machine (`cost_curve_path`).

Front ends show `BlockChoice.warning`; the engine prints nothing."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .autoblock import BlockController, CostCurve, CostModel, cost_model_for
from .errors import PromptError
from .pair import Pair
from .platform import cpu_name, data_dir, device_name, write_atomic
from .registry import PairEntry, pair_for

QUANTIZED_MAX_BLOCK = 5  # for quantized pairs the registry does not list
LONG_CONTEXT = 1024  # contexts from here on get their own `auto` controller
AUTO = "auto"


@dataclass(frozen=True)
class BlockChoice:
    """The block size to run and, when the request was changed or is unwise, why."""

    size: int  # the fixed size, or with `auto` the largest the controller may pick
    warning: str | None = None
    auto: bool = False


def parse_block_size(value: int | str | None) -> int | str | None:
    """A --block-size value: None (the default, auto), "auto" or an integer >= 1."""
    if value is None or value == AUTO:
        return value
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise PromptError(f"--block-size must be auto or an integer (got {value!r}).")
    if size < 1:
        raise PromptError(f"--block-size must be at least 1 (got {size}).")
    return size


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
    controller, up to the default size). `entry`: the pair's registry entry (looked up when
    None)."""
    trained = pair.drafter.config.block_size
    if entry is None and pair.quantized:
        entry = registry_entry(pair)
    default = quantized_default(trained, entry) if pair.quantized else trained
    requested = parse_block_size(requested)
    if requested is None or requested == AUTO:
        return BlockChoice(default, auto=True)
    if requested > trained:
        return BlockChoice(
            trained,
            f"block size {requested} > the drafter's trained block {trained}; using {trained}.",
        )
    if pair.quantized and requested > default:
        return BlockChoice(
            requested,
            f"block size {requested} > {default} is slower with a "
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


def pair_file(pair: Pair) -> str:
    """The pair's file name in the data dir's folders: <target>--<drafter>.json."""
    return f"{slug(model_key(pair.model_id))}--{slug(model_key(pair.draft_id))}.json"


def cost_curve_path(pair: Pair, machine: str | None = None) -> Path:
    """Where `bench --cost-curve` saves the pair's curve for this machine (and `auto` reads it):
    <data dir>/cost-curves/<machine>/<target>--<drafter>.json."""
    machine = machine or f"{device_name()}-{cpu_name()}"
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


def remember_acceptance(pair: Pair, controller: BlockController) -> None:
    """Save a controller's acceptance under its setting, so the next process starts from what
    this one saw instead of a generic guess (a fresh `generate` that meets a few rejected
    blocks first would otherwise fall back to plain steps on text a drafter predicts well).
    Controllers of seeded requests have no `memory` and are not saved. A data directory that
    cannot be written is no error: `auto` then starts from the guess."""
    if controller.memory is None:
        return
    try:
        data = read_acceptance(pair) | {controller.memory: controller.acc.state()}
        write_atomic(acceptance_path(pair), json.dumps(data))
    except OSError:
        pass


def long_context(pair: Pair, context_tokens: int) -> tuple[bool, bool]:
    """(long, known to lose): whether a request's context counts as long (the registry's
    `long_context_tokens` for the pair, else LONG_CONTEXT), and whether the registry says the
    drafter loses there."""
    entry = registry_entry(pair)
    limit = entry.long_context_tokens if entry and entry.long_context_tokens else None
    return context_tokens >= (limit or LONG_CONTEXT), limit is not None and context_tokens >= limit


def auto_controller(
    pair: Pair,
    bs_max: int,
    timed: bool = True,
    setting: tuple = (),
    context_tokens: int = 0,
    sampled: bool = False,
) -> BlockController:
    """The `auto` controller of a request, up to `bs_max`: the pair's saved cost curve as its
    prior (else a generic guess), refined by what earlier requests measured; greedy and
    sampled requests (`sampled`) keep apart curves and measurements. Requests with the
    same sampling `setting` and context band (short or long, `long_context`) continue one
    controller (its acceptance and fallback state carry over: a chat at T = 0.7 does not
    relearn each turn that drafting does not pay, and long prompts, where drafters trained on
    short ones accept less, do not spoil short ones). Where the registry says the drafter loses
    on long contexts, a long request starts with plain decoding and drafts only when its probes
    pay. A new controller starts from the acceptance earlier processes remembered for the
    setting where that is better than the guess (`remember_acceptance`, `start_from`).
    `timed=False` (seeded sampling): a fresh controller on the prior alone, so the sizes, and
    with them the random draws, depend only on the seed and the text."""
    long, loses = long_context(pair, context_tokens) if context_tokens else (False, False)
    key = (bs_max, setting, long)
    kept = getattr(pair, "_dflash_controllers", None)
    if timed and kept is not None and key in kept:
        return kept[key]
    model = getattr(pair, "_dflash_cost_models", {}).get(sampled)
    if model is None or not timed:
        try:
            prior = CostCurve.load(cost_curve_path(pair), sampled)
        except OSError:
            prior = None
        prior = prior or CostCurve.generic(bs_max)
        model = cost_model_for(pair, prior, sampled) if timed else CostModel(prior)
    # sampled requests keep a light guess: they mostly meet poorer acceptance, where a heavy
    # one only delays the fallback (the guess is what saves greedy starts, autoblock.py)
    guess = 1.0 if sampled else BlockController.GUESS_WEIGHT
    controller = BlockController(bs_max, model, timed=timed, plain_first=loses, guess_weight=guess)
    if timed:
        controller.memory = json.dumps([bs_max, list(setting), long])
        if not loses:  # known-losing long contexts keep their pessimistic start
            controller.start_from(read_acceptance(pair).get(controller.memory))
        try:
            if kept is None:
                kept = {}
                object.__setattr__(pair, "_dflash_controllers", kept)
            kept[key] = controller
        except (AttributeError, TypeError):  # a pair that takes no attributes
            pass
    return controller
