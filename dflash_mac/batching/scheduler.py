"""The batch scheduler: continuous batching of DFlash requests (issue #36).

`BatchEngine` runs on one thread (the caller's). Each `step()`:
1. ends the rows whose request was cancelled (their caches are handed back at once);
2. admits waiting requests while fewer than `max_batch` are in flight;
3. runs the next prefill chunk of the requests still prefilling, oldest first, up to 512
   tokens in all, in one packed pass (so a long prompt does not stall the others for its whole
   prefill, and prompts that arrive together share the pass) and, for each request whose
   prompt is done, its first token;
4. runs one batched DFlash cycle of every decoding row (batching/ragged.py): one drafter pass, one
   verify, each row's own acceptance and rollback; finished rows leave at once.

A row whose last tokens repeat earlier text (an edit repeating its file) verifies a copy of
what followed there instead (drafting/copies.py), with its own `CopyPolicy`, in the same pass as the
others' blocks: rows of different lengths are packed into one sequence (`forward_rows`), so a
long copy costs its own tokens, not a padding of every row to its length.

Each request's state is one `engine.row.Row`, the same as alone. A request alone in the
engine (nothing else decoding, prefilling or waiting) has its row's cycles run by the
one-request loop instead (`decode.cycles` in `Solo`, given the session's `AutoTuning`): its
`auto` controller with trees, probes and drafts under a grammar, as `generate` runs it. When
another request arrives, the batch takes the row back as it stands, at the cycle boundary.

Each request's events are `decode.GenerationEvent`s, as `speculative_stream` yields them, given
to its `emit` callback. Rows keep their own block size, sampling settings, penalties,
log-probabilities, stop rules and budgets. A row under a grammar (structured output) takes
plain steps with the grammar's mask: its drafts would need a host round trip per position
(`drafts.propose_constrained`), which would stall every row of the batch."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..engine.decode import DecodeState, GenerationConfig, GenerationEvent, cycles, sizes_for
from ..engine.row import (
    Row,
    commit,
    event,
    may_copy,
    open_row,
    prefill_chunks,
    propose_copy,
    remember,
    start,
)
from ..engine.stats import StatsRecorder
from ..engine.verify import read_logprobs
from ..pair import Pair
from ..sizing.batch_rule import BatchBlockRule
from ..sizing.choice import block_size_for
from ..sizing.sizer import BatchSizer
from ..sizing.tuning import AutoTuning
from ..target.capture import FeatureCapture, queues_layers
from .ragged import (
    RowDraft,
    accept_rows,
    forward_rows,
    propose_rows,
    ragged_hooks,
    split_rows,
)


@dataclass
class BatchRequest:
    """One request in the engine. The caller sets the first fields; the engine the rest."""

    ids: list[int]  # the prompt's token ids
    cfg: GenerationConfig
    state: DecodeState  # may hold a cached prefix of `ids` (prompt cache)
    emit: Callable[[GenerationEvent], None]
    should_stop: Callable[[], bool] | None = None
    done: Callable[[BatchRequest], None] | None = None  # after its last event, caches settled
    # -- the engine's
    row: Row | None = None  # its cycle state, once admitted
    chunks: deque = field(default_factory=deque)  # prefill chunks still to run
    finished: bool = False

    def stopped(self) -> bool:
        return self.should_stop is not None and self.should_stop()


@dataclass
class BatchStats:
    """What `/v1/dflash/stats` shows of the batch."""

    max_batch: int
    decoding: int = 0
    prefilling: int = 0
    waiting: int = 0
    cycles: int = 0
    rows: int = 0  # rows over all cycles (rows / cycles: mean occupancy)
    last_block: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # cycles by block size
    copy_cycles: int = 0  # cycles in which some row verified a copy
    copied: int = 0  # copied tokens accepted
    suffix_cycles: int = 0  # cycles in which some row's copy came from earlier answers
    suffixed: int = 0  # those copies' tokens accepted
    prefill_passes: int = 0
    prefill_chunks: int = 0  # chunks over those passes (several requests' share a pass)
    solo_cycles: int = 0  # cycles of a lone request, run by the one-request loop (`Solo`)
    handed_back: int = 0  # lone requests handed back to the batch when another arrived

    def as_dict(self) -> dict:
        mean = self.rows / self.cycles if self.cycles else 0.0
        return {
            "max_batch": self.max_batch,
            "decoding": self.decoding,
            "prefilling": self.prefilling,
            "waiting": self.waiting,
            "cycles": self.cycles,
            "mean_occupancy": round(mean, 3),
            "last_block_size": self.last_block,
            "block_mix": {str(b): n for b, n in sorted(self.blocks.items())},
            "copy_cycles": self.copy_cycles,
            "copied_tokens": self.copied,
            "suffix_cycles": self.suffix_cycles,
            "suffix_tokens": self.suffixed,
            "prefill_passes": self.prefill_passes,
            "prefill_chunks": self.prefill_chunks,
            "solo_cycles": self.solo_cycles,
            "handed_back": self.handed_back,
        }


@dataclass
class Step:
    """A batched cycle built and queued: its rows and sizes, and the lazy arrays its sync
    reads (`outcome` [B, 2 + bs-1]: accepted, bonus, drafts)."""

    rows: list[BatchRequest]
    bs: int
    sizes: list[int]  # the positions each row judges (its block size, or its copy + 1)
    outcome: mx.array
    lp_rows: list[mx.array | None]
    feats: list[mx.array]  # row i's captured target features [width_i, n*H]
    t0: float  # when it was built
    reason: str  # why the rule chose its size
    widths: list[int]  # the positions each row ran (bs, or its copy + 1 in a packed pass)
    copied: list[int]  # each row's copied drafts (0: none)
    suffixed: list[bool]  # each row's copy came from earlier answers (drafting/suffix.py)
    odds: list[mx.array | None]  # a sampled row's acceptance odds (verify.acceptance_odds)

    @property
    def asked(self) -> list[mx.array]:
        return [x for x in self.lp_rows + self.odds if x is not None]


class Solo:
    """A lone request's cycles, run by the one-request loop (`decode.cycles`) on its row, one
    per `step`, until it ends; `close` hands the row back to the batch at the cycle boundary."""

    def __init__(self, pair: Pair, r: BatchRequest, tuning: AutoTuning, rule: BatchSizer):
        self.r, self.rule, self.cycles = r, rule, 0  # cycles run alone
        block = r.cfg.block or block_size_for(pair, None)
        sizes = sizes_for(pair, r.cfg, block, r.state, len(r.ids), tuning, None)
        if sizes.plan is not None:  # the controller's copies go on from what its requests got
            r.row.policy.rates = sizes.plan.copy_rates
        self.events = cycles(pair, r.row, sizes, r.should_stop)

    def step(self) -> bool:
        """One cycle, its event given to the request; False once the request has ended
        (finished or cancelled)."""
        for ev in self.events:
            if ev.accepted > 0:  # a cycle's event, not a cancellation's
                self.cycles += 1
                self.learn(self.r.row.rec)
            self.r.emit(ev)
            if ev.finish_reason is None:
                return True
        return False

    def close(self) -> None:
        """Stop at the cycle boundary: the row's caches hold prompt + committed tokens but its
        anchor, as the batch keeps them."""
        self.events.close()

    def learn(self, rec: StatsRecorder) -> None:
        """The batch's acceptance learns from the cycle's chain of drafts (not a copy's or a
        tree's), as from a batch's rows: the next batch starts from what this drafter does."""
        bs, tree, copied = rec.sizes[-1], rec.trees[-1], rec.copied[-1]
        if bs > 1 and not tree and not copied:
            self.rule.learn(bs, [rec.lengths[-1] - 1])


class BatchEngine:
    """Continuous batching of DFlash requests on one pair (module docstring)."""

    def __init__(
        self,
        pair: Pair,
        max_batch: int = 4,
        block_size: int | None = None,
        auto: bool = True,
        prefill_chunk: int = 512,
        prior: dict[tuple[int, int], float] | None = None,
        rule: BatchSizer | None = None,
        solo: AutoTuning | None = None,
    ):
        """`prior`: the saved cost curve's batched cycles ((B, bs) -> one-row plain steps);
        `rule`: a block rule of the caller's (the cost-curve measurement's); `solo`: what
        `auto` learnt alone (the session's), with which a lone request runs alone (`Solo`;
        None: it stays a batch of one)."""
        self.pair = pair
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.rule = rule or BatchBlockRule(
            block_size or pair.block_size, fixed=not auto, prior=dict(prior or {})
        )
        self.waiting: deque[BatchRequest] = deque()
        self.prefilling: deque[BatchRequest] = deque()
        self.decoding: list[BatchRequest] = []
        self.stats = BatchStats(max_batch)
        self.queued: Step | None = None  # the next plain step, queued ahead of the last sync
        self.t_sync = 0.0  # the last cycle's host sync
        self.tuning = solo
        # earlier answers, for suffix drafting (the session's, kept across requests)
        self.answers = solo.answers if solo is not None else None
        self.solo: Solo | None = None  # the lone request's loop, while it runs alone

    # -- the caller's side -------------------------------------------------------------------
    def add(self, req: BatchRequest) -> None:
        """Queue a request; it joins at the next `step` with a free slot."""
        self.waiting.append(req)
        self._count()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    @property
    def in_flight(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def run(self) -> None:
        """Step until every request added has ended."""
        while self.busy:
            self.step()

    def step(self) -> None:
        """One scheduler iteration (module docstring)."""
        if (solo := self.solo) is not None:
            if self.waiting:  # another request arrived: the batch takes the row back as it is
                solo.close()
                self.solo, self.stats.handed_back = None, self.stats.handed_back + 1
            else:
                before = solo.cycles
                going = solo.step()
                self.stats.solo_cycles += solo.cycles - before
                if going:
                    return self._count()
                self.solo = None  # the request ended (its last event is out, a cancelled one too)
                self.decoding.remove(solo.r)
                self._end(solo.r)
        cap = FeatureCapture(self.pair.target, self.pair.layer_ids, queue=queues_layers())
        with ragged_hooks(self.pair), cap, mx.stream(generation_stream):
            self._drop_stopped()
            while self.waiting and self.in_flight < self.max_batch:
                self._admit(self.waiting.popleft())
            if self.prefilling:
                self._prefill(cap)
            if self.decoding and not self._alone():
                self._cycle(cap)
        if self._alone():
            self.solo = Solo(self.pair, self.decoding[0], self.tuning, self.rule)
        self._count()

    def _alone(self) -> bool:
        """Whether the next cycle is a lone request's (with `solo`): one request decoding,
        nothing else in the engine and no batched step queued for it."""
        lone = len(self.decoding) == 1 and not (self.prefilling or self.waiting or self.queued)
        return lone and self.tuning is not None and not self.decoding[0].finished

    # -- admission and prefill ---------------------------------------------------------------
    def _admit(self, r: BatchRequest) -> None:
        cfg, ids = r.cfg, r.ids
        block = cfg.block.size if cfg.block else self.rule.bs_max
        auto = cfg.block.auto if cfg.block else True
        r.row = open_row(self.pair, ids, cfg, r.state, block, auto)
        # the chunks `decode.prefill` runs (same boundaries: the same numbers as alone)
        step = min(cfg.prefill_step_size, self.prefill_chunk)
        r.chunks = deque(prefill_chunks(ids, len(r.state.ids), step, r.state.record))
        self.prefilling.append(r)

    def _prefill(self, cap: FeatureCapture) -> None:
        """The next chunk of each prefilling request, oldest first, while they come to at most
        `prefill_chunk` tokens (one chunk at least), in one packed target pass: requests that
        arrive together share its weight reads, and each row keeps the chunks it gets alone."""
        batch, total = [], 0
        for r in self.prefilling:
            n = len(r.chunks[0])
            if batch and total + n > self.prefill_chunk:
                break
            batch.append(r)
            total += n
        chunks = [r.chunks.popleft() for r in batch]
        self.stats.prefill_passes += 1
        self.stats.prefill_chunks += len(chunks)
        lengths = [len(c) for c in chunks]
        logits = forward_rows(self.pair, [mx.array(c) for c in chunks], [r.state for r in batch])
        logits = split_rows(logits, lengths) if not isinstance(logits, list) else logits
        feats = split_rows(cap.features(), lengths)  # row i [L_i, n*H]
        for r, f in zip(batch, feats):
            self.pair.drafter.extend_context(f[None], r.state.draft_cache)
        last = [lg[-1] for r, lg in zip(batch, logits) if not r.chunks]  # only those are read
        mx.eval([c.state for r in batch for c in r.state.target_cache], *last)
        self.t_sync = time.perf_counter()  # a cycle's time does not include the prefill
        for r, chunk, lg in zip(batch, chunks, logits):
            self._prefilled(r, chunk, lg[-1])

    def _prefilled(self, r: BatchRequest, chunk: list[int], last: mx.array) -> None:
        """A chunk of `r` ran (`last`: its last position's logits [V]); after the prompt's
        last chunk, its first token."""
        state = r.state
        pos = len(state.ids) + len(chunk)
        state.ids = r.ids[:pos]
        if state.record:  # the prompt cache keeps these rows
            state.record.chunk(state.ids, state.target_cache, state.draft_cache)
        if r.chunks:
            return
        self.prefilling.remove(r)
        text, lps = start(r.row, last, self.answers)
        r.emit(event(r.row, text, 0, 0, lps, generated=1))
        if r.row.out.finish_reason is not None:
            return self._end(r)
        self.decoding.append(r)

    # -- the batched cycle -------------------------------------------------------------------
    def _cycle(self, cap: FeatureCapture) -> None:
        """One batched cycle: the step queued ahead of the last sync if there is one, else one
        built now; the next plain step queued on this one's lazy tokens where it may be (as
        `CyclePipeline` does alone); the one host sync; each row's bookkeeping."""
        c, self.queued = self.queued, None
        if c is None:
            c = self._build(self.decoding, self._choose(self.decoding, 0), cap)
        self.ahead(c, cap)
        mx.eval(c.outcome, *c.asked)  # the cycle's one host sync
        out = c.outcome.tolist()
        flats = [None if x is None else x.tolist() for x in c.lp_rows]
        odds = [() if x is None else tuple(x.tolist()) for x in c.odds]
        now = time.perf_counter()
        seconds, self.t_sync = now - max(c.t0, self.t_sync), now
        rows, bs, sizes = c.rows, c.bs, c.sizes
        # acceptance is learnt from the rows that could accept all of the batch's drafts
        full = [
            i
            for i, (n, k, r) in enumerate(zip(sizes, c.copied, rows))
            if n == bs and not k and not r.finished
        ]
        # a cycle with copies is no (B, bs) cycle: its drafting rows' acceptance still counts
        accepted, sampled = [out[i][0] for i in full], [odds[i] for i in full]
        self.rule.update(len(rows), bs, None if any(c.copied) else seconds, accepted, sampled)
        self.stats.cycles += 1
        self.stats.copy_cycles += any(c.copied)
        self.stats.suffix_cycles += any(c.suffixed)
        self.stats.rows += len(rows)
        self.stats.last_block = bs
        self.stats.blocks[bs] = self.stats.blocks.get(bs, 0) + 1
        leaving = []
        for i, (r, verdict) in enumerate(zip(rows, out)):
            if r.finished:  # cancelled while its step was queued: nothing of it is kept
                continue
            row, (a, bonus) = r.row, verdict[:2]
            committed = verdict[2 : 2 + a] + [bonus]
            kept = [row.anchor] + committed[:-1]
            features = c.feats[i][None, : len(kept)]
            commit(r.state, row.ctx, row.index, features, c.widths[i], kept)
            row.anchor = bonus
            if c.copied[i]:
                row.policy.update(c.copied[i], a)
                self.stats.copied += a
                self.stats.suffixed += a if c.suffixed[i] else 0
            if row.con is not None and not row.con.ended:  # a plain step: no drafts to forget
                row.con.consume(bonus)
            before = row.out.count
            text = row.out.push(committed, r.cfg.max_tokens)
            copied, suffixed = bool(c.copied[i]), c.suffixed[i]
            row.rec.cycle(sizes[i], a + 1, 0.0, c.reason, row.ctx.rows, copied, suffixed=suffixed)
            lps = None if flats[i] is None else read_logprobs(flats[i], sizes[i], committed)
            r.emit(event(row, text, before, a + 1, lps))
            if row.out.finish_reason is not None or r.stopped():
                leaving.append(r)
        for r in leaving:
            self.decoding.remove(r)
            self._end(r, cancelled=r.row.out.finish_reason is None)

    def _choose(self, rows: list[BatchRequest], spent: int) -> int:
        """The batch's block size for `rows`, each `spent` tokens further than it stands."""
        room = max(r.cfg.max_tokens - r.row.out.count - spent for r in rows)
        return self.rule.choose(len(rows), min(room, max(self._cap(r) for r in rows)))

    def _cap(self, r: BatchRequest) -> int:
        """The largest block a row may take (a grammar's row: plain steps)."""
        return 1 if r.row.con is not None else r.cfg.block.size if r.cfg.block else self.rule.bs_max

    def ahead(self, c: Step, cap: FeatureCapture) -> None:
        """After a plain step, queue the next one on its still-lazy tokens, before its sync
        (the device runs it while the host reads and does the rows' bookkeeping), where the
        rule picks a plain step again and no row's penalties, grammar or copy needs its token
        on the host first. Rows that leave after the sync have that position trimmed (`_end`)."""
        rows = self.decoding
        if c.bs != 1 or any(c.copied) or not rows or self._alone():  # alone: `Solo` is next
            return
        if any(r.cfg.penalties or r.row.con is not None or self._may_copy(r) for r in rows):
            return
        if all(r.cfg.max_tokens - r.row.out.count <= 1 for r in c.rows):
            return  # the step ends every row
        if self._choose(rows, 1) != 1:
            return
        lazy = {id(r): c.outcome[i, 1:2] for i, r in enumerate(c.rows)}
        anchors = [lazy.get(id(r), mx.array([r.row.anchor], mx.int32)) for r in rows]
        self.queued = self._build(rows, 1, cap, mx.stack(anchors))

    def _may_copy(self, r: BatchRequest) -> bool:
        """Whether the row's next cycle may copy (then its anchor is needed on the host)."""
        return may_copy(r.row.index, r.row.policy)

    def _copy(self, r: BatchRequest, queued: bool) -> list[int]:
        """The row's copy for this cycle: what followed its last tokens earlier, as long as
        its policy allows and its budget has room for ([]: none), as alone. A step `queued`
        ahead cannot copy (its anchors are lazy) but counts down a pause, as alone."""
        anchor = None if queued else r.row.anchor  # a step queued ahead: its anchors are lazy
        return propose_copy(r.row.index, r.row.policy, anchor, r.cfg.max_tokens - r.row.out.count)

    def _build(
        self, rows: list[BatchRequest], bs: int, cap: FeatureCapture, first: mx.array | None = None
    ) -> Step:
        """Queue a batched cycle of `rows` at block `bs` (drafts, verify, verdicts), lazily;
        `first` [B, 1]: the rows' anchors (default: their committed ones, and then rows may
        copy instead of drafting)."""
        t0 = time.perf_counter()
        reason = self.rule.last_reason
        sizes = [min(bs, self._cap(r)) for r in rows]  # a row never drafts past its own size
        sps = [r.cfg.sampling for r in rows]
        keys = [r.row.key() for r in rows]
        pens = [  # each row's penalties given its committed tail and anchor
            p.bind(r.state.ids[-p.context_size :] + [r.row.anchor])
            if (p := r.cfg.penalties)
            else None
            for r in rows
        ]
        copies = [self._copy(r, queued=first is not None) for r in rows]
        suffixed = [bool(cp) and r.row.index.suffixed for r, cp in zip(rows, copies)]
        if first is None:
            first = mx.array([[r.row.anchor] for r in rows], mx.int32)  # [B, 1]
        drafts: list[RowDraft | None] = [None] * len(rows)
        verify_keys = list(keys)
        drafting = [i for i, cp in enumerate(copies) if not cp]  # rows the drafter drafts for
        if bs > 1 and drafting:
            split = [mx.random.split(keys[i]) for i in drafting]  # (drafting, verifying) as alone
            mask = self.pair.drafter.config.mask_token_id
            anchors = first[mx.array(drafting)] if len(drafting) < len(rows) else first
            blocks = mx.concatenate([anchors, mx.full((len(drafting), bs - 1), mask, mx.int32)], 1)
            for i in drafting:
                rows[i].row.ctx.flush()
            caches = [rows[i].row.ctx.cache for i in drafting]
            subset = [sps[i] for i in drafting], [s[0] for s in split], [pens[i] for i in drafting]
            for i, d, s in zip(drafting, propose_rows(self.pair, blocks, caches, *subset), split):
                drafts[i], verify_keys[i] = d, s[1]
        widths = [1 + len(cp) if cp else bs for cp in copies]
        for i, cp in enumerate(copies):
            if cp:  # greedy needs no q; sampled gets its one-hot below, once V is known
                drafts[i], sizes[i] = RowDraft(mx.array(cp, mx.int32), None), widths[i]
            elif drafts[i] is None:  # a plain step (bs 1)
                drafts[i] = RowDraft(mx.zeros((0,), mx.int32), None)
        rows_tokens = [
            mx.concatenate([first[i], d.drafts.astype(mx.int32)]) for i, d in enumerate(drafts)
        ]
        logits = forward_rows(self.pair, rows_tokens, [r.state for r in rows])  # row i [w_i, V]
        feats = split_rows(cap.features(), widths)  # row i [w_i, n*H]
        for i, cp in enumerate(copies):
            if cp and not sps[i].greedy:  # a copied token is a draft with all of q's mass on it
                vocab = mx.arange(logits[i].shape[-1])[None]
                drafts[i].q = (vocab == drafts[i].drafts[:, None]).astype(mx.float32)
        asks = [r.cfg.logprobs for r in rows]
        masks = [None if r.row.con is None else r.row.con.mask() for r in rows]
        plain = bs == 1 and not any(copies)
        verdict, lp_rows, odds = accept_rows(
            logits, None if plain else drafts, sps, verify_keys, sizes, pens, asks, masks
        )
        outcome = verdict
        if not plain:  # each row's drafts, padded to the widest
            w = max(widths) - 1
            pad = [mx.pad(t[1:], (0, w - t.shape[0] + 1)) for t in rows_tokens]
            outcome = mx.concatenate([verdict, mx.stack(pad)], 1)
        copied = [len(cp) for cp in copies]
        step = Step(
            list(rows),
            bs,
            sizes,
            outcome,
            lp_rows,
            feats,
            t0,
            reason,
            widths,
            copied,
            suffixed,
            odds,
        )
        mx.async_eval(outcome, *step.asked)
        return step

    # -- leaving ----------------------------------------------------------------------------
    def _drop_stopped(self) -> None:
        for r in [r for r in self.waiting if r.stopped()]:
            self.waiting.remove(r)
            self._end(r, cancelled=True)
        for r in [r for r in self.prefilling if r.stopped()]:
            self.prefilling.remove(r)
            self._end(r, cancelled=True)
        for r in [r for r in self.decoding if r.stopped()]:
            self.decoding.remove(r)
            self._end(r, cancelled=True)

    def _end(self, r: BatchRequest, cancelled: bool = False) -> None:
        """The request leaves: a last event if it was cut short, its caches trimmed to
        exactly prompt + kept output, then `done`."""
        r.finished = True
        if self.queued is not None and any(q is r for q in self.queued.rows):  # its queued step
            r.state.rollback.trim(1)
        row = r.row  # None: never admitted
        if row is not None and cancelled:
            row.out.finish_reason = "cancelled"
            r.emit(event(row, row.out.flush(), row.out.count, 0))
        if row is not None:
            row.ctx.flush()
        if row is not None and not r.chunks:  # prefilled: the prompt and the kept output
            r.state.trim_to(len(r.ids) + row.out.count)
            remember(row, self.answers)  # later requests may draft from its answer
        mx.eval([c.state for c in r.state.target_cache + r.state.draft_cache if not c.empty()])
        if r.done is not None:
            r.done(r)

    def _count(self) -> None:
        s = self.stats
        s.decoding, s.prefilling, s.waiting = (
            len(self.decoding),
            len(self.prefilling),
            len(self.waiting),
        )
