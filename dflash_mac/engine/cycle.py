"""How one DFlash cycle runs: draft, verify, accept, roll back (docs/design.md §6).

`CyclePipeline` is the machinery beside the decode loop (decode.py) and the cost-curve
measurement (calibrate.py), so that both run cycles one way: each cycle's device work is queued
with `mx.async_eval` while the host does the previous cycle's bookkeeping, the verify of a
hybrid target waits for the last rollback, and every cycle is timed from one host sync to the
next for the block-size controller."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..drafting.copies import CopyIndex, CopyPolicy, CopyRates
from ..drafting.suffix import SuffixMemory
from ..drafting.tree import (
    DraftTree,
    chain_depth,
    graft,
    grow,
    keep_path,
    ropes,
    supports,
    verify_logits,
    walk,
)
from ..models.penalties import Penalties, PenaltyContext, draft_sequential
from ..pair import Pair
from ..target.capture import FeatureCapture, queues_layers
from .constraints import Constraint, Grammar
from .verify import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
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


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (after logit bias, penalties and
    the grammar, before temperature and the filters: mlx-lm's `generate_step` logprobs), and
    the `top` most likely tokens there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_rows(logits: mx.array, tokens: mx.array, k: int) -> mx.array:
    """Per row of ``logits [R, V]``: the log-probability of ``tokens [R]`` and the top k (ids,
    then values), flat float32 ``[R * (1 + 2k)]`` (ids are exact in float32 below 2**24)."""
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    cols = [mx.take_along_axis(lp, tokens.astype(mx.int32)[:, None], axis=-1)]
    k = min(k, lp.shape[-1])
    if k:
        idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        cols += [
            mx.take_along_axis(idx, order, axis=-1).astype(mx.float32),
            mx.take_along_axis(vals, order, axis=-1),
        ]
    return mx.concatenate(cols, axis=-1).reshape(-1)


def read_logprobs(flat: list[float], rows: int, tokens: list[int]) -> list[TokenLogprob]:
    """The `TokenLogprob`s of `tokens` (the first rows) out of `logprob_rows`' output for
    `rows` rows, read on the host; tokens the grammar refused (-inf) are left out of `top`."""
    width = len(flat) // rows
    k, out = (width - 1) // 2, []
    for j, token in enumerate(tokens):
        row = flat[j * width : (j + 1) * width]
        top = tuple((int(i), v) for i, v in zip(row[1 : 1 + k], row[1 + k :]) if v > -math.inf)
        out.append(TokenLogprob(token, row[0], top))
    return out


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

    @property
    def width(self) -> int:
        """Positions its verify adds to the target cache."""
        return self.tree.width if self.tree is not None else self.bs

    @property
    def budget(self) -> int:
        """Its tree's nodes (0: a chain)."""
        return self.tree.budget if self.tree is not None else 0


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


class CyclePipeline:
    """Runs the cycles of one request on its decode state (see the module docstring).

    `size(room)` is the loop's block-size rule (called once per cycle, never more: the
    controller's choice has side effects). A drafting cycle is queued right after the previous
    sync, before the host's bookkeeping; a plain step (block 1) keeps its one position whatever
    it samples, so it is settled before its sync and, when the next cycle is a plain step too,
    that one is queued on the still-lazy token (as mlx-lm's `generate_step`). A drafting cycle
    is never queued ahead of a plain step's sync: it would run inside that step's interval and
    both would be timed wrong. Penalties bind the committed ids on the host, and a grammar
    (`grammar`) follows them there, so both turn that look-ahead off. `logprobs` (the top k, 0
    for the committed tokens' alone) adds each committed position's log-probabilities to the
    outcome the host reads: still one sync per cycle. `tree()` gives the node budget of the
    next drafting cycle (0: a chain; called right after `size`): a tree is drafted and verified
    where the target takes trees (drafting/tree.py) and no penalties, grammar or logprobs bind
    it."""

    def __init__(
        self,
        pair: Pair,
        state,  # decode.DecodeState
        cap: FeatureCapture,
        sp: SamplingParams,
        size: Callable[[int], int],
        penalties: Penalties | None = None,
        seed: int | None = None,
        pipelined: bool = True,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        copy: bool = False,
        tree: Callable[[], int] | None = None,
        graft: Callable[[int, int, CopyPolicy], bool] | None = None,
        copy_len: Callable[[int, CopyPolicy], int] | None = None,
        copy_rates: CopyRates | None = None,
        memory: SuffixMemory | None = None,
    ):
        self.pair, self.state, self.cap, self.sp, self.size = pair, state, cap, sp, size
        self.pen = penalties
        self.logprobs = logprobs
        self.con: Constraint | None = grammar.start(pair) if grammar is not None else None
        self.first_logprobs: list[TokenLogprob] | None = None  # of the first token
        self.ctx = DraftContext(pair.drafter, state.draft_cache)
        self.rng = random.Random(seed)  # each cycle's key from the host: no device work for it
        self.pipelined = pipelined
        self.lookahead = pipelined and penalties is None and self.con is None
        # copy drafting (penalties and grammars bind drafts on the host: not with those)
        self.copies = (copy or memory is not None) and penalties is None and self.con is None
        self.local = copy  # copies from this request's text (else only from `memory`)
        self.index: CopyIndex | None = None  # built from the prompt (`first_token`)
        self.memory = memory  # earlier answers (suffix drafting; None: off)
        trees = trees_allowed(pair, state.target_cache, penalties, grammar, logprobs)
        self.tree = tree if trees else None
        self.graft = graft  # (copy length, tree budget, policy) -> graft it; None: always
        self.copy_len = copy_len  # (longest copy, policy) -> tokens to copy; None: the longest
        self.ropes = ropes(pair.target) if trees else []  # found once, hooked per tree verify
        self.policy = CopyPolicy(rates=copy_rates or CopyRates())  # rates: the caller's to keep
        self.queued: Cycle | None = None  # the next cycle, queued ahead
        self.chosen: int | None = None  # the next size, chosen before a plain step's sync
        self.last_bs = 0  # the previous cycle's size (0: none yet)
        self.queue_time = 0.0  # spent queueing device work since the last sync
        self.t_sync = time.perf_counter()

    def key(self) -> mx.array:
        return mx.random.key(self.rng.getrandbits(32))

    def first_token(self, logits: mx.array, prompt: list[int]) -> int:
        """The token after the prompt from the prefill's last logits [V] (host sync)."""
        token, self.first_logprobs = first_token(
            logits, prompt, self.sp, self.key(), self.pen, self.con, self.logprobs
        )
        if self.copies:
            self.index = CopyIndex(prompt, memory=self.memory, local=self.local)
        self.t_sync = time.perf_counter()
        return token

    def resume(self, ids: list[int], rng: random.Random, con: Constraint | None) -> None:
        """Go on from the cached `ids` (prompt + committed tokens but the anchor), drawing keys
        from `rng`, with the grammar's state `con`: a request that got its first tokens
        elsewhere (and its first key from `rng`, as `first_token` here would)."""
        self.rng = rng
        if self.con is not None:
            self.con = con
        if self.copies:
            self.index = CopyIndex(ids, memory=self.memory, local=self.local)
        self.t_sync = time.perf_counter()

    # -- the cycle ---------------------------------------------------------------------------
    def cycle(self, anchor: int, room: int) -> Cycle:
        """The next cycle: the one queued ahead, else one queued now. Draft → verify queued."""
        c = self.queued or self.start(self.chosen or self.size(room), anchor, room)
        self.queued = self.chosen = None
        if c.verdict is None:  # a hybrid's verify: queued once the last rollback is done
            self.queue_verify(c)
        return c

    def finish(self, c: Cycle, anchor: int, room: int) -> Outcome:
        """Accept → commit → roll back: the cycle's one host sync, its rejected positions rolled
        back and its kept features handed to the drafter."""
        ahead = self.lookahead and c.bs == 1 and room > 1
        if ahead:
            self.settle(c, [anchor])
            self.chosen = self.size(room - 1)
            if self.chosen == 1 and not self.may_copy():
                self.queued = self.start(1, c.verdict[1])
        t_host = time.perf_counter()
        out = c.outcome.tolist()  # the one host sync of the cycle
        n = c.tree.max_depth if c.tree is not None else c.bs - 1
        a, bonus, drafted = int(out[0]), int(out[1]), [int(d) for d in out[2 : 2 + n]]
        path = [int(i) for i in out[2 + n : 2 + 2 * n]] if c.tree is not None else []
        chain = int(out[2 + 2 * n]) if c.tree is not None else a
        own = a - sum(i > c.budget for i in path[:a])  # the rest came down the copy's branch
        if c.copied:
            self.policy.update(n, a)
        elif c.copy:  # what the grafted copy would have committed alone
            same = [t == d for t, d in zip(c.copy, drafted[:a])]
            self.policy.update(len(c.copy), same.index(False) if False in same else len(same))
        committed = drafted[:a] + [bonus]
        lps = None if self.logprobs is None else read_logprobs(out[2 + n :], c.bs, committed)
        if self.con:  # the grammar forgets the rejected drafts and takes the bonus
            self.con.rollback(n - a)
            if not self.con.ended:
                self.con.consume(bonus)
        t_now = time.perf_counter()
        host, seconds = t_host - self.t_sync - self.queue_time, t_now - self.t_sync
        self.t_sync, self.queue_time = t_now, 0.0
        if not ahead:
            self.settle(c, [anchor] + committed[:-1], path[:a])
        # the cost model learns from cycles amid their kind: a plain step between plain steps
        # (the last one before a drafting cycle builds nothing ahead: its interval is short),
        # a drafting cycle after a drafting one (the first after plain steps also appends their
        # context and restarts the pipeline, a one-off that would make drafting look dear)
        steady = self.last_bs > 0 and (c.bs > 1) == (self.last_bs > 1)
        steady = steady and not (ahead and self.queued is None)
        self.last_bs = c.bs
        return Outcome(a, committed, seconds, steady, host, lps, chain, own)

    def ahead(self, anchor: int, room: int) -> None:
        """Queue the next cycle right after the sync, before the host's bookkeeping."""
        if self.queued is None and room > 0 and (self.pipelined or self.chosen):
            self.queued = self.start(self.chosen or self.size(room), anchor, room)
            self.chosen = None

    def close(self) -> None:
        """The request ends: drop a cycle queued and never used, append waiting features."""
        if self.queued is not None and self.queued.verdict is not None:
            self.state.rollback.trim(self.queued.width)
        self.queued = None
        self.ctx.flush()

    # -- its parts ---------------------------------------------------------------------------
    def may_copy(self) -> bool:
        """Whether the next cycle may copy (then it waits for its anchor, not queued ahead)."""
        return self.index is not None and self.policy.paused == 0 and self.index.may_match()

    def copy_cycle(self, anchor: int, key: mx.array, drafts: list[int]) -> Cycle:
        """A cycle whose drafts are copied from earlier text (its q, all mass on each copied
        token, is made in `verify`)."""
        block = mx.array([anchor, *drafts], mx.int32)
        return Cycle(len(drafts) + 1, block, block[1:], None, key, copied=True)

    def start(self, bs: int, anchor: int | mx.array, room: int = 0) -> Cycle:
        """Queue a cycle: the drafter pass for `[anchor, MASK...]` (none at block 1), or drafts
        copied from earlier text where the last tokens repeat (`room` > 1 left), and, unless
        the target is a hybrid (whose rollback must watch its verify), the verify behind it.
        The anchor may still be lazy (the token of a plain step not yet read back)."""
        t = time.perf_counter()
        key, sp = self.key(), self.sp
        first = mx.array(anchor).astype(mx.int32).reshape(1)
        penalty = (
            self.pen.bind(self.state.ids[-self.pen.context_size :] + [anchor]) if self.pen else None
        )
        # every cycle counts down a pause, a plain step queued ahead too (it cannot copy: its
        # anchor is lazy), else a pause begun among such steps would never end
        most = self.policy.length() if self.index is not None else 0
        can_copy = isinstance(anchor, int) and room > 1 and most > 0
        copy = self.index.propose(anchor, min(most, room - 1)) if can_copy else []
        suffixed = bool(copy) and self.index.suffixed
        if copy and self.copy_len is not None:  # as long as the costs say it pays
            n = self.copy_len(len(copy), self.policy)
            if n == 0 and (k := self.policy.probe(len(copy))):  # priced at a fresh start's
                n = self.copy_len(k, CopyPolicy())  # rates: where even those lose, no probe
            copy = copy[:n]
        budget = self.tree() if self.tree is not None and bs > 1 else 0
        grafts = bool(copy and budget) and not self.policy.sure
        if grafts and self.graft is not None:
            grafts = self.graft(len(copy), budget, self.policy)
        if copy and not grafts:  # no drafter pass: its context waits, as after a plain step
            c = self.copy_cycle(anchor, key, copy)
            c.suffixed = suffixed
        elif bs == 1:  # a plain target step: no drafts, no split of the key
            c = Cycle(1, first, mx.zeros((0,), mx.int32), None, key, penalty)
            c.masks = self.con.mask()[None] if self.con else None
        else:
            k_draft, k_verify = mx.random.split(key)
            masks = mx.array([self.pair.drafter.config.mask_token_id] * (bs - 1), mx.int32)
            block = mx.concatenate([first, masks])
            self.ctx.flush()
            if budget:  # a tree of drafts from the same drafter pass
                expand = self.pair.drafter.expansion(block, self.ctx.cache, TREE_K)
                tree = grow(first, expand, bs - 1, budget)
                if copy:  # a doubtful copy that pays on the tree: one more branch of it
                    tree = graft(tree, mx.array(copy, mx.int32))
                c = Cycle(bs, block, tree.tokens[1:], None, k_verify, penalty, tree=tree)
                c.copy, c.suffixed = tuple(copy), suffixed
            elif self.con is None:
                drafts, q = propose(self.pair, block, self.ctx.cache, sp, k_draft, penalty)
                c = Cycle(bs, block, drafts, q, k_verify, penalty)
            else:  # it may draft fewer than bs-1 (it stops after an end-of-sequence token)
                drafts, q, allowed = propose_constrained(
                    self.pair, block, self.ctx.cache, sp, k_draft, penalty, self.con
                )
                n = drafts.shape[0]  # 0: a plain step (nothing the grammar allows to draft)
                c = Cycle(n + 1, block if n else first, drafts, q, k_verify, penalty, allowed)
        if self.state.rollback.hybrid:  # its verify is queued once the last rollback is done
            mx.async_eval(c.drafts)
        else:
            if bs > 1 and queues_layers():  # the drafter runs while the verify is built
                mx.async_eval(c.drafts)
            self.queue_verify(c)
        self.queue_time += time.perf_counter() - t
        return c

    def queue_verify(self, c: Cycle) -> None:
        """Queue the cycle's verify pass and its outcome (`mx.async_eval`)."""
        if c.tree is not None:  # [accepted, bonus, path tokens, path nodes, chain's accepted]
            acc, bonus, path = self.verify_tree(c)
            c.verdict = acc, bonus
            tokens, chain = c.tree.tokens[path], chain_depth(c.tree, acc, path)
            parts = [acc.reshape(1), bonus.reshape(1), tokens, path, chain.reshape(1)]
            c.outcome = mx.concatenate(parts)
            mx.async_eval(c.outcome)
            return
        acc, bonus, logits = self.verify(c)
        c.verdict = acc, bonus
        parts = [acc.reshape(1), bonus.reshape(1), c.drafts]
        if self.logprobs is not None:  # every row's; the host reads the committed ones
            row_tokens = mx.concatenate([c.drafts.astype(mx.int32), bonus.reshape(1)])
            row_tokens = mx.where(mx.arange(c.bs) < acc, row_tokens, bonus)
            rows = logprob_rows(logits, row_tokens, self.logprobs)
            parts = [p.astype(mx.float32) for p in parts] + [rows]
        c.outcome = mx.concatenate(parts)
        mx.async_eval(c.outcome)

    def verify(self, c: Cycle) -> tuple[mx.array, mx.array, mx.array]:
        """One target pass over [anchor, drafts]; (accepted drafts, bonus token, the
        transformed logits [bs, V]), lazily."""
        self.state.rollback.before_verify()
        tokens = c.block if c.bs == 1 else mx.concatenate([c.block[:1], c.drafts])
        logits = self.pair.target(tokens[None], cache=self.state.target_cache)[0]  # [bs, V]
        if c.penalty is not None:  # p gets the same penalties as q, position by position
            logits = c.penalty.apply(logits, c.drafts)
        if c.masks is not None:  # and the same grammar, given the drafts before each position
            logits = mx.where(c.masks, logits, -mx.inf)
        if self.sp.greedy:
            return (*accept_greedy(c.drafts, logits), logits)
        if c.bs == 1:
            return mx.array(0), sample_logits(logits, self.sp, c.key), logits
        p = probabilities(logits, self.sp)
        q = c.q
        if c.copied:  # a copied token is a draft with all of q's mass on it
            q = (mx.arange(p.shape[-1])[None] == c.drafts[:, None]).astype(p.dtype)
        return (*accept_sampled(c.drafts, q, p, c.key), logits)

    def verify_tree(self, c: Cycle) -> tuple[mx.array, mx.array, mx.array]:
        """One target pass over the tree; (accepted depth, bonus token, path [P]), lazily:
        the walk follows the target's argmax, or a draw from p at each node (drafting/tree.py)."""
        c.start = self.state.target_cache[0].offset
        cache = self.state.target_cache
        logits = verify_logits(self.pair.target, c.tree, cache, self.ropes)  # [1+B, V]
        if self.sp.greedy:
            x = mx.argmax(logits, axis=-1)
        else:
            x = sample_logits(logits, self.sp, c.key)  # one independent draw per node
        return walk(c.tree, x)

    def settle(self, c: Cycle, kept: list, path: list[int] | None = None) -> None:
        """Roll back a cycle's rejected positions; its kept features go to the drafter. A
        tree's accepted `path` (node indices) moves to the front of its verified span first."""
        features = self.cap.features()
        if c.tree is None:
            features = features[:, : len(kept)]
        else:
            rows = mx.array([0, *(path or [])], mx.int32)
            keep_path(self.state.target_cache, c.start, rows[1:], len(kept))
            features = features[:, rows]
        self.state.rollback.rollback(c.width - len(kept), len(kept) - 1)
        self.ctx.add(features)
        self.state.ids += kept
        if self.index is not None:
            self.index.extend(kept)
