"""Frequency-ranked draft vocabularies (FR-Spec; EAGLE-3's ``d2t``): which target ids a drafter
drafts over, counted on the target's own answers, and cutting a loaded drafter's head to them.

A drafter trained with one (`dflash-mac train --draft-vocab K`) carries its ids, most frequent
first, so `--draft-vocab K'` with K' below its own keeps the first K'. A drafter without one
(every published z-lab checkpoint) is cut to the K ids its target's answers to the shipped
starter prompts use most: those answers are generated once (plain greedy decoding), the
target's distribution over its top-k at every answer position adds its mass, and the ranking is
saved in the data directory per target. Verification keeps the whole vocabulary, so output is
unchanged; only the drafter's head shrinks (docs/training.md, "Draft vocabulary").
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .answers import regenerate
from .errors import UserError
from .host import data_dir
from .pair import Pair
from .prompts import STARTER_PROMPTS
from .settings import MIN_DRAFT_VOCAB
from .sizing.files import slug, target_key

TOP_K = 32  # the target's top ids whose probability mass counts at each answer position
MAX_TOKENS = 96  # per starter answer


class DraftVocabError(UserError, ValueError):
    """A draft vocabulary that cannot be used; the message is one sentence for the user."""


def answer_counts(answers: Iterable[Iterable[int]], vocab: int) -> np.ndarray:
    """Counts ``[V]`` (float) of the answers' tokens."""
    counts = np.zeros(vocab, dtype=np.float64)
    for a in answers:
        np.add.at(counts, np.asarray(list(a), dtype=np.int64) % vocab, 1.0)
    return counts


def add_mass(counts: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
    """Add the target's probabilities ``probs`` of ``ids`` (any shape) to the counts."""
    np.add.at(counts, np.asarray(ids).reshape(-1), np.asarray(probs, np.float64).reshape(-1))


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


def ranking_path(pair: Pair) -> Path:
    """<data dir>/draft-vocab/<target>.npy: the target's ids by frequency in its answers."""
    return data_dir() / "draft-vocab" / f"{slug(target_key(pair.model_id))}.npy"


def target_counts(
    pair: Pair, prompts: Path = STARTER_PROMPTS, max_tokens: int = MAX_TOKENS
) -> np.ndarray:
    """Counts of the target's greedy answers to `prompts` plus its top-k mass at T 1 at every
    answer position (one forward over each prompt + answer)."""
    from .api import prompt_ids
    from .prompts import read_prompt_file

    tok, vocab = pair.tokenizer, pair.drafter.config.vocab_size
    asks = [prompt_ids(tok, r.prompt) for r in read_prompt_file(prompts)]
    answers = regenerate(pair.target, tok, asks, max_tokens, batch_size=16)
    counts = answer_counts(answers, vocab)
    for ask, answer in zip(asks, answers):
        if not answer:
            continue
        logits = pair.target(mx.array([ask + answer[:-1]]))[0, len(ask) - 1 :]
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ids = mx.argpartition(-lp, kth=TOP_K - 1, axis=-1)[:, :TOP_K]
        probs = mx.exp(mx.take_along_axis(lp, ids, axis=-1))
        add_mass(counts, np.array(ids), np.array(probs))
    return counts


def target_ranking(pair: Pair) -> tuple[np.ndarray, str | None]:
    """The target's ids by frequency in its answers (saved once per target); also a sentence
    when it was counted now (it takes a minute or two)."""
    path = ranking_path(pair)
    try:
        return np.load(path), None
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    counts = target_counts(pair)
    ranked = rank(counts, control_ids(pair.tokenizer), len(counts))
    seconds = time.perf_counter() - t0
    said = f"counted the target's token frequencies on its starter answers ({seconds:.0f} s)"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, ranked)
        said += f", saved to {path}"
    except OSError as e:
        said += f"; not saved ({e.strerror or e})"
    return ranked, said


def apply_draft_vocab(pair: Pair, k: int) -> str:
    """Cut the pair's drafter to `k` ids; returns the sentence that says what was done."""
    d = pair.drafter
    vocab = d.config.vocab_size
    if not MIN_DRAFT_VOCAB <= k <= vocab:
        raise DraftVocabError(
            f"--draft-vocab must be between {MIN_DRAFT_VOCAB} and {vocab} (got {k})."
        )
    own = d.get("draft_vocab") if hasattr(d, "get") else None
    if own is not None:
        if k > own.shape[0]:
            raise DraftVocabError(
                f"--draft-vocab {k} is more than the {own.shape[0]} ids this drafter was "
                "trained to draft over."
            )
        d.set_draft_vocab(own[:k])
        return f"drafting over the first {k:,} of the drafter's own {own.shape[0]:,} ids"
    ranked, counted = target_ranking(pair)
    d.set_draft_vocab(mx.array(first_of(ranked, control_ids(pair.tokenizer), k)))
    mx.eval(d.parameters())
    said = f"drafting over the {k:,} ids of {vocab:,} its target's answers use most"
    return f"{counted}; {said}" if counted else said


def first_of(ranked: np.ndarray, always: list[int], k: int) -> np.ndarray:
    """The first `k` ids of a ranking, `always` forced in (in place of its last ones)."""
    scores = np.zeros(int(ranked.max()) + 1)
    scores[ranked] = np.arange(len(ranked), 0, -1)  # earlier in the ranking: higher
    return rank(scores, always, k)


__all__ = ["apply_draft_vocab", "rank", "coverage", "control_ids", "answer_counts", "add_mass"]
