"""The DFlash decode loop (docs/design.md §6) as a streaming generator of events; how a cycle
runs (queued ahead, timed) is `cycle.CyclePipeline`."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..models.penalties import Penalties
from ..pair import Mirror, Pair
from ..sizing.choice import BlockChoice, block_size_for
from ..sizing.controller import tree_arms
from ..sizing.sizer import BlockSizer
from ..sizing.tuning import AutoTuning
from ..target.capture import FeatureCapture, queues_layers
from ..target.kvwindow import bound_context, target_cache
from ..target.rollback import TargetRollback, trim_caches
from .constraints import Constraint, Grammar
from .cycle import CyclePipeline, Outcome, Sizes, trees_allowed
from .drafts import Cycle
from .row import open_output, prefill_chunks
from .stats import DecodeStats, StatsRecorder
from .textstream import TextStream
from .verify import SamplingParams, TokenLogprob


@dataclass
class GenerationConfig:
    """Per-request settings."""

    max_tokens: int = 256
    block: BlockChoice | None = None  # None: `auto` up to the pair's default size
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_eos: bool = True
    prefill_step_size: int = 2048
    pipeline: bool = True  # queue the next drafter pass before the host bookkeeping
    penalties: Penalties | None = None  # None: no penalties, no cost
    logprobs: int | None = None  # None: none; k: each committed token's and the top k
    grammar: Grammar | None = None  # structured output (constraints.py); None: free text
    # copy drafting where the last tokens repeat earlier text (drafting/copies.py); None: on, but
    # not at a fixed block of 1, which is plain decoding (True there: copies only)
    copy: bool | None = None
    tree: int | None = None  # tree drafting (drafting/tree.py): None `auto`, 0 chains only, N nodes
    # suffix drafting from earlier answers (drafting/suffix.py, `AutoTuning.answers`); None:
    # wherever copies run
    suffix: bool | None = None

    @property
    def copies(self) -> bool:
        """Copy drafting runs: asked for, or by default unless the blocks are plain decoding."""
        if self.copy is not None:
            return self.copy
        return not (self.block is not None and self.block.plain)

    @property
    def suffixes(self) -> bool:
        """Suffix drafting from earlier answers runs: asked for, or wherever copies run; never
        for a seeded sampled request, whose random draws would then follow what earlier
        requests answered (same seed, same text)."""
        if self.seed is not None and not self.sampling.greedy:
            return False
        return self.copies if self.suffix is None else self.suffix


@dataclass
class GenerationEvent:
    """What one step of the stream committed."""

    text: str
    tokens: list[int]
    accepted: int  # tokens committed by this cycle incl. the bonus (0 for the prefill token)
    stats: DecodeStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in `tokens`, when asked
    stop: str | None = None  # the stop string that ended the text (finish_reason "stop")


@dataclass
class Resume:
    """A request that has its first tokens already (a batch engine's row going on alone): its
    caches hold prompt + every committed token but the last, the next cycle's anchor."""

    out: TextStream  # the committed tokens and text so far, going on
    rec: StatsRecorder  # its statistics, going on
    rng: random.Random  # its keys, going on (a seed's keys are drawn in one sequence)
    con: Constraint | None = None  # the grammar's state after the last committed token


class Recorder(Protocol):
    """What the prompt cache records of a request while it prefills (`prefix.tree.SpanRecorder`;
    prefix/ builds on the engine, which imports nothing of it)."""

    max_chunk: int  # the longest prefill chunk whose drafter rows all stay in its window

    def chunk(self, ids: list[int], target_cache: list[Any], draft_cache: list[Any]) -> None:
        """Record the positions after the last recorded one up to len(ids), all just written."""
        ...


class DecodeState:
    """Target cache, drafter context cache and the ids they hold (kept by sessions).

    `max_kv_size`: the target keeps a rotating window of that many positions, as mlx-lm's
    (`target/kvwindow.py`), and the drafter's context is bounded alike; None: unbounded."""

    def __init__(self, pair: Pair, max_kv_size: int | None = None):
        if max_kv_size is None:
            self.target_cache = make_prompt_cache(pair.target)
        else:
            self.target_cache = target_cache(pair, max_kv_size)
        self.rollback = TargetRollback(pair.target, self.target_cache)
        self.draft_cache = pair.drafter.make_cache()
        if max_kv_size is not None:
            bound_context(self.draft_cache, max_kv_size)
        self.max_kv_size = max_kv_size
        self.ids: list[int] = []
        self.record: Recorder | None = None  # what the prompt cache keeps of this request

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


def event(
    out: TextStream,
    text: str,
    before: int,
    accepted: int,
    rec: StatsRecorder,
    logprobs: list[TokenLogprob] | None,
    generated: int | None = None,
) -> GenerationEvent:
    """What a step committed: the text and tokens since `before`, their logprobs (the kept
    ones), the statistics so far (of `generated` tokens: the first one counts, even an EOS)."""
    lps = logprobs and logprobs[: out.count - before]  # the tokens kept
    stats = rec.snapshot(out.count if generated is None else generated)
    return GenerationEvent(
        text, out.tokens[before:], accepted, stats, out.finish_reason, lps, out.stopped_by
    )


@contextmanager
def request_end(mirror: Mirror | None):
    """Tell a distributed target's mirror that the request ended, however it ended."""
    try:
        yield
    finally:
        if mirror is not None:
            mirror.idle()


def speculative_stream(
    pair: Pair,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    state: DecodeState | None = None,
    should_stop: Callable[[], bool] | None = None,
    tuning: AutoTuning | None = None,
    controller: BlockSizer | None = None,
    resume: Resume | None = None,
    hand_back: Callable[[], bool] | None = None,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash: draft a block, verify it in one target pass, accept the longest
    agreeing prefix, commit it, roll the rest back, yield what was committed.

    `cfg.block` fixes each cycle's size, or with `auto` caps what the controller picks each
    cycle (`controller`, else one of `tuning`: what `auto` learnt, continued across requests;
    a request that copies also asks it how long a copy runs: `sizing.sizer.CopySizer`).
    With `resume` the request goes on from its committed tokens (no prefill); once `hand_back()`
    says so, the loop ends after a cycle without a last event, the caches holding prompt + every
    committed token but the last (the batch engine takes the request back)."""
    state = state or DecodeState(pair)
    block = cfg.block or block_size_for(pair, None)
    sp, mirror = cfg.sampling, pair.mirror
    sizes = sizes_for(pair, cfg, block, state, len(prompt_ids), tuning, controller)
    plan = sizes.plan
    # earlier answers (suffix drafting): the session's, kept across its requests
    memory = tuning.answers if tuning is not None and cfg.suffixes else None
    facts = mirror.facts() if mirror is not None else {}
    if resume is None:
        cached = len(state.ids)
        out, rec = open_output(pair, cfg, block.size, block.auto, len(prompt_ids), cached, facts)
    else:
        out, rec = resume.out, resume.rec
    stopped, handed = should_stop or (lambda: False), hand_back or (lambda: False)
    gathered = mirror.features if mirror is not None else None  # pipeline stages gather
    capture = FeatureCapture(pair.target, pair.layer_ids, queue=queues_layers(), features=gathered)
    with capture as cap, state.rollback.hooks(), mx.stream(generation_stream), request_end(mirror):
        pen, asks = cfg.penalties, (cfg.logprobs, cfg.grammar, cfg.copies)
        rates = plan.copy_rates if plan else None
        pipe = CyclePipeline(
            pair, state, cap, sp, sizes, pen, cfg.seed, cfg.pipeline, *asks, rates, memory
        )
        if resume is None:
            logits = prefill(pair, state, prompt_ids, cap, cfg.prefill_step_size)
            anchor = pipe.first_token(logits, prompt_ids)
            rec.prefilled()
            text = out.push([anchor], cfg.max_tokens)
            yield event(out, text, 0, 0, rec, pipe.first_logprobs, generated=1)
        else:
            pipe.resume(state.ids, resume.rng, resume.con)
            anchor = out.tokens[-1]  # committed, not yet cached

        while out.finish_reason is None and not stopped() and not handed():
            room = cfg.max_tokens - out.count
            c = pipe.cycle(anchor, room)  # draft, and the verify queued behind it
            r = pipe.finish(c, anchor, room)  # accept: the one host sync; commit, roll back
            anchor = r.committed[-1]  # the bonus token: the next cycle's anchor
            if plan and not c.copied:  # copies say nothing about the drafter's blocks
                timed = r.seconds if not c.copy else None  # a graft's nodes make a tree dearer
                plan.update(c.bs, r.drafted, timed, r.steady, c.budget, r.chain)
            pipe.ahead(anchor, room - len(r.committed))  # queued before the bookkeeping
            before = out.count
            text = out.push(r.committed, cfg.max_tokens)
            record(rec, c, r, plan.last.reason if plan else "", pipe.ctx.rows)
            yield event(out, text, before, r.accepted + 1, rec, r.logprobs)

        pipe.close()
        if out.finish_reason is None and not handed():
            out.finish_reason = "cancelled"
            yield GenerationEvent(out.flush(), [], 0, rec.snapshot(out.count), "cancelled")
    # a request this loop began and ended: later ones may draft from its answer (a resumed
    # one is the batch engine's, which keeps its answer when it ends there)
    if memory is not None and resume is None and out.finish_reason not in (None, "cancelled"):
        memory.add(out.tokens)
    # Caches hold exactly a prefix of prompt + kept output (the last token may be pending).
    state.trim_to(len(prompt_ids) + out.count)
    mx.eval([c.state for c in state.target_cache + state.draft_cache if not c.empty()])
    if mirror is not None:  # a distributed target: every rank's cache alike
        mirror.settle(state.target_cache)
