"""Second drafter objects with the same weights: a plain copy, or one drafting over a draft
vocabulary; what the tests and the sweep script compare against the original."""

from __future__ import annotations

import mlx.core as mx
from dflash_mac.models.config import DraftConfig
from mlx.utils import tree_flatten

from dflash_mac.loading.loader import build_drafter


def copy_drafter(drafter, head):
    """A new drafter with `drafter`'s weights (not its draft vocabulary), bound to `head`."""
    raw = dict(drafter.config.raw)
    raw["dflash_config"] = {
        k: v for k, v in raw["dflash_config"].items() if k != "draft_vocab_size"
    }
    new = build_drafter(DraftConfig.from_dict(raw))
    new.load_weights([(k, v) for k, v in tree_flatten(drafter.parameters()) if k != "draft_vocab"])
    new.bind(head)
    mx.eval(new.parameters())  # materialised: used on worker threads
    return new


def subset_copy(drafter, head, ids: list[int]):
    """A new drafter with `drafter`'s weights, bound to `head`, drafting over `ids`."""
    new = copy_drafter(drafter, head)
    new.set_draft_vocab(mx.array([int(i) for i in ids], dtype=mx.int32))
    mx.eval(new.parameters())
    return new
