"""The DFlash decode cycle (docs/design.md §6) as a streaming generator of events."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .autoblock import BlockController
from .capture import FeatureCapture, queues_layers
from .distributed import leader as mirror
from .models.penalties import Penalties, PenaltyContext, draft_sequential
from .pair import Pair
from .policy import AUTO, auto_controller, remember_acceptance
from .rollback import TargetRollback, trim_caches
from .sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    probabilities,
    sample,
    sample_logits,
)
from .stats import DecodeStats
from .textstream import TextStream


@dataclass
class GenerationConfig:
    """Per-request settings."""

    max_tokens: int = 256
    block_size: int | str | None = None  # None or "auto": the controller; N: exactly N
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_eos: bool = True
    prefill_step_size: int = 2048
    pipeline: bool = True  # queue the next drafter pass before the host bookkeeping
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


class DraftContext:
    """Committed target features on their way into the drafter's context cache. Drafting
    cycles append them with the next drafter pass; plain steps (block 1) leave them waiting, so
    a run of plain steps costs no drafter work, and drafting resumes with one batched append."""

    FLUSH_AT = 256  # waiting positions appended (and evaluated) at the latest

    def __init__(self, drafter, cache: list):
        self.drafter, self.cache = drafter, cache
        self.pending: list[mx.array] = []
        self.waiting = 0

    def add(self, features: mx.array) -> None:
        self.pending.append(features)
        self.waiting += features.shape[1]
        if self.waiting >= self.FLUSH_AT:
            self.flush()
            mx.async_eval([c.state for c in self.cache])

    def flush(self) -> int:
        """Append what waits to the cache (lazily); returns how many positions."""
        n, feats = self.waiting, self.pending
        if feats:
            self.drafter.extend_context(mx.concatenate(feats, axis=1), self.cache)
            self.pending, self.waiting = [], 0
        return n


@dataclass
class Cycle:
    """One cycle: its block, drafts and, once queued, the verify verdict (lazy arrays
    evaluated in the background with `mx.async_eval`)."""

    bs: int
    block: mx.array
    drafts: mx.array
    q: mx.array | None
    key: mx.array
    appended: int  # context positions the drafter pass appended first
    penalty: PenaltyContext | None = None  # penalties given the committed prefix
    verdict: tuple[mx.array, mx.array] | None = None  # (accepted drafts, bonus token)
    # [accepted, bonus, drafts...]: what the host reads, computed with the queued work (a
    # new op at read time would wait behind whatever was queued after this cycle)
    outcome: mx.array | None = None


def queue_cycle(
    pair: Pair,
    state: DecodeState,
    ctx: DraftContext,
    bs: int,
    anchor: int | mx.array,
    sp: SamplingParams,
    key: mx.array,
    pen: Penalties | None = None,
):
    """Start a cycle: the drafter pass for `[anchor, MASK...]` (none at block 1) and, unless
    the target is a hybrid (whose rollback must watch its verify), the verify pass behind it,
    all queued on the device while the host works. Needs the previous cycle rolled back.
    The anchor may still be lazy (the token of a plain step not yet read back)."""
    first = mx.array(anchor).astype(mx.int32).reshape(1)
    penalty = pen.bind(state.ids[-pen.context_size :] + [anchor]) if pen else None
    if bs == 1:  # a plain target step: no drafts, no split of the key
        c = Cycle(1, first, mx.zeros((0,), mx.int32), None, key, 0, penalty)
    else:
        k_draft, k_verify = mx.random.split(key)
        masks = mx.array([pair.drafter.config.mask_token_id] * (bs - 1), mx.int32)
        block = mx.concatenate([first, masks])
        appended = ctx.flush()
        drafts, q = propose(pair, block, ctx.cache, sp, k_draft, penalty)
        c = Cycle(bs, block, drafts, q, k_verify, appended, penalty)
    if state.rollback.hybrid:  # its verify is queued once the last rollback is done
        mx.async_eval(c.drafts)
    else:
        if bs > 1 and queues_layers():  # the drafter runs while the verify is built
            mx.async_eval(c.drafts)
        queue_verify(pair, state, c, sp)
    return c


def queue_verify(pair: Pair, state: DecodeState, c: Cycle, sp: SamplingParams) -> None:
    """Queue the cycle's verify pass and its outcome (`mx.async_eval`)."""
    c.verdict = acc, bonus = verify(pair, state, c, sp)
    c.outcome = mx.concatenate([acc.reshape(1), bonus.reshape(1), c.drafts])
    mx.async_eval(c.outcome)


def verify(pair: Pair, state: DecodeState, c: Cycle, sp: SamplingParams):
    """One target pass over [anchor, drafts]; (accepted drafts, bonus token), lazily."""
    state.rollback.before_verify()
    tokens = c.block if c.bs == 1 else mx.concatenate([c.block[:1], c.drafts])
    logits = pair.target(tokens[None], cache=state.target_cache)
    logits = logits[0]  # [bs, V]
    if c.penalty is not None:  # p gets the same penalties as q, position by position
        logits = c.penalty.apply(logits, c.drafts)
    if sp.greedy:
        return accept_greedy(c.drafts, logits)
    if c.bs == 1:
        return mx.array(0), sample_logits(logits, sp, c.key)
    return accept_sampled(c.drafts, c.q, probabilities(logits, sp), c.key)


@contextmanager
def closing(target, done: Callable):
    """Call `done(target)` however the block ends (an error, a stream closed early)."""
    try:
        yield
    finally:
        done(target)


def speculative_stream(
    pair: Pair,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    state: DecodeState | None = None,
    should_stop: Callable[[], bool] | None = None,
    controller: BlockController | None = None,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash: draft a block, verify it in one target pass, commit, roll back.

    Block sizes: a fixed `cfg.block_size` runs every cycle at that size; None or "auto" asks
    the controller (`policy.auto_controller`, or `controller`) each cycle, up to the pair's."""
    state = state or DecodeState(pair)
    auto = controller is not None or cfg.block_size in (None, AUTO)
    bs_max = pair.block_size if auto else cfg.block_size
    sp = cfg.sampling
    seeded = cfg.seed is not None and not sp.greedy  # same seed, same text: timing-free sizes
    setting = (sp.temperature, sp.top_p, sp.top_k, sp.min_p)
    plan = controller or (
        auto_controller(pair, bs_max, not seeded, setting, len(prompt_ids), not sp.greedy)
        if auto
        else None
    )
    rng = random.Random(cfg.seed)  # each cycle's key from the host: no device work for it
    stats = DecodeStats(
        bs_max,
        prompt_tokens=len(prompt_ids),
        cached_tokens=len(state.ids),
        auto=auto,
        **mirror.facts(pair.target),
    )
    out = TextStream(pair.tokenizer, cfg.stop, pair.eos_ids if cfg.use_eos else set())
    ctx = DraftContext(pair.drafter, state.draft_cache)
    pen = cfg.penalties

    queue_time = 0.0  # spent queueing device work (blocks where MLX throttles, as on CPU)

    def next_size(room: int) -> int:
        return max(1, min(plan.choose().size if plan else bs_max, room))

    def start(bs: int, anchor: int | mx.array) -> Cycle:
        nonlocal queue_time
        t = time.perf_counter()
        key = mx.random.key(rng.getrandbits(32))
        c = queue_cycle(pair, state, ctx, bs, anchor, sp, key, pen)
        queue_time += time.perf_counter() - t
        return c

    def settle(c: Cycle, kept: list[int]) -> None:
        """Roll back a cycle's rejected positions; its kept features go to the drafter."""
        state.rollback.rollback(c.bs - len(kept), len(kept) - 1)
        ctx.add(cap.features()[:, : len(kept)])
        state.ids += kept

    lookahead = cfg.pipeline and pen is None  # penalties need the committed ids on the host

    with (
        FeatureCapture(pair.target, pair.layer_ids, queue=queues_layers()) as cap,
        state.rollback.hooks(),
        mx.stream(generation_stream),
        closing(pair.target, mirror.idle),
    ):
        t0 = time.perf_counter()
        logits = prefill(pair, state, prompt_ids, cap, cfg.prefill_step_size)
        if pen:
            logits = pen.bind(prompt_ids).apply(logits[None], mx.zeros((0,), mx.int32))[0]
        if sp.greedy:
            anchor = mx.argmax(logits).item()
        else:
            anchor = sample_logits(logits, sp, mx.random.key(rng.getrandbits(32))).item()
        t_decode = t_sync = time.perf_counter()
        stats = replace(
            stats,
            prefill_time=t_decode - t0,
            generation_tokens=1,
            peak_memory_bytes=mx.get_peak_memory(),
        )
        text = out.push([anchor], cfg.max_tokens)
        yield GenerationEvent(text, out.tokens[:], 0, stats, out.finish_reason)

        cycle = None  # the next cycle, queued right after the previous sync
        while out.finish_reason is None and not (should_stop and should_stop()):
            c = cycle or start(next_size(cfg.max_tokens - out.count), anchor)
            if c.verdict is None:  # a hybrid's verify: queued once the last rollback is done
                queue_verify(pair, state, c, sp)
            bonus = c.verdict[1]
            # A plain step keeps its one position whatever it samples: settle it and, when the
            # next cycle is a plain step too, queue it on the still-lazy token before the sync
            # (as mlx-lm's generate_step). A drafting cycle waits for the sync: queued ahead it
            # would run inside this step's interval, and both would be timed wrong.
            ahead = lookahead and c.bs == 1 and cfg.max_tokens - out.count > 1
            if ahead:
                settle(c, [anchor])
                bs_next = next_size(cfg.max_tokens - out.count - 1)
                cycle = start(1, bonus) if bs_next == 1 else None
            t_host = time.perf_counter()
            a, bonus, *drafted = c.outcome.tolist()
            committed = drafted[:a] + [bonus]  # the one host sync of the cycle, above
            t_now = time.perf_counter()
            host, seconds, t_sync = t_host - t_sync - queue_time, t_now - t_sync, t_now
            queue_time = 0.0
            if not ahead:
                settle(c, [anchor] + committed[:-1])
            anchor = committed[-1]
            if plan:
                # the cost model learns from cycles amid their kind: a plain step between plain
                # steps (in a pipelined run each interval is one step; the last one before a
                # drafting cycle builds nothing ahead, so its interval comes out short), a
                # drafting cycle after a drafting one (the first after plain steps also appends
                # their context and restarts the pipeline, a one-off that would make drafting
                # look dearer than it is once resumed)
                after_own_kind = bool(stats.block_sizes) and (c.bs > 1) == (
                    stats.block_sizes[-1] > 1
                )
                steady = after_own_kind and not (ahead and cycle is None)
                plan.update(c.bs, a, seconds, steady)
            room = cfg.max_tokens - out.count - len(committed)
            if not ahead:
                cycle = start(next_size(room), anchor) if cfg.pipeline and room > 0 else None
            elif cycle is None:  # a drafting cycle after a plain step
                cycle = start(bs_next, anchor)
            before = out.count
            text = out.push(committed, cfg.max_tokens)
            stats = replace(
                stats,
                acceptance_lengths=(*stats.acceptance_lengths, a + 1),
                block_sizes=(*stats.block_sizes, c.bs),
                block_reason=plan.last.reason if plan else "",
                host_time=stats.host_time + host,
                draft_context=getattr(ctx.cache[0], "rows", 0) if ctx.cache else 0,
                generation_tokens=out.count,
                decode_time=time.perf_counter() - t_decode,
                peak_memory_bytes=mx.get_peak_memory(),
            )
            yield GenerationEvent(text, out.tokens[before:], a + 1, stats, out.finish_reason)

        if cycle is not None and cycle.verdict is not None:  # queued, never used
            state.rollback.trim(cycle.bs)
        if out.finish_reason is None:
            out.finish_reason = "cancelled"
            yield GenerationEvent(out.flush(), [], 0, stats, "cancelled")
        ctx.flush()
        if plan is not None and controller is None:
            remember_acceptance(pair, plan)  # the next process starts from what this one saw
    # Caches hold exactly a prefix of prompt + kept output (the last token may be pending).
    state.trim_to(len(prompt_ids) + out.count)
    mx.eval([c.state for c in state.target_cache + state.draft_cache if not c.empty()])
    mirror.settle(pair.target, state.target_cache)  # a distributed target: every rank's cache alike
