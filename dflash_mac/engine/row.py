"""One request's cycle state (`Row`) and the steps on it that the single loop (decode.py,
cycle.py) and the batch engine (batching/scheduler.py) share, written once so that a row
decodes in a batch as it does alone: the prefill's chunk boundaries, the text stream and
statistics a request opens, its first token and copy index, whether its next cycle may copy
and what it copies, and how a cycle's kept positions settle into its caches, drafter context
and index."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..drafting.copies import CopyIndex, CopyPolicy, CopyRates
from ..drafting.suffix import SuffixMemory
from ..models.penalties import Penalties
from ..pair import Pair
from .config import GenerationConfig, GenerationEvent
from .constraints import Constraint
from .drafts import DraftContext
from .state import DecodeState
from .stats import StatsRecorder
from .textstream import TextStream
from .verify import SamplingParams, TokenLogprob, logprob_rows, read_logprobs, sample_logits


@dataclass
class Row:
    """One request's cycle state, the same whether `cycle.CyclePipeline` drives it alone or
    the batch engine among others (and alone again): a request moves between them as it is."""

    ids: list[int]  # the prompt's token ids
    cfg: GenerationConfig
    state: DecodeState  # its caches (may hold a cached prefix of `ids`)
    out: TextStream  # the committed tokens and text
    rec: StatsRecorder
    ctx: DraftContext  # the drafter's context: features waiting to go in
    con: Constraint | None  # the grammar's state (None: free text)
    rng: random.Random  # every key the request draws, in one sequence (a seed's, as alone)
    policy: CopyPolicy  # how long its next copy may be
    index: CopyIndex | None = None  # what it copies from (`start`; None: no copies)
    anchor: int = 0  # the last committed token, not yet cached: the next cycle's first

    def key(self) -> mx.array:
        return mx.random.key(self.rng.getrandbits(32))


def open_row(
    pair: Pair,
    ids: list[int],
    cfg: GenerationConfig,
    state: DecodeState,
    block: int,
    auto: bool,
    facts: dict | None = None,
    rates: CopyRates | None = None,
) -> Row:
    """A request's row before its prefill (`block`: its largest size; `rates`: what copies
    got, where they outlive the request)."""
    out, rec = open_output(pair, cfg, block, auto, len(ids), len(state.ids), facts)
    con = cfg.grammar.start(pair) if cfg.grammar is not None else None
    ctx = DraftContext(pair.drafter, state.draft_cache)
    policy = CopyPolicy(rates=rates or CopyRates())
    return Row(ids, cfg, state, out, rec, ctx, con, random.Random(cfg.seed), policy)


def start(
    row: Row, logits: mx.array, memory: SuffixMemory | None
) -> tuple[str, list[TokenLogprob] | None]:
    """The prefilled row's first token from the last logits [V] (one host sync), its copy
    index (its own text where it copies, `memory`: earlier answers, where its settings draft
    from them); the token becomes the row's anchor. Returns the text it added and its
    log-probabilities when asked."""
    cfg = row.cfg
    bound = cfg.penalties is not None or row.con is not None
    row.anchor, lps = first_token(
        logits, row.ids, cfg.sampling, row.key(), cfg.penalties, row.con, cfg.logprobs
    )
    row.index = copy_index(row.ids, cfg.copies, memory if cfg.suffixes else None, bound)
    row.rec.prefilled()
    return row.out.push([row.anchor], cfg.max_tokens), lps


def remember(row: Row, memory: SuffixMemory | None) -> None:
    """A request that ended (not cancelled): later ones may draft from its answer, where its
    settings draft from earlier answers (`start`'s rule)."""
    ended = row.out.finish_reason not in (None, "cancelled")
    if ended and memory is not None and row.cfg.suffixes:
        memory.add(row.out.tokens)


def first_token(
    logits: mx.array,  # [V] the prefill's last
    prompt: list[int],
    sp: SamplingParams,
    key: mx.array,
    pen: Penalties | None = None,
    con: Constraint | None = None,
    logprobs: int | None = None,
) -> tuple[int, list[TokenLogprob] | None]:
    """The token after the prompt, under the request's penalties and grammar (which takes it),
    and its log-probabilities when asked: one host sync. Alone and in a batch alike."""
    if pen:
        logits = pen.bind(prompt).apply(logits[None], mx.zeros((0,), mx.int32))[0]
    if con:
        logits = mx.where(con.mask(), logits, -mx.inf)
    token = mx.argmax(logits) if sp.greedy else sample_logits(logits, sp, key)
    lps = None
    if logprobs is None:
        token = token.item()
    else:  # the token and its log-probabilities in one read
        rows = logprob_rows(logits[None], token.reshape(1), logprobs)
        flat = mx.concatenate([token.reshape(1).astype(mx.float32), rows]).tolist()
        token = int(flat[0])
        lps = read_logprobs(flat[1:], 1, [token])
    if con:
        con.consume(token)
    return token, lps


def prefill_chunks(ids: list[int], cached: int, step: int, record: Any = None) -> list[list[int]]:
    """The chunks the target prefills `ids` past its `cached` positions in: all but the last
    token `step` at a time (a prompt-cache recorder's `max_chunk` at most, so that it keeps
    every chunk's rows), then the last token alone (as mlx-lm does)."""
    new = ids[cached:]
    assert new, "prefill needs at least one new token"
    head = new[:-1]
    step = min(step, record.max_chunk) if record else step
    return [head[i : i + step] for i in range(0, len(head), step)] + [new[-1:]]


def open_output(
    pair: Pair,
    cfg: GenerationConfig,
    block: int,
    auto: bool,
    prompt: int,
    cached: int,
    facts: dict | None = None,
) -> tuple[TextStream, StatsRecorder]:
    """A request's text stream (its stop strings; EOS ends it unless `use_eos` is off, and
    a grammar's end always does) and its statistics (`block`: its largest size)."""
    ends = cfg.use_eos or cfg.grammar is not None  # a grammar's end is the answer's end
    out = TextStream(pair.tokenizer, cfg.stop, pair.eos_ids if ends else set())
    rec = StatsRecorder(block, prompt, cached, auto, facts or {}, mx.get_peak_memory)
    return out, rec


def copy_index(
    ids: list[int], local: bool, memory: SuffixMemory | None, bound: bool
) -> CopyIndex | None:
    """The index a request copies from: its own text (`local`) and earlier answers
    (`memory`); None when it drafts from neither, or penalties or a grammar (`bound`) bind its
    drafts on the host."""
    if bound or not (local or memory is not None):
        return None
    return CopyIndex(ids, memory=memory, local=local)


def may_copy(index: CopyIndex | None, policy: CopyPolicy) -> bool:
    """Whether the next cycle may copy: then it waits for its anchor on the host, where waiting
    has paid (`CopyPolicy.waits`)."""
    return index is not None and policy.paused == 0 and index.may_match() and policy.waits()


def propose_copy(index: CopyIndex | None, policy: CopyPolicy, anchor: Any, room: int) -> list[int]:
    """The cycle's copy: what followed its last tokens earlier, as long as the policy allows
    and `room` (tokens left) has space for a bonus after it ([]: none). A cycle queued on a
    lazy anchor cannot copy, but it counts down a pause: every cycle does, else a pause begun
    among such steps would never end."""
    most = policy.length() if index is not None else 0
    if not isinstance(anchor, int) or room <= 1 or most == 0:
        return []
    return index.propose(anchor, min(most, room - 1))


def commit(
    state: DecodeState,
    ctx: DraftContext,
    index: CopyIndex | None,
    features: mx.array,
    width: int,
    kept: list[int],
) -> None:
    """Settle a verified span of `width` positions of which the first `len(kept)` stay: roll
    the rest back, hand the kept positions' `features` to the drafter's context, and add
    `kept` to the cached ids and the copy index."""
    state.rollback.rollback(width - len(kept), len(kept) - 1)
    ctx.add(features)
    state.ids += kept
    if index is not None:
        index.extend(kept)


def event(
    row: Row,
    text: str,
    before: int,
    accepted: int,
    logprobs: list[TokenLogprob] | None = None,
    generated: int | None = None,
) -> GenerationEvent:
    """What a step committed: the text and tokens since `before`, their logprobs (the kept
    ones), the statistics so far (of `generated` tokens: the first one counts, even an EOS)."""
    out = row.out
    lps = logprobs and logprobs[: out.count - before]  # the tokens kept
    stats = row.rec.snapshot(out.count if generated is None else generated)
    return GenerationEvent(
        text, out.tokens[before:], accepted, stats, out.finish_reason, lps, out.stopped_by
    )
