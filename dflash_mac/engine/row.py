"""The steps of one request's cycle that the single loop (decode.py, cycle.py) and the batch
engine (batching/scheduler.py) share, written once so that a row decodes in a batch as it does
alone: the prefill's chunk boundaries, the text stream and statistics a request opens, its copy
index, whether its next cycle may copy and what it copies, and how a cycle's kept positions
settle into its caches, drafter context and index."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..drafting.copies import CopyIndex, CopyPolicy
from ..drafting.suffix import SuffixMemory
from ..pair import Pair
from .drafts import DraftContext
from .stats import StatsRecorder
from .textstream import TextStream


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
    cfg: Any,  # decode.GenerationConfig
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
    """Whether the next cycle may copy (then it waits for its anchor on the host)."""
    return index is not None and policy.paused == 0 and index.may_match()


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
    state: Any,  # decode.DecodeState
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
