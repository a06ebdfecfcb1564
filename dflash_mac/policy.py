"""The block-size policy: the one place that decides how wide a cycle's block is.

- Default: the drafter's trained block; when the target or the drafter is quantized, the
  registry's `quantized_block_size` for the pair (5 for pairs it does not know), because MLX's
  quantized matmuls lose efficiency at wide verify widths (docs/design.md §8).
- An explicit size above the drafter's trained block is clamped to it (a drafter trained at 8
  cannot draft 16), with a warning.
- An explicit size above the quantized default on a quantized pair runs, with a warning.

Front ends show `BlockChoice.warning`; the engine prints nothing."""

from __future__ import annotations

from dataclasses import dataclass

from .pair import Pair
from .registry import PairEntry, pair_for

QUANTIZED_MAX_BLOCK = 5  # for quantized pairs the registry does not list


@dataclass(frozen=True)
class BlockChoice:
    """The block size to run and, when the request was changed or is unwise, why."""

    size: int
    warning: str | None = None


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
    pair: Pair, requested: int | None, entry: PairEntry | None = None
) -> BlockChoice:
    """The block size for `pair` when the user asked for `requested` (None: the default).
    `entry`: the pair's registry entry (looked up when None)."""
    trained = pair.drafter.config.block_size
    if entry is None and pair.quantized:
        entry = registry_entry(pair)
    default = quantized_default(trained, entry) if pair.quantized else trained
    if requested is None:
        return BlockChoice(default)
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
