"""A second drafter object with the same weights, drafting over a draft vocabulary: what the
tests and the sweep script compare against the whole-vocabulary original."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mac.loading import build_drafter
from dflash_mac.models.config import DraftConfig


def subset_copy(drafter, head, ids: list[int]):
    """A new drafter with `drafter`'s weights, bound to `head`, drafting over `ids`."""
    new = build_drafter(DraftConfig.from_dict(drafter.config.raw))
    weights = [(k, v) for k, v in tree_flatten(drafter.parameters()) if k != "draft_vocab"]
    new.load_weights(weights, strict=False)  # its own draft vocabulary is set below
    new.bind(head)
    new.set_draft_vocab(mx.array([int(i) for i in ids], dtype=mx.int32))
    mx.eval(new.parameters())  # materialised: used on worker threads
    return new
