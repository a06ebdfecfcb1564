"""The DFlash decode cycle (docs/design.md §6) as a streaming generator of events."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .capture import FeatureCapture
from .models.penalties import Penalties, PenaltyContext, draft_sequential
from .pair import Pair
from .rollback import TargetRollback, trim_caches
from .sampling import SamplingParams, accept_greedy, accept_sampled, probabilities, sample
from .stats import DecodeStats
from .textstream import TextStream


@dataclass
class GenerationConfig:
    """Per-request settings."""

    max_tokens: int = 256
    block_size: int | None = None  # None: the pair's default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_eos: bool = True
    prefill_step_size: int = 2048
    penalties: Penalties | None = None  # None: no penalties, no cost


@dataclass
class GenerationEvent:
    """What one step of the stream committed."""

    text: str
    tokens: list[int]
    accepted: int  # tokens committed by this cycle incl. the bonus (0 for the prefill token)
    stats: DecodeStats
    finish_reason: str | None = None


class DecodeState:
    """Target cache, drafter context cache and the ids they hold (kept by sessions)."""

    def __init__(self, pair: Pair):
        self.target_cache = make_prompt_cache(pair.target)
        self.rollback = TargetRollback(pair.target, self.target_cache)
        self.draft_cache = pair.drafter.make_cache()
        self.ids: list[int] = []

    def trim_to(self, n: int) -> None:
        """Keep the first `n` cached positions in both caches."""
        extra = len(self.ids) - n
        if extra > 0:
            self.rollback.trim(extra)  # hybrids: only within the last verify, else RollbackError
            trim_caches(self.draft_cache, extra)
            self.ids = self.ids[:n]


def prefill(pair: Pair, state: DecodeState, ids: list[int], cap: FeatureCapture, step: int):
    """Run the target on the uncached suffix of `ids` in chunks (as mlx-lm does: all but the last
    token in chunks, then the last token alone); feed every position's features to the drafter.
    Returns the last position's logits [V]."""
    new = ids[len(state.ids) :]
    assert new, "prefill needs at least one new token"
    head = new[:-1]
    chunks = [head[i : i + step] for i in range(0, len(head), step)] + [new[-1:]]
    for chunk in chunks:
        logits = pair.target(mx.array(chunk)[None], cache=state.target_cache)
        pair.drafter.extend_context(cap.features(), state.draft_cache)
        mx.eval([c.state for c in state.target_cache], logits)
    state.ids = list(ids)
    return logits[0, -1]


def propose(
    pair: Pair,
    block: mx.array,
    cache: list,
    sp: SamplingParams,
    key: mx.array,
    penalty: PenaltyContext | None = None,
):
    """Draft tokens for block positions 1..bs-1 and q (None when greedy), lazily.

    A drafter with its own `propose` (DFlash 2: the selector walk) drafts itself. With
    penalties each position is drawn from its penalised q given the drafts before it."""
    if (own := getattr(pair.drafter, "propose", None)) is not None:
        return own(block, cache, sp, key, penalty) if penalty else own(block, cache, sp, key)
    logits = pair.drafter(block[None], cache)[0]  # [bs-1, V]
    if penalty is not None:
        return draft_sequential(logits, penalty, sp, key)
    if sp.greedy:
        return mx.argmax(logits, axis=-1), None
    q = probabilities(logits, sp)
    return sample(q, key=key), q


def speculative_stream(
    pair: Pair,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    state: DecodeState | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash: draft a block, verify it in one target pass, commit, roll back."""
    state = state or DecodeState(pair)
    bs_max = cfg.block_size or pair.block_size
    sp = cfg.sampling
    key = mx.random.key(cfg.seed if cfg.seed is not None else random.getrandbits(32))
    stats = DecodeStats(bs_max, prompt_tokens=len(prompt_ids), cached_tokens=len(state.ids))
    out = TextStream(pair.tokenizer, cfg.stop, pair.eos_ids if cfg.use_eos else set())
    mask_id = pair.drafter.config.mask_token_id
    pen, ctx = cfg.penalties, None

    rb = state.rollback
    with (
        FeatureCapture(pair.target, pair.layer_ids) as cap,
        rb.hooks(),
        mx.stream(generation_stream),
    ):
        t0 = time.perf_counter()
        logits = prefill(pair, state, prompt_ids, cap, cfg.prefill_step_size)
        if pen:
            logits = pen.bind(prompt_ids).apply(logits[None], mx.zeros((0,), mx.int32))[0]
        if sp.greedy:
            anchor = mx.argmax(logits).item()
        else:
            key, sub = mx.random.split(key)
            anchor = sample(probabilities(logits, sp), key=sub).item()
        t_decode = time.perf_counter()
        stats = replace(
            stats,
            prefill_time=t_decode - t0,
            generation_tokens=1,
            peak_memory_bytes=mx.get_peak_memory(),
        )
        text = out.push([anchor], cfg.max_tokens)
        yield GenerationEvent(text, out.tokens[:], 0, stats, out.finish_reason)

        while out.finish_reason is None and not (should_stop and should_stop()):
            bs = min(bs_max, cfg.max_tokens - out.count)
            key, k_draft, k_verify = mx.random.split(key, 3)
            block = mx.array([anchor] + [mask_id] * (bs - 1))
            if pen:
                ctx = pen.bind(state.ids[-pen.context_size :] + [anchor])
            if bs > 1:
                drafts, q = propose(pair, block, state.draft_cache, sp, k_draft, ctx)
            else:  # one token left: a plain target step
                drafts, q = mx.zeros((0,), mx.int32), mx.zeros((0, 1))
            rb.before_verify()
            logits = pair.target(
                mx.concatenate([block[:1], drafts])[None], cache=state.target_cache
            )[0]  # [bs, V]
            if ctx is not None:
                logits = ctx.apply(logits, drafts)
            if sp.greedy:
                acc, bonus = accept_greedy(drafts, logits)
            else:
                acc, bonus = accept_sampled(drafts, q, probabilities(logits, sp), k_verify)
            a, bonus, *drafted = mx.concatenate([acc[None], bonus.reshape(1), drafts]).tolist()
            committed = drafted[:a] + [bonus]  # the one host sync of the cycle, above
            rb.rollback(bs - a - 1, a)
            pair.drafter.extend_context(cap.features()[:, : a + 1], state.draft_cache)
            state.ids += [anchor] + committed[:-1]
            anchor = committed[-1]
            before = out.count
            text = out.push(committed, cfg.max_tokens)
            stats = replace(
                stats,
                acceptance_lengths=(*stats.acceptance_lengths, a + 1),
                generation_tokens=out.count,
                decode_time=time.perf_counter() - t_decode,
                peak_memory_bytes=mx.get_peak_memory(),
            )
            yield GenerationEvent(text, out.tokens[before:], a + 1, stats, out.finish_reason)

        if out.finish_reason is None:
            out.finish_reason = "cancelled"
            yield GenerationEvent(out.flush(), [], 0, stats, "cancelled")
    # Caches hold exactly a prefix of prompt + kept output (the last token may be pending).
    state.trim_to(len(prompt_ids) + out.count)
    mx.eval([c.state for c in state.target_cache + state.draft_cache if not c.empty()])
