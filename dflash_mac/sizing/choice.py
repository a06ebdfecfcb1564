"""The block-size policy: the one place that decides how wide a cycle's block is.

- Default: the drafter's trained block; when the target or the drafter is quantized, the
  registry's `quantized_block_size` for the pair (5 for pairs it does not know), because MLX's
  quantized matmuls lose efficiency at wide verify widths (docs/design.md §8).
- An explicit size above the drafter's trained block is clamped to it (a drafter trained at 8
  cannot draft 16), with a warning.
- An explicit size above the quantized default on a quantized pair runs, with a warning.
- `auto` (what None means): the default above is the largest size the online controller
  (dflash_mac/sizing/controller.py) may pick each cycle, from 1 (plain decoding) up; its cost
  prior is the curve `bench --cost-curve` saved for the pair on this machine, loaded with what
  earlier processes remembered (files.py: `cost_curve_path`, `load_tuning`, `save_acceptance`).

Front ends resolve the request once (`block_size_for`) and show `BlockChoice.warning`; the
engine prints nothing and reads no file while it decodes."""

from __future__ import annotations

from dataclasses import dataclass

from ..loading.registry import PairEntry, pair_for
from ..pair import Pair
from ..settings import AUTO, parse_block_size

QUANTIZED_MAX_BLOCK = 5  # for quantized pairs the registry does not list


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
