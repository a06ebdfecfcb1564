"""A request's settings checked before anything slow: the one place their bounds live.

Light on purpose (no mlx-lm, no model code): the command line refuses a bad `--seed` or
`--top-p` in the time Python starts, not after the 2-3 s of imports a load needs;
`api.make_config` applies the same checks to every request of every front end."""

from __future__ import annotations

from .errors import PromptError
from .models.distribution import SamplingParams
from .models.penalties import Penalties

AUTO = "auto"
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_TREE_BUDGET = 64  # `--tree-budget` at most (a verify of 65 tokens)


def parse_block_size(value: int | str | None) -> int | None:
    """A --block-size value: an integer >= 1, or None for `auto` (None or "auto")."""
    if value is None or value == AUTO:
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise PromptError(f"--block-size must be auto or an integer (got {value!r}).")
    if size < 1:
        raise PromptError(f"--block-size must be at least 1 (got {size}).")
    return size


MIN_DRAFT_VOCAB = 16  # below this a drafter's top-k candidates would not fit


def check_draft_vocab(k: int | None) -> int | None:
    """`--draft-vocab K`: at least `MIN_DRAFT_VOCAB` (the upper bound, the vocabulary, is
    checked once the pair is loaded)."""
    if k is not None and k < MIN_DRAFT_VOCAB:
        raise PromptError(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB} (got {k}).")
    return k


def check_request(
    max_tokens: int = 256,
    block_size: int | str | None = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    tree: int | None = None,
) -> tuple[SamplingParams, Penalties | None]:
    """The request's sampling and penalties, or PromptError with one sentence."""
    if max_tokens < 1:
        raise PromptError(f"--max-tokens must be at least 1 (got {max_tokens}).")
    parse_block_size(block_size)  # resolved against the pair later (`sizing.choice.block_size_for`)
    if seed is not None and not 0 <= seed < 2**64:
        raise PromptError(f"--seed must be between 0 and 2**64 - 1 (got {seed}).")
    if tree is not None and not 0 <= tree <= MAX_TREE_BUDGET:
        raise PromptError(f"--tree-budget must be between 0 and {MAX_TREE_BUDGET} (got {tree}).")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise PromptError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS} (got {logprobs}).")
    try:
        sp = SamplingParams(temp, top_p, top_k, min_p).validate()
        pen = Penalties.make(presence_penalty, frequency_penalty, repetition_penalty, logit_bias)
    except ValueError as e:
        raise PromptError(str(e))
    return sp, pen
