"""How one DFlash cycle runs: draft, verify, accept, roll back (docs/design.md §6).

`CyclePipeline` is the machinery beside the decode loop (decode.py) and the cost-curve
measurement (calibrate.py), so that both run cycles one way: each cycle's device work is queued
with `mx.async_eval` while the host does the previous cycle's bookkeeping, the verify of a
hybrid target waits for the last rollback, and every cycle is timed from one host sync to the
next for the block-size controller."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..drafting.copies import CopyPolicy
from ..drafting.tree import keep_path, ropes, supports
from ..models.penalties import Penalties
from ..pair import Pair
from ..sizing.sizer import CopySizer
from ..target.capture import FeatureCapture, queues_layers
from .constraints import Grammar
from .drafts import Cycle, Lane, pick
from .row import Row, commit, may_copy, propose_copy
from .verify import TokenLogprob, read_logprobs


def trees_allowed(
    pair: Pair,
    cache: list,
    penalties: Penalties | None,
    grammar: Grammar | None,
    logprobs: int | None,
) -> bool:
    """Whether a request's cycles may be trees: the target takes them in one process
    (drafting/tree.py) and no penalties, grammar or logprobs bind the drafts to one chain."""
    bound = penalties is not None or grammar is not None or logprobs is not None
    return not bound and pair.mirror is None and supports(pair.target, cache)


@dataclass(frozen=True)
class Outcome:
    """What a cycle's host sync read, and how long the cycle took."""

    accepted: int  # drafts accepted
    committed: list[int]  # the accepted drafts and the bonus token
    seconds: float  # from the previous sync to this one
    steady: bool  # timed amid cycles of its kind (what the cost model learns from)
    host: float  # host bookkeeping in that interval
    logprobs: list[TokenLogprob] | None = None  # of `committed`, when the request asks
    chain: int = 0  # a tree's: what the chain of the same drafter pass would have accepted
    drafted: int = 0  # accepted drafts the drafter proposed (less a grafted copy's)
    odds: tuple[float, ...] = ()  # a sampled chain's acceptance odds (drafts.Verdict)
    reach: int = 0  # a tree's: how deep its chain of likeliest children went


class Sizes:
    """How a request's cycles are sized: the controller's choice each cycle (`auto`: `plan`,
    asked once per cycle, never more: its choice has side effects), else the fixed `block`;
    the tree budget of the drafting cycle chosen (a fixed budget where only trees draft); and,
    where a controller prices them, how long a copy runs and whether a doubtful one rides on
    the tree (without one: the longest copy, always grafted)."""

    def __init__(self, block: int, plan: CopySizer | None, trees=(), chains: bool = True):
        self.block, self.plan = block, plan
        self.fixed_tree = trees[0] if trees and not chains else 0

    @property
    def priced(self) -> bool:
        return self.plan is not None

    def size(self, room: int) -> int:
        return max(1, min(self.plan.choose().size if self.plan else self.block, room))

    def budget(self) -> int:
        """The tree budget of the drafting cycle `size` chose (0: a chain)."""
        return self.plan.last.tree if self.plan else self.fixed_tree

    def copy_len(self, longest: int, policy: CopyPolicy) -> int:
        """Tokens to copy of the `longest` proposed: as long as the costs say it pays."""
        return self.plan.copy_length(longest, policy.rate)

    def waited(self, policy: CopyPolicy, copied: bool, tokens: int, seconds: float, idle: float):
        """Teach `policy` what a plain step's wait for its anchor gained, in plain steps: the
        cycle after it commits `tokens` in `seconds` (a copy), else (a plain step) only the
        wait's `idle` seconds were lost; where the controller has timed a plain step."""
        unit = self.plan.plain_step() if self.plan else None
        if unit:
            policy.waited(tokens - seconds / unit if copied else -idle / unit)

    def graft(self, copy: int, budget: int, policy: CopyPolicy) -> bool:
        """Whether a doubtful copy rides on the tree of `budget` nodes, where the costs say so."""
        rates = policy.rates
        return self.plan.graft_pays(budget, copy, rates.doubtful_hit, rates.doubtful_zero)


class CyclePipeline:
    """Runs the cycles of one request's row (`row.Row`: its caches, text, grammar state,
    copies and keys, which it moves on; see the module docstring).

    A drafting cycle is queued right after the previous sync, before the host's bookkeeping;
    a plain step (block 1) keeps its one position whatever it samples, so it is settled before
    its sync and, when the next cycle is a plain step too,
    that one is queued on the still-lazy token (as mlx-lm's `generate_step`). A drafting cycle
    is never queued ahead of a plain step's sync: it would run inside that step's interval and
    both would be timed wrong. Penalties bind the committed ids on the host, and a grammar
    follows them there, so both turn that look-ahead off. `logprobs` (the top k, 0
    for the committed tokens' alone) adds each committed position's log-probabilities to the
    outcome the host reads: still one sync per cycle. `sizes` (`Sizes`) gives each cycle's
    size and the node budget of a drafting cycle (0: a chain): a tree is drafted and verified
    where the target takes trees (drafting/tree.py) and no penalties, grammar or logprobs bind
    it."""

    def __init__(self, pair: Pair, row: Row, cap: FeatureCapture, sizes: Sizes):
        self.pair, self.row, self.cap, self.sizes = pair, row, cap, sizes
        cfg = row.cfg
        cache = row.state.target_cache
        trees = trees_allowed(pair, cache, cfg.penalties, cfg.grammar, cfg.logprobs)
        # what every drafting strategy drafts and verifies against (drafts.py)
        hooks = ropes(pair.target) if trees else []  # found once, hooked per tree verify
        self.lane = Lane(pair, row.state, row.ctx, cfg.sampling, cfg.logprobs, row.con, hooks)
        self.lookahead = cfg.pipeline and cfg.penalties is None and row.con is None
        self.trees = trees  # drafting cycles may be trees (the sizes say which)
        self.queued: Cycle | None = None  # the next cycle, queued ahead
        self.chosen: int | None = None  # the next size, chosen before a plain step's sync
        self.last_bs = 0  # the previous cycle's size (0: none yet)
        self.wait: float | None = None  # a plain step's sync that the next cycle waited at
        self.waited: tuple[Cycle, float] | None = None  # that cycle, and the wait's idle
        self.queue_time = 0.0  # spent queueing device work since the last sync
        self.t_sync = time.perf_counter()  # the row's last sync (its first token's, just read)

    # -- the cycle ---------------------------------------------------------------------------
    def cycle(self, anchor: int, room: int) -> Cycle:
        """The next cycle: the one queued ahead, else one queued now. Draft → verify queued."""
        c = self.queued or self.start(self.chosen or self.sizes.size(room), anchor, room)
        self.queued = self.chosen = None
        if c.verdict is None:  # a hybrid's verify: queued once the last rollback is done
            self.queue_verify(c)
        return c

    def finish(self, c: Cycle, anchor: int, room: int) -> Outcome:
        """Accept → commit → roll back: the cycle's one host sync, its rejected positions rolled
        back and its kept features handed to the drafter."""
        ahead = self.lookahead and c.bs == 1 and room > 1
        waits = False  # the next plain step waits for its anchor: a copy may come
        if ahead:
            self.settle(c, [anchor])
            self.chosen = self.sizes.size(room - 1)
            if self.chosen == 1 and not (waits := self.may_copy()):
                self.queued = self.start(1, c.verdict[1])
        t_host = time.perf_counter()
        v = c.kind.read(c, c.outcome.tolist())  # the one host sync of the cycle
        a, bonus, drafted, path, chain = v.accepted, v.bonus, v.drafted, v.path, v.chain
        n = len(drafted)
        own = a - sum(i > c.budget for i in path[:a])  # the rest came down the copy's branch
        if c.copied:
            self.row.policy.update(n, a)
        elif c.copy:  # what the grafted copy would have committed alone
            same = [t == d for t, d in zip(c.copy, drafted[:a])]
            self.row.policy.update(len(c.copy), same.index(False) if False in same else len(same))
        committed = drafted[:a] + [bonus]
        asks = self.row.cfg.logprobs is not None
        lps = read_logprobs(v.rows, c.bs, committed) if asks else None
        if self.row.con:  # the grammar forgets the rejected drafts and takes the bonus
            self.row.con.rollback(n - a)
            if not self.row.con.ended:
                self.row.con.consume(bonus)
        t_now = time.perf_counter()
        host, seconds = t_host - self.t_sync - self.queue_time, t_now - self.t_sync
        self.t_sync, self.queue_time = t_now, 0.0
        after_wait = self.waited is not None and self.waited[0] is c
        if after_wait:
            self.sizes.waited(self.row.policy, c.copied, a + 1, seconds, self.waited[1])
        self.wait, self.waited = (t_now if waits else None), None
        if not ahead:
            self.settle(c, [anchor] + committed[:-1], path[:a])
        # the cost model learns from cycles amid their kind: a plain step between plain steps
        # (the last one before a drafting cycle builds nothing ahead: its interval is short;
        # one that waited for its anchor also idled),
        # a drafting cycle after a drafting one (the first after plain steps also appends their
        # context and restarts the pipeline, a one-off that would make drafting look dear)
        steady = self.last_bs > 0 and (c.bs > 1) == (self.last_bs > 1)
        steady = steady and not (ahead and self.queued is None) and not after_wait
        self.last_bs = c.bs
        return Outcome(a, committed, seconds, steady, host, lps, chain, own, v.odds, v.reach)

    def ahead(self, anchor: int, room: int) -> None:
        """Queue the next cycle right after the sync, before the host's bookkeeping."""
        if self.queued is None and room > 0 and (self.row.cfg.pipeline or self.chosen):
            self.queued = self.start(self.chosen or self.sizes.size(room), anchor, room)
            self.chosen = None

    def close(self) -> None:
        """The request ends: drop a cycle queued and never used, append waiting features."""
        if self.queued is not None and self.queued.verdict is not None:
            self.row.state.rollback.trim(self.queued.width)
        self.queued = None
        self.row.ctx.flush()

    # -- its parts ---------------------------------------------------------------------------
    def may_copy(self) -> bool:
        """Whether the next cycle may copy (then it waits for its anchor, not queued ahead)."""
        return may_copy(self.row.index, self.row.policy)

    def start(self, bs: int, anchor: int | mx.array, room: int = 0) -> Cycle:
        """Queue a cycle: the drafter pass for `[anchor, MASK...]` (none at block 1), or drafts
        copied from earlier text where the last tokens repeat (`room` > 1 left), and, unless
        the target is a hybrid (whose rollback must watch its verify), the verify behind it.
        The anchor may still be lazy (the token of a plain step not yet read back)."""
        t = time.perf_counter()
        key = self.row.key()
        pen, ids = self.row.cfg.penalties, self.row.state.ids
        penalty = pen.bind(ids[-pen.context_size :] + [anchor]) if pen else None
        copy = propose_copy(self.row.index, self.row.policy, anchor, room)
        suffixed = bool(copy) and self.row.index.suffixed
        sizes = self.sizes
        if copy and sizes.priced:  # as long as the costs say it pays
            n = sizes.copy_len(len(copy), self.row.policy)
            if n == 0 and (k := self.row.policy.probe(len(copy))):  # priced as what it looks
                n = sizes.copy_len(k, CopyPolicy(sure=True))  # for: a repeat taken whole
            copy = copy[:n]
        budget = sizes.budget() if self.trees and bs > 1 else 0
        grafts = bool(copy and budget) and not self.row.policy.sure
        if grafts and sizes.priced:
            grafts = sizes.graft(len(copy), budget, self.row.policy)
        # the strategy (drafts.py): a copy alone, a plain step, a tree, a chain
        kind = pick(bs, copy, grafts, budget, self.lane)
        c = kind.draft(self.lane, bs, anchor, key, penalty, copy)
        c.suffixed = suffixed
        if self.row.state.rollback.hybrid:  # its verify is queued once the last rollback is done
            mx.async_eval(c.drafts)
        else:
            if bs > 1 and queues_layers():  # the drafter runs while the verify is built
                mx.async_eval(c.drafts)
            self.queue_verify(c)
        t_queued = time.perf_counter()
        self.queue_time += t_queued - t
        if self.wait is not None:  # the device idled from the wait's sync until now
            self.waited, self.wait = (c, t_queued - self.wait), None
        return c

    def queue_verify(self, c: Cycle) -> None:
        """Queue the cycle's verify pass and its outcome (`mx.async_eval`)."""
        c.kind.verify(self.lane, c)

    def settle(self, c: Cycle, kept: list, path: list[int] | None = None) -> None:
        """Roll back a cycle's rejected positions; its kept features go to the drafter. A
        tree's accepted `path` (node indices) moves to the front of its verified span first."""
        features = self.cap.features()
        if c.tree is None:
            features = features[:, : len(kept)]
        else:
            rows = mx.array([0, *(path or [])], mx.int32)
            keep_path(self.row.state.target_cache, c.start, rows[1:], len(kept))
            features = features[:, rows]
        commit(self.row.state, self.row.ctx, self.row.index, features, c.width, kept)
