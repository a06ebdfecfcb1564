"""The draft vocabulary of a training run (docs/training.md, "Draft vocabulary"): the target
ids the training answers use most (`dflash_mac/draft_vocab.py` ranks them).

Each response token counts once, and where the target's soft labels are at hand (the feature
store) its distribution at T 1 adds its mass (top-k ids): tokens the target finds likely but
did not pick rank too, which a count of ~10⁵ answer tokens alone would leave at zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_mac.draft_vocab import add_mass, answer_counts

from .data import Sequence


def token_counts(seqs: list[Sequence], vocab: int, store: Any | None = None) -> np.ndarray:
    """Counts ``[V]`` of the response tokens, plus p_T=1 of every response position from
    `store`'s top-k soft labels when it has them (`features.StoreSet`)."""
    counts = answer_counts((s.response for s in seqs), vocab)
    if store is None:
        return counts
    for i, s in enumerate(seqs):
        # rows whose next token is a response token (the store keeps up to its length cap)
        lo, hi = len(s.prompt) - 1, len(s.ids) - 1
        mass = store.soft_mass(i, lo, hi) if hi > lo else None
        if mass is not None:
            add_mass(counts, *mass)
    return counts
