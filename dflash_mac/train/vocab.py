"""A frequency-ranked draft vocabulary (FR-Spec; EAGLE-3's ``d2t``): the target ids a drafter
drafts over, counted on the target's own answers (docs/training.md, "Draft vocabulary").

Each response token counts once, and where the target's soft labels are at hand its
distribution at T 1 adds its mass (top-k ids): tokens the target finds likely but did not pick
rank too, which a count of ~10⁵ answer tokens alone would leave at zero. EOS and the chat
template's control tokens are always in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .data import Sequence


def token_counts(seqs: list[Sequence], vocab: int, store: Any | None = None) -> np.ndarray:
    """Counts ``[V]`` (float) of the response tokens, plus p_T=1 of every response position
    from `store`'s top-k soft labels when it has them (`features.FeatureStore`)."""
    counts = np.zeros(vocab, dtype=np.float64)
    for s in seqs:
        np.add.at(counts, np.asarray(s.response, dtype=np.int64) % vocab, 1.0)
    if store is None:
        return counts
    for i, s in enumerate(seqs):
        # rows whose next token is a response token (the store keeps up to its length cap)
        lo, hi = len(s.prompt) - 1, len(s.ids) - 1
        mass = store.soft_mass(i, lo, hi) if hi > lo else None
        if mass is not None:
            np.add.at(counts, mass[0].reshape(-1), mass[1].reshape(-1))
    return counts


def control_ids(tokenizer: Any) -> list[int]:
    """EOS and the tokenizer's special (chat-control) tokens."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    ids.update(getattr(inner, "all_special_ids", None) or [])
    return sorted(int(i) for i in ids)


def rank(counts: np.ndarray, always: Iterable[int], k: int) -> np.ndarray:
    """The `k` most counted ids (ties by id), `always` forced in, most counted first."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count, then by id
    forced = [i for i in dict.fromkeys(int(a) for a in always) if 0 <= i < len(counts)]
    if len(forced) > k:
        raise ValueError(f"a draft vocabulary of {k} ids cannot hold the {len(forced)} forced.")
    rest = order[~np.isin(order, forced)][: k - len(forced)]
    chosen = np.concatenate([rest, np.array(forced, dtype=order.dtype)])
    return chosen[np.lexsort((chosen, -counts[chosen]))].astype(np.int32)


def coverage(vocab: np.ndarray, tokens: Iterable[int]) -> float:
    """Share of `tokens` inside the draft vocabulary."""
    toks = np.asarray(list(tokens), dtype=np.int64)
    return float(np.isin(toks, vocab).mean()) if toks.size else 1.0
