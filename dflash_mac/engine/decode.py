"""The DFlash decode loop (docs/design.md §6) as a streaming generator of events: a request's
prefill and first token, then its row's `cycles` (which the batch engine also runs for a lone
row); how a cycle runs (queued ahead, timed) is `cycle.CyclePipeline`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..pair import Mirror, Pair
from ..sizing.choice import BlockChoice, block_size_for
from ..sizing.controller import tree_arms
from ..sizing.sizer import BlockSizer
from ..sizing.tuning import AutoTuning
from ..target.capture import FeatureCapture, queues_layers
from .config import GenerationConfig, GenerationEvent
from .cycle import CyclePipeline, Outcome, Sizes, trees_allowed
from .drafts import Cycle
from .row import Row, event, open_row, prefill_chunks, remember, start
from .state import DecodeState
from .stats import StatsRecorder


def prefill(pair: Pair, state: DecodeState, ids: list[int], cap: FeatureCapture, step: int):
    """Run the target on the uncached suffix of `ids` in chunks (as mlx-lm does: all but the last
    token in chunks, then the last token alone); feed every position's features to the drafter.
    Returns the last position's logits [V]."""
    pos, record = len(state.ids), state.record
    chunks = prefill_chunks(ids, pos, step, record)
    for k, chunk in enumerate(chunks):
        logits = pair.target(mx.array(chunk)[None], cache=state.target_cache)
        pair.drafter.extend_context(cap.features(), state.draft_cache)
        # only the last chunk's logits are read: the others' LM head never runs (~20 % of a
        # chunk's work at this vocabulary)
        last = [logits] if k == len(chunks) - 1 else []
        mx.eval([c.state for c in state.target_cache], *last)
        pos += len(chunk)
        if record:  # the prompt cache keeps these rows (the drafter's before its window drops them)
            record.chunk(ids[:pos], state.target_cache, state.draft_cache)
    state.ids = list(ids)
    return logits[0, -1]


def sizes_for(
    pair: Pair,
    cfg: GenerationConfig,
    block: BlockChoice,
    state: DecodeState,
    prompt: int,
    tuning: AutoTuning | None,
    controller: BlockSizer | None,
) -> Sizes:
    """How a request's cycles are sized: `controller`, else with `auto` one of `tuning`'s (a
    seeded sampled request: one on the prior alone, so its sizes and with them its draws
    depend only on the seed and the text), else the fixed block; trees where allowed."""
    sp = cfg.sampling
    seeded = cfg.seed is not None and not sp.greedy  # same seed, same text: timing-free sizes
    setting = (sp.temperature, sp.top_p, sp.top_k, sp.min_p)
    treeable = trees_allowed(pair, state.target_cache, cfg.penalties, cfg.grammar, cfg.logprobs)
    trees, chains = tree_arms(cfg.tree if treeable else 0)
    plan = controller or (
        (tuning or AutoTuning()).controller(
            block.size, setting, prompt, not sp.greedy, not seeded, trees, chains
        )
        if block.auto
        else None
    )
    return Sizes(block.size, plan, trees, chains)


def record(rec: StatsRecorder, c: Cycle, r: Outcome, reason: str, rows: int) -> None:
    """A cycle's statistics: its size, tokens, host time, the controller's reason, the
    drafter's context rows, and whether a copy (or its grafted branch) won it."""
    copied = c.copied or r.accepted > r.drafted  # a grafted copy's branch won
    width = c.drafts.shape[0] + 1  # a tree's or a graft's nodes, anchor in
    rec.cycle(
        c.bs, r.accepted + 1, r.host, reason, rows, copied, c.budget, width, copied and c.suffixed
    )


@contextmanager
def request_end(mirror: Mirror | None):
    """Tell a distributed target's mirror that the request ended, however it ended."""
    try:
        yield
    finally:
        if mirror is not None:
            mirror.idle()


def capture(pair: Pair) -> FeatureCapture:
    """The target's features a request's passes capture (a distributed target's pipeline
    stages gather them)."""
    gathered = pair.mirror.features if pair.mirror is not None else None
    return FeatureCapture(pair.target, pair.layer_ids, queue=queues_layers(), features=gathered)


def speculative_stream(
    pair: Pair,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    state: DecodeState | None = None,
    should_stop: Callable[[], bool] | None = None,
    tuning: AutoTuning | None = None,
    controller: BlockSizer | None = None,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash: prefill the prompt, take the first token, then run `cycles`.

    `cfg.block` fixes each cycle's size, or with `auto` caps what the controller picks each
    cycle (`controller`, else one of `tuning`: what `auto` learnt, continued across requests;
    a request that copies also asks it how long a copy runs: `sizing.sizer.CopySizer`)."""
    state = state or DecodeState(pair)
    block, mirror = cfg.block or block_size_for(pair, None), pair.mirror
    sizes = sizes_for(pair, cfg, block, state, len(prompt_ids), tuning, controller)
    memory = tuning.answers if tuning is not None else None  # earlier answers (suffix drafting)
    facts = mirror.facts() if mirror is not None else {}
    rates = sizes.plan.copy_rates if sizes.plan else None  # what the controller's copies got
    row = open_row(pair, prompt_ids, cfg, state, block.size, block.auto, facts, rates)
    with request_end(mirror):
        with capture(pair) as cap, mx.stream(generation_stream):
            logits = prefill(pair, state, prompt_ids, cap, cfg.prefill_step_size)
            text, lps = start(row, logits, memory)
        yield event(row, text, 0, 0, lps, generated=1)
        yield from cycles(pair, row, sizes, should_stop)
    remember(row, memory)  # later requests may draft from its answer
    # Caches hold exactly a prefix of prompt + kept output (the last token may be pending).
    state.trim_to(len(prompt_ids) + row.out.count)
    mx.eval([c.state for c in state.target_cache + state.draft_cache if not c.empty()])
    if mirror is not None:  # a distributed target: every rank's cache alike
        mirror.settle(state.target_cache)


def cycles(
    pair: Pair, row: Row, sizes: Sizes, should_stop: Callable[[], bool] | None = None
) -> Iterator[GenerationEvent]:
    """A prefilled row's cycles: draft a block, verify it in one target pass, accept the
    longest agreeing prefix, commit it, roll the rest back, yield what was committed; until the
    row ends, or `should_stop()` says so (a last "cancelled" event). Closed at an event (the
    batch engine taking a lone row back), it ends at that cycle boundary, the row's caches
    holding prompt + every committed token but the anchor."""
    out, cfg, plan = row.out, row.cfg, sizes.plan
    stopped = should_stop or (lambda: False)
    with capture(pair) as cap, row.state.rollback.hooks(), mx.stream(generation_stream):
        pipe = CyclePipeline(pair, row, cap, sizes)
        try:
            while out.finish_reason is None and not stopped():
                room = cfg.max_tokens - out.count
                c = pipe.cycle(row.anchor, room)  # draft, and the verify queued behind it
                r = pipe.finish(c, row.anchor, room)  # accept: the one host sync; roll back
                row.anchor = r.committed[-1]  # the bonus token: the next cycle's anchor
                if plan and c.copied:  # copies say nothing about the drafter's blocks
                    if r.steady:
                        plan.copied(c.width, r.seconds)
                elif plan:
                    timed = r.seconds if not c.copy else None  # a graft's nodes: a dearer tree
                    plan.update(
                        c.bs, r.drafted, timed, r.steady, c.budget, r.chain, r.odds, r.reach
                    )
                pipe.ahead(row.anchor, room - len(r.committed))  # queued before the bookkeeping
                before = out.count
                text = out.push(r.committed, cfg.max_tokens)
                record(row.rec, c, r, plan.last.reason if plan else "", row.ctx.rows)
                yield event(row, text, before, r.accepted + 1, r.logprobs)
        finally:  # a cycle queued ahead and never used is dropped
            pipe.close()
        if out.finish_reason is None:
            out.finish_reason = "cancelled"
            yield event(row, out.flush(), out.count, 0)
