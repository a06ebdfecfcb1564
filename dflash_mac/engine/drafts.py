"""A cycle's drafting strategies (docs/design.md §6): a plain target step, a drafter chain,
a chain under a grammar, a tree from one drafter pass, and a copy of earlier text (the
request's own, or an earlier answer's). Each makes its cycle's drafts (`draft`), queues the
verify and the outcome the host reads (`verify`), and reads that outcome back as the same
`Verdict` (`read`). `pick` chooses one per cycle; a new strategy is a class here and its line
in `pick`. `CyclePipeline` (cycle.py) runs every kind one way: queued ahead, one host sync,
settled, timed."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx

from ..drafting.tree import (
    DraftTree,
    chain_depth,
    chain_reach,
    graft,
    grow,
    verify_logits,
    walk,
)
from ..models.penalties import PenaltyContext, draft_sequential
from ..pair import Pair
from .constraints import Constraint
from .verify import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    acceptance_odds,
    logprob_rows,
    probabilities,
    sample,
    sample_logits,
)

TREE_K = 8  # a DFlash 1 tree node's children at most (DFlash 2: its selector's candidates)


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


def propose_constrained(
    pair: Pair,
    block: mx.array,
    cache: list,
    sp: SamplingParams,
    key: mx.array,
    penalty: PenaltyContext | None,
    con: Constraint,
) -> tuple[mx.array, mx.array | None, mx.array]:
    """Drafts under a grammar, one position at a time: each from its q masked by the grammar
    (and penalised) given the drafts before it; (drafts [n], q [n, V] | None, masks [n+1, V]),
    the last mask for the bonus position. The grammar runs on the host, so each draft is read
    back (one small sync per draft); drafting stops after an end-of-sequence token, so n may
    be less than bs-1, and so does a position where the grammar allows nothing of a draft
    vocabulary. The drafter's backbone logits are used (DFlash 2's selector walk draws
    from candidates the grammar may all refuse). The constraint is left advanced by the drafts."""
    logits = pair.drafter(block[None], cache)[0]  # [bs-1, V]
    keys = mx.random.split(key, logits.shape[0])
    # a draft vocabulary leaves every other id at -inf: the grammar may allow none of its ids
    limited = getattr(pair.drafter, "draft_head", None) is not None
    drafts: list[int] = []
    qs, masks = [], []
    for i in range(logits.shape[0]):
        allowed = con.mask()
        row = logits[i : i + 1]
        if penalty is not None:
            row = penalty.apply(row, mx.array(drafts, mx.int32), first=i)
        row = mx.where(allowed, row, -mx.inf)
        if limited and not mx.isfinite(row).any().item():
            break  # nothing to draft here: the target's own token comes as the bonus
        masks.append(allowed)
        if sp.greedy:
            d = mx.argmax(row, axis=-1)
        else:
            qs.append(probabilities(row, sp))
            d = sample(qs[-1], key=keys[i])
        drafts.append(d.item())  # the grammar's next state needs the token on the host
        con.consume(drafts[-1])
        if con.ended:
            break
    masks.append(con.mask())
    q = mx.concatenate(qs) if qs else None
    return mx.array(drafts, mx.int32), q, mx.stack(masks)


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

    @property
    def rows(self) -> int:
        """Positions the drafter's (bounded) context cache holds."""
        return getattr(self.cache[0], "rows", 0) if self.cache else 0


@dataclass
class Lane:
    """What every strategy drafts and verifies against: one request's pair, decode state and
    drafter context, its sampling, grammar state and logprobs ask, and the target's rope
    modules a tree verify hooks (built once per request by `CyclePipeline`)."""

    pair: Pair
    state: Any  # decode.DecodeState
    ctx: DraftContext
    sp: SamplingParams
    logprobs: int | None = None
    con: Constraint | None = None
    ropes: list = field(default_factory=list)


@dataclass
class Cycle:
    """One cycle: its block, drafts and, once queued, the verify verdict (lazy arrays
    evaluated in the background with `mx.async_eval`)."""

    bs: int
    block: mx.array  # [bs]: the anchor, then mask tokens
    drafts: mx.array  # [bs-1]
    q: mx.array | None  # [bs-1, V] the drafter's distributions (None when greedy)
    key: mx.array
    penalty: PenaltyContext | None = None  # penalties given the committed prefix
    masks: mx.array | None = None  # [bs, V] the grammar's allowed tokens per block position
    verdict: tuple[mx.array, mx.array] | None = None  # (accepted drafts, bonus token)
    # [accepted, bonus, drafts..., logprob rows...]: what the host reads, computed with the
    # queued work (a new op at read time would wait behind whatever was queued after this cycle)
    outcome: mx.array | None = None
    copied: bool = False  # drafts copied from earlier text (drafting/copies.py), not drafted
    tree: DraftTree | None = None  # a tree of drafts (drafting/tree.py; `drafts` are its nodes)
    start: int = 0  # a tree's first verified cache position
    copy: tuple[int, ...] = ()  # a copy grafted onto the tree as one more branch
    suffixed: bool = False  # its copy (or graft) came from earlier answers (drafting/suffix.py)
    kind: Strategy | None = None  # how it was drafted, and how it is verified and read

    @property
    def width(self) -> int:
        """Positions its verify adds to the target cache."""
        return self.tree.width if self.tree is not None else self.bs

    @property
    def budget(self) -> int:
        """Its tree's nodes (0: a chain)."""
        return self.tree.budget if self.tree is not None else 0


@dataclass(frozen=True)
class Verdict:
    """What the host read of a cycle's outcome, whatever drafted it."""

    accepted: int  # drafts accepted (a tree's: its accepted depth)
    bonus: int  # the target's token after them
    drafted: list[int]  # the verified drafts in order (a tree's: down its accepted path)
    path: list[int]  # a tree's accepted node indices ([] for a chain)
    chain: int  # what the chain of the same drafter pass accepted (a chain's: `accepted`)
    rows: list[float]  # what follows in the outcome: the logprob rows, when asked
    odds: tuple[float, ...] = ()  # a sampled chain's acceptance odds (verify.acceptance_odds)
    reach: int = 0  # a tree's: how deep its chain of likeliest children went (chain_reach)


class Strategy:
    """A chain's verify, one target pass over [anchor, drafts], and its read; the strategies
    differ in how they draft (`draft`)."""

    def draft(
        self,
        lane: Lane,
        bs: int,
        anchor: int | mx.array,
        key: mx.array,
        penalty: PenaltyContext | None,
        copy: list[int],
    ) -> Cycle:
        raise NotImplementedError

    def verify(self, lane: Lane, c: Cycle) -> None:
        """Queue the verify and the outcome the host reads: [accepted, bonus, drafts...,
        a sampled draft's odds..., logprob rows...] (`mx.async_eval`)."""
        acc, bonus, logits, odds = self.accept(lane, c)
        c.verdict = acc, bonus
        parts = [acc.reshape(1), bonus.reshape(1), c.drafts]
        floats = [] if odds is None else [odds]
        if lane.logprobs is not None:  # every row's; the host reads the committed ones
            row_tokens = mx.concatenate([c.drafts.astype(mx.int32), bonus.reshape(1)])
            row_tokens = mx.where(mx.arange(c.bs) < acc, row_tokens, bonus)
            floats.append(logprob_rows(logits, row_tokens, lane.logprobs))
        if floats:  # token ids stay exact in float32 below 2**24
            parts = [p.astype(mx.float32) for p in parts] + floats
        c.outcome = mx.concatenate(parts)
        mx.async_eval(c.outcome)

    def q(self, c: Cycle, p: mx.array) -> mx.array:
        """The drafts' distributions the rejection sampler weighs them by."""
        return c.q

    def accept(self, lane: Lane, c: Cycle) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """One target pass over [anchor, drafts]; (accepted drafts, bonus token, the
        transformed logits [bs, V], a sampled chain's acceptance odds or None), lazily."""
        lane.state.rollback.before_verify()
        tokens = c.block if c.bs == 1 else mx.concatenate([c.block[:1], c.drafts])
        logits = lane.pair.target(tokens[None], cache=lane.state.target_cache)[0]  # [bs, V]
        if c.penalty is not None:  # p gets the same penalties as q, position by position
            logits = c.penalty.apply(logits, c.drafts)
        if c.masks is not None:  # and the same grammar, given the drafts before each position
            logits = mx.where(c.masks, logits, -mx.inf)
        if lane.sp.greedy:
            return (*accept_greedy(c.drafts, logits), logits, None)
        if c.bs == 1:
            return mx.array(0), sample_logits(logits, lane.sp, c.key), logits, None
        p = probabilities(logits, lane.sp)
        q = self.q(c, p)
        odds = acceptance_odds(c.drafts, q, p) if self.counted(c) else None
        return (*accept_sampled(c.drafts, q, p, c.key), logits, odds)

    def counted(self, c: Cycle) -> bool:
        """Whether a sampled cycle's acceptance odds go to `auto` (the drafter's, not a copy's)."""
        return c.q is not None

    def read(self, c: Cycle, out: list) -> Verdict:
        n = c.bs - 1
        a, bonus = int(out[0]), int(out[1])
        m = 2 * n if n and self.counted(c) else 0  # a sampled drafter's odds
        odds = tuple(out[2 + n : 2 + n + m])
        return Verdict(a, bonus, [int(d) for d in out[2 : 2 + n]], [], a, out[2 + n + m :], odds)


class Plain(Strategy):
    """A plain target step: no drafts, no split of the key."""

    def draft(self, lane, bs, anchor, key, penalty, copy) -> Cycle:
        first = mx.array(anchor).astype(mx.int32).reshape(1)
        masks = lane.con.mask()[None] if lane.con else None
        return Cycle(1, first, mx.zeros((0,), mx.int32), None, key, penalty, masks, kind=self)


def drafter_block(lane: Lane, bs: int, anchor: int | mx.array) -> mx.array:
    """`[anchor, MASK...]`, the drafter's context brought up to date first (lazily)."""
    first = mx.array(anchor).astype(mx.int32).reshape(1)
    masks = mx.array([lane.pair.drafter.config.mask_token_id] * (bs - 1), mx.int32)
    lane.ctx.flush()
    return mx.concatenate([first, masks])


class Chain(Strategy):
    """The drafter's block: bs-1 drafts from one pass."""

    def draft(self, lane, bs, anchor, key, penalty, copy) -> Cycle:
        k_draft, k_verify = mx.random.split(key)
        block = drafter_block(lane, bs, anchor)
        drafts, q = propose(lane.pair, block, lane.ctx.cache, lane.sp, k_draft, penalty)
        return Cycle(bs, block, drafts, q, k_verify, penalty, kind=self)


class Constrained(Strategy):
    """A chain under a grammar, drafted a position at a time; it may draft fewer than bs-1
    (it stops after an end-of-sequence token; none: a plain step)."""

    def draft(self, lane, bs, anchor, key, penalty, copy) -> Cycle:
        k_draft, k_verify = mx.random.split(key)
        block = drafter_block(lane, bs, anchor)
        drafts, q, allowed = propose_constrained(
            lane.pair, block, lane.ctx.cache, lane.sp, k_draft, penalty, lane.con
        )
        n = drafts.shape[0]
        block = block if n else block[:1]
        return Cycle(n + 1, block, drafts, q, k_verify, penalty, allowed, kind=self)


class Copy(Strategy):
    """Drafts copied from earlier text, no drafter pass (its context waits, as after a plain
    step); a copied token is a draft with all of q's mass on it."""

    def draft(self, lane, bs, anchor, key, penalty, copy) -> Cycle:
        block = mx.array([anchor, *copy], mx.int32)
        return Cycle(len(copy) + 1, block, block[1:], None, key, copied=True, kind=self)

    def q(self, c: Cycle, p: mx.array) -> mx.array:
        return (mx.arange(p.shape[-1])[None] == c.drafts[:, None]).astype(p.dtype)


class Tree(Strategy):
    """A tree of drafts from one drafter pass (drafting/tree.py), a doubtful copy grafted on
    as one more branch; the verify walks the target's argmax, or a draw from p at each node."""

    def __init__(self, budget: int = 0):
        self.budget = budget

    def draft(self, lane, bs, anchor, key, penalty, copy) -> Cycle:
        k_draft, k_verify = mx.random.split(key)
        block = drafter_block(lane, bs, anchor)
        expand = lane.pair.drafter.expansion(block, lane.ctx.cache, TREE_K)
        tree = grow(block[:1], expand, bs - 1, self.budget)
        if copy:
            tree = graft(tree, mx.array(copy, mx.int32))
        c = Cycle(bs, block, tree.tokens[1:], None, k_verify, penalty, tree=tree, kind=self)
        c.copy = tuple(copy)
        return c

    def verify(self, lane: Lane, c: Cycle) -> None:
        """[accepted, bonus, path tokens, path nodes, the chain's accepted, its reach]."""
        c.start = lane.state.target_cache[0].offset
        logits = verify_logits(lane.pair.target, c.tree, lane.state.target_cache, lane.ropes)
        if lane.sp.greedy:
            x = mx.argmax(logits, axis=-1)
        else:
            x = sample_logits(logits, lane.sp, c.key)  # one independent draw per node
        acc, bonus, path = walk(c.tree, x)
        c.verdict = acc, bonus
        tokens, chain = c.tree.tokens[path], chain_depth(c.tree, acc, path)
        c.outcome = mx.concatenate(
            [acc.reshape(1), bonus.reshape(1), tokens, path, chain.reshape(1)]
            + [chain_reach(c.tree).reshape(1)]
        )
        mx.async_eval(c.outcome)

    def read(self, c: Cycle, out: list) -> Verdict:
        n = c.tree.max_depth
        a, bonus, drafted = int(out[0]), int(out[1]), [int(d) for d in out[2 : 2 + n]]
        path = [int(i) for i in out[2 + n : 2 + 2 * n]]
        return Verdict(a, bonus, drafted, path, int(out[2 + 2 * n]), [], reach=int(out[3 + 2 * n]))


PLAIN, CHAIN, CONSTRAINED, COPY = Plain(), Chain(), Constrained(), Copy()


@cache
def tree_of(budget: int) -> Tree:
    """The tree strategy of a node budget (one object per budget, not one per cycle)."""
    return Tree(budget)


def pick(bs: int, copy: list[int], grafted: bool, budget: int, lane: Lane) -> Strategy:
    """The strategy of a cycle of `bs` (1: a plain step) with a proposed `copy` (grafted onto
    a tree of `budget` nodes, or alone) under the request's grammar."""
    if copy and not grafted:
        return COPY
    if bs == 1:
        return PLAIN
    if budget:
        return tree_of(budget)
    return CHAIN if lane.con is None else CONSTRAINED
