"""Continuous batching (batching/ragged.py, batching/scheduler.py): every row decodes exactly as
it would alone.

Each engine path runs on a worker thread (serve's set-up); the reference BLAS is row-invariant,
so a batched row's logits equal the row's own bitwise and greedy tokens are identical."""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import replace

import mlx.core as mx
import pytest
from dflash_mac.models.penalties import Penalties, PenaltyContext
from helpers.lossy import accepting_every_draft
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.generate import generate_step
from test_copydraft import PERIODIC
from test_dflash2 import d2_pair, small_d2_pair  # noqa: F401  (fixtures)
from test_penalties import BIAS, PEN, exact_penalised_joint
from test_sampling import PROMPT, chi_square_p, exact_joint, small_pair  # noqa: F401  (fixture)

from dflash_mac.api import make_config
from dflash_mac.batching import ragged, scheduler
from dflash_mac.batching.ragged import batch_reason, forward_rows, ragged_hooks
from dflash_mac.batching.scheduler import BatchEngine, BatchRequest
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.engine.row import open_row
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.sizing.acceptance import positions
from dflash_mac.sizing.batch_rule import BatchBlockRule
from dflash_mac.sizing.choice import BlockChoice

PROMPTS = ["def add(a, b):", "import os", "class Stack:", "hello world the quick brown fox"]
V_TINY = 320  # the tiny pair's vocabulary (the oracle's drafts must be in it)
CHUNK = 512  # the engine's prefill chunk; alone runs get the same (same numbers)


class Thread:
    """One daemon worker thread for the module (it never ends: MLX aborts at exit when a
    thread that ran compiled functions has ended)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append(fn())
            except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
                box.append(e)
            done.set()

    def __call__(self, fn, timeout: float = 300):
        box, done = [], threading.Event()
        self.jobs.put((fn, box, done))
        assert done.wait(timeout), "the worker thread timed out"
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]


@pytest.fixture(scope="module")
def on_thread():
    return Thread()


def config(max_tokens: int, **kw) -> GenerationConfig:
    kw.setdefault("copy", False)
    kw.setdefault("prefill_step_size", CHUNK)
    return GenerationConfig(max_tokens, use_eos=False, **kw)


def alone(pair, ids, cfg) -> list[int]:
    return [t for e in speculative_stream(pair, ids, cfg) for t in e.tokens]


def batched(pair, jobs, engine: BatchEngine, stop_after=None, late=None) -> list[dict]:
    """Run `jobs` [(ids, cfg)] through `engine`; `stop_after` {job: tokens} cancels a job once
    it has that many tokens; `late` {job: steps} adds a job only after that many steps."""
    stop_after, late = stop_after or {}, late or {}
    results = [{"tokens": [], "reason": None, "req": None} for _ in jobs]

    def request(k):
        ids, cfg = jobs[k]
        res = results[k]

        def emit(ev):
            res["tokens"] += ev.tokens
            res["reason"] = ev.finish_reason

        stop = (lambda: len(res["tokens"]) >= stop_after[k]) if k in stop_after else None
        res["req"] = BatchRequest(ids, cfg, DecodeState(pair), emit, stop)
        return res["req"]

    for k in range(len(jobs)):
        if k not in late:
            engine.add(request(k))
    steps = 0
    while engine.busy or any(s >= steps for s in late.values()):
        for k, s in late.items():
            if s == steps:
                engine.add(request(k))
        engine.step()
        steps += 1
    return results


def test_the_tiny_pair_batches(tiny_pair):
    assert batch_reason(tiny_pair) is None


def test_a_row_under_a_grammar_takes_plain_steps_beside_drafting_rows(tiny_pair, on_thread):
    """Structured output in a batch: the grammar's row commits what it commits alone (valid
    JSON, ended by the grammar) in plain steps; the rows beside it draft as usual."""

    def run():
        ids = [tiny_pair.tokenizer.encode(p) for p in PROMPTS[:3]]
        schema = make_config(40, json_schema={"type": "object"}, copy=False)
        jobs = [(ids[0], replace(schema, prefill_step_size=CHUNK, use_eos=False))]
        jobs += [(i, config(40, block=BlockChoice(5))) for i in ids[1:]]
        refs = [alone(tiny_pair, i, cfg) for i, cfg in jobs]
        engine = BatchEngine(tiny_pair, 3, 5, auto=False)
        return refs, batched(tiny_pair, jobs, engine), engine

    refs, got, engine = on_thread(run)
    assert [r["tokens"] for r in got] == refs
    text = tiny_pair.tokenizer.decode([t for t in refs[0] if t not in tiny_pair.eos_ids])
    assert isinstance(json.loads(text), dict) and got[0]["reason"] == "stop"
    assert set(got[0]["req"].row.rec.sizes) == {1} and max(got[1]["req"].row.rec.sizes) == 5


def test_batched_forward_and_ragged_rollback_equal_each_row_alone(tiny_pair, on_thread):
    """Rows of different cache lengths, verified together and trimmed by different amounts,
    give bitwise the logits and caches each row gets by itself, block after block."""

    def run():
        pair = tiny_pair
        prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
        rows = [DecodeState(pair) for _ in prompts]
        solo = [DecodeState(pair) for _ in prompts]
        for p, a, b in zip(prompts, rows, solo):
            for s in (a, b):
                mx.eval(pair.target(mx.array(p)[None], cache=s.target_cache))
        rng = mx.random.key(1)
        for bs, trims in [
            (5, [0, 4, 2, 1]),
            (3, [2, 0, 1, 2]),
            (1, [0, 0, 0, 0]),
            (8, [7, 3, 0, 5]),
        ]:
            tokens = mx.random.randint(0, 200, (len(rows), bs), key=rng)
            rng = mx.random.split(rng)[0]
            with ragged_hooks(pair):
                together = forward_rows(pair, tokens, rows)
            for i, (s, n) in enumerate(zip(solo, trims)):
                own = pair.target(tokens[i : i + 1], cache=s.target_cache)
                assert mx.array_equal(together[i], own[0]).item(), (bs, i)
                rows[i].rollback.trim(n)
                s.rollback.trim(n)
            for a, b in zip(rows, solo):
                assert a.target_cache[0].offset == b.target_cache[0].offset
                for ca, cb in zip(a.target_cache, b.target_cache):
                    ka, kb = ca.state[0], cb.state[0]
                    assert mx.array_equal(ka[..., : ca.offset, :], kb[..., : cb.offset, :]).item()

    on_thread(run)


@pytest.mark.parametrize("block", [BlockChoice(2), BlockChoice(5), BlockChoice(8, auto=True)])
def test_batched_greedy_is_token_identical_to_each_request_alone(tiny_pair, on_thread, block):
    """Ragged prompts, budgets and (with the oracle at a 30 % error rate) ragged acceptance."""

    def run():
        pair = tiny_pair
        jobs = [(pair.tokenizer.encode(p), config(24 + 9 * k)) for k, p in enumerate(PROMPTS)]
        refs = [alone(pair, ids, config(cfg.max_tokens, block=block)) for ids, cfg in jobs]
        engine = BatchEngine(pair, 4, block.size, block.auto)
        got = batched(pair, jobs, engine)
        assert [r["tokens"] for r in got] == refs
        assert all(r["reason"] == "length" for r in got)
        assert engine.stats.rows / engine.stats.cycles > 2  # they did decode together
        return refs

    refs = on_thread(run)
    assert all(len(r) == 24 + 9 * k for k, r in enumerate(refs))


def test_rows_of_different_block_sizes_share_a_batch_each_as_alone(tiny_pair, on_thread):
    """Block sizes 1, 3, 6 and `auto` up to 8 in one batch: each row drafts up to its own size
    and its tokens are those of the request alone (the oracle, wrong 30 % of the time, gives
    ragged acceptance)."""
    blocks = [BlockChoice(1), BlockChoice(3), BlockChoice(6), BlockChoice(8, auto=True)]

    def run():
        ids = [tiny_pair.tokenizer.encode(p) for p in PROMPTS]
        ref = [t for t, _ in generate_step(mx.array(ids[0]), tiny_pair.target, max_tokens=40)]
        oracle = OracleDrafter(tiny_pair.drafter, ids[0] + ref, V_TINY, error_rate=0.3)
        pair = with_drafter(tiny_pair, oracle)
        jobs = [(i, config(40, block=b)) for i, b in zip(ids, blocks)]
        refs = [alone(pair, i, cfg) for i, cfg in jobs]
        engine = BatchEngine(pair, 4, 8, auto=False)
        got = batched(pair, jobs, engine)
        return refs, got, engine

    refs, got, engine = on_thread(run)
    assert [r["tokens"] for r in got] == refs
    assert engine.stats.blocks.get(8, 0) > 0 and engine.stats.rows / engine.stats.cycles > 2
    for r, b in zip(got, blocks):  # each row's own cycles: never past its size, and up to it
        sizes = r["req"].row.rec.sizes
        assert max(sizes) == b.size, (b, sizes)
    assert sum(got[0]["req"].row.rec.lengths) == 40 - 1  # block 1: a plain step per token


def test_oracle_ragged_acceptance_matches_plain_decoding(tiny_pair, on_thread):
    def run():
        prompts = [tiny_pair.tokenizer.encode(p) for p in PROMPTS[:3]]
        refs = [
            [t for t, _ in generate_step(mx.array(p), tiny_pair.target, max_tokens=30)]
            for p in prompts
        ]
        # one oracle per row would need a per-row drafter: one sequence, three prompts that
        # share it give each row its own (mostly wrong) drafts
        assert tiny_pair.drafter.config.vocab_size == V_TINY
        oracle = OracleDrafter(tiny_pair.drafter, prompts[0] + refs[0], V_TINY, error_rate=0.3)
        pair = with_drafter(tiny_pair, oracle)
        engine = BatchEngine(pair, 3, 4, auto=False)
        got = batched(pair, [(p, config(30)) for p in prompts], engine)
        return refs, [r["tokens"] for r in got], engine

    refs, got, engine = on_thread(run)
    assert got == refs
    assert engine.stats.cycles < 3 * 30  # some drafts were accepted


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(tiny_pair, on_thread):
    def run():
        pair = tiny_pair
        jobs = [(pair.tokenizer.encode(p), config(32)) for p in PROMPTS]
        refs = [alone(pair, ids, config(32, block=BlockChoice(4))) for ids, _ in jobs]
        got = batched(pair, jobs, BatchEngine(pair, 4, 4, auto=False), stop_after={1: 6})
        return refs, got

    refs, got = on_thread(run)
    assert got[1]["reason"] == "cancelled" and 6 <= len(got[1]["tokens"]) < 32
    assert got[1]["tokens"] == refs[1][: len(got[1]["tokens"])]
    state = got[1]["req"].state  # its caches hold exactly prompt + kept output (minus pending)
    assert len(state.ids) <= len(got[1]["req"].ids) + len(got[1]["tokens"])
    assert state.target_cache[0].offset == len(state.ids)
    for k in (0, 2, 3):
        assert got[k]["tokens"] == refs[k] and got[k]["reason"] == "length"


def test_requests_admitted_during_decoding_join_and_stay_exact(tiny_pair, on_thread):
    def run():
        pair = tiny_pair
        long_prompt = pair.tokenizer.encode(" ".join(PROMPTS * 12))
        jobs = [(pair.tokenizer.encode(p), config(28)) for p in PROMPTS[:2]]
        jobs.append((long_prompt, config(20, prefill_step_size=64)))  # chunked prefill
        jobs.append((pair.tokenizer.encode(PROMPTS[3]), config(16)))
        refs = [
            alone(
                pair,
                ids,
                config(c.max_tokens, block=BlockChoice(3), prefill_step_size=c.prefill_step_size),
            )
            for ids, c in jobs
        ]
        engine = BatchEngine(pair, 4, 3, auto=False)
        seen = []
        got = batched(pair, jobs, engine, late={2: 3, 3: 5})
        seen.append(engine.stats.as_dict())
        return refs, got, seen, len(long_prompt)

    refs, got, seen, n_long = on_thread(run)
    assert n_long > 4 * 64  # the late long prompt took several interleaved chunks
    assert [r["tokens"] for r in got] == refs
    assert seen[0]["cycles"] > 0 and seen[0]["decoding"] == 0


class Counting(BatchEngine):
    """The engine, counting the plain steps it queued ahead of a sync."""

    ahead_steps = 0

    def ahead(self, c, cap) -> None:
        super().ahead(c, cap)
        self.ahead_steps += self.queued is not None


def test_plain_steps_queued_ahead_keep_every_row_exact(tiny_pair, on_thread):
    """A batch of plain steps queues each step on the last one's lazy tokens: rows that end,
    are cancelled or join meanwhile still get exactly their tokens alone (a seeded sampled
    row too), and a row that leaves has the queued position trimmed from its cache."""

    def run():
        pair = tiny_pair
        sp = SamplingParams(temperature=0.8)
        cfgs = [config(10), config(24), config(18, sampling=sp, seed=7), config(30), config(12)]
        jobs = [(pair.tokenizer.encode(PROMPTS[k % 4]), c) for k, c in enumerate(cfgs)]
        refs = [alone(pair, ids, replace(c, block=BlockChoice(1))) for ids, c in jobs]
        engine = Counting(pair, 4, 1, auto=False)
        got = batched(pair, jobs, engine, stop_after={3: 9}, late={4: 6})
        return refs, got, engine.ahead_steps

    refs, got, ahead = on_thread(run)
    assert ahead > 10  # most steps were queued ahead
    for k, (ref, g) in enumerate(zip(refs, got)):
        n = len(g["tokens"])
        assert g["tokens"] == ref[:n], k
        state = g["req"].state  # prompt + kept output, the last token pending
        assert len(state.ids) == len(g["req"].ids) + n - 1, k
        assert state.target_cache[0].offset == len(state.ids), k
    assert got[3]["reason"] == "cancelled" and 9 <= len(got[3]["tokens"]) < 30
    assert all(got[k]["reason"] == "length" and got[k]["tokens"] == refs[k] for k in (0, 1, 2, 4))


def test_the_batch_rule_times_each_size_then_takes_the_best():
    rule = BatchBlockRule(8)
    chosen = []
    for _ in range(30):
        bs = rule.choose(4, 100)
        chosen.append(bs)
        # a verify costs more as batch x block grows; drafts are accepted 60 % of the time
        rule.update(4, bs, 0.01 * (1 + 0.4 * (bs > 1) + 0.08 * 4 * bs), [2, 1, 3, 0])
    assert set(chosen[:12]) == {1, 2, 4, 8}  # each candidate timed
    assert rule.last_reason in ("best", "revisit")
    rates = {s: 4 * rule.expected(s) / rule.cost[(4, s)] for s in rule.candidates}
    assert chosen[-1] == max(rates, key=rates.get)
    assert rule.choose(4, 3) <= 3  # never wider than the room left
    weak = BatchBlockRule(8)  # a drafter that is always wrong: wide blocks are never timed
    for _ in range(20):
        bs = weak.choose(2, 100)
        weak.update(2, bs, 0.01 * (1 + 0.5 * (bs > 1) + 0.1 * bs), [0, 0])
    assert (2, 8) not in weak.timed and weak.choose(2, 100) == 1
    assert BatchBlockRule(6, fixed=True).choose(8, 100) == 6


def test_a_measured_curve_by_batch_size_spares_the_rule_its_timing():
    def cost(bs: int) -> float:
        return 0.01 * (1 + 0.4 * (bs > 1) + 0.08 * 4 * bs)

    prior = {(4, s): cost(s) / 0.005 for s in (1, 2, 4, 8)}  # in one-row plain steps
    rule, chosen = BatchBlockRule(8, prior=prior), []
    for _ in range(6):
        bs = rule.choose(4, 100)
        chosen.append(bs)
        rule.update(4, bs, cost(bs), [2, 1, 3, 0])
    best = max(rule.candidates, key=lambda s: rule.expected(s) / cost(s))
    assert chosen[:3] == [1, 1, 1]  # only the plain batched step is timed
    assert chosen[3:] == [best] * 3 and rule.last_reason == "best"
    assert (4, 8) not in rule.timed or best == 8
    # a prior that is wrong is corrected by the measured cost of what it picked
    liar = BatchBlockRule(8, prior={(4, s): 1.0 for s in (1, 2, 4, 8)})  # "wide is free"
    for _ in range(30):
        bs = liar.choose(4, 100)
        liar.update(4, bs, 0.01 * (1 + 2.0 * bs), [0, 0, 0, 0])  # and drafts never land
    assert liar.choose(4, 100) == 1
    # another batch size without a prior is timed as before
    assert rule.choose(2, 100) == 1 and rule.last_reason == "timing"


def test_the_cost_curve_times_batched_cycles_and_serve_takes_them(tiny_pair, on_thread, tmp_path):
    from dflash_mac import calibrate
    from dflash_mac.bench.costcurve import render
    from dflash_mac.sizing.cost import CostCurve
    from dflash_mac.sizing.tuning import AutoTuning

    def run():
        return calibrate.measure_batches(tiny_pair, 4, 0.01, batches=(2, 4), context=16, cycles=2)

    part = on_thread(run)
    assert set(part["batches"]) == {"2", "4"}
    assert all(set(row) == {"1", "2", "4"} for row in part["batches"].values())
    assert all(v > 0 for row in part["batches"].values() for v in row.values())
    curve = {"ratios": {"1": 1.0, "2": 1.4}, "seconds": {"1": 0.01, "2": 0.014}} | part
    assert "Batched cycles" in render(curve)
    path = calibrate.save(curve, tmp_path / "curve.json")
    tuning = AutoTuning(greedy_curve=CostCurve.load(path))
    engine = BatchEngine(tiny_pair, 4, 4, prior=tuning.batch_prior)
    assert engine.rule.prior[(4, 2)] == pytest.approx(part["batches"]["4"]["2"])


def batch_samples(pair, sp: SamplingParams, n: int) -> list[tuple]:
    """n seeded requests of 3 tokens through the engine, 8 at a time; every other one has
    block size 2 (it judges one of the batch's three drafts)."""
    engine, out = BatchEngine(pair, 8, 4, auto=False), []
    blocks = [BlockChoice(4), BlockChoice(2)]
    jobs = [
        ([1, 4, 2, 0, 0], config(3, sampling=sp, seed=s, block=blocks[s % 2])) for s in range(n)
    ]
    for r in batched(pair, jobs, engine):
        out.append(tuple(r["tokens"]))
    return out


@pytest.mark.slow
def test_batched_sampling_is_the_targets_distribution(small_pair, on_thread):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp)
    samples = on_thread(lambda: batch_samples(small_pair, sp, 1500))
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_lossy_batched_rule_is_detected(small_pair, on_thread, monkeypatch):  # noqa: F811
    """The chi-square check has teeth: accepting every draft in the batch fails it."""
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp)
    real = ragged.accept_sampled
    accept_all = accepting_every_draft(real)

    monkeypatch.setattr(ragged, "accept_sampled", accept_all)
    samples = on_thread(lambda: batch_samples(small_pair, sp, 600))
    assert chi_square_p(samples, joint) < 1e-6


def test_one_at_a_time_read_as_waves_times_each_wave_from_its_arrival():
    from dflash_mac.bench.concurrency import Stream, Way, as_waves, in_waves

    assert in_waves(2, 5) == [range(0, 2), range(2, 4), range(4, 5)]
    # three requests served in turn, 1 s each, the first token 0.5 s into each turn
    turns = [Stream([7] * 4, ttft=k + 0.5, end=k + 1.0, start=float(k)) for k in range(3)]
    alone = Way("dflash-one-at-a-time", 3.0, turns)
    assert [s.ttft for s in as_waves(alone, 1).streams] == [0.5, 0.5, 0.5]
    assert [s.ttft for s in as_waves(alone, 2).streams] == [0.5, 1.5, 0.5]  # waits in its wave
    assert [s.ttft for s in as_waves(alone, 3).streams] == [0.5, 1.5, 2.5]
    waves = as_waves(alone, 2)
    assert waves.wall == 3.0 and waves.summary()["ttft_max_s"] == 1.5
    assert [s.decode_tps for s in waves.streams] == [6.0] * 3  # 3 tokens in 0.5 s


def test_bench_concurrency_runs_three_ways_and_checks_greedy_identity(tiny_pair, on_thread):
    from dflash_mac.bench.command import parse_levels
    from dflash_mac.bench.concurrency import concurrency_markdown, measure_concurrency, validate
    from dflash_mac.bench.inputs import BenchError
    from dflash_mac.sizing.tuning import AutoTuning

    ids = [tiny_pair.tokenizer.encode(p) for p in PROMPTS[:2]]
    settings = [("greedy", SamplingParams())]
    block = BlockChoice(4, auto=True)
    rows = on_thread(
        lambda: measure_concurrency(
            tiny_pair, ids, [1, 2], settings, 12, block, AutoTuning(), use_eos=False
        )
    )
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert [r["waves"] for r in rows] == [2, 1]  # every level serves the same two requests
    assert [r["identical"] for r in rows] == ["2/2", "2/2"]
    for r in rows:
        names = [w["way"] for w in r["ways"]]
        assert names == ["dflash-batched", "dflash-one-at-a-time", "mlx-lm-batched-plain"]
        assert [w["tokens"] for w in r["ways"][:2]] == [24, 24]
        assert r["ways"][2]["tokens"] > 0  # mlx-lm stops at EOS
        assert r["batched_vs_alone"] > 0 and r["batched_vs_plain"] > 0
        # the measured batched run's cycles by block size, and a lone request's (run as
        # alone, as the server runs it); each commits a token or more
        cycles = sum(r["batch_blocks"].values()) + r["solo_cycles"]
        assert 0 < cycles <= 24
    assert rows[0]["solo_cycles"] > 0 and not rows[0]["batch_blocks"]  # waves of one: alone
    assert sum(rows[1]["batch_blocks"].values()) > 0
    doc = {"config": {"prompts": 2, "suite": "code", "max_tokens": 12, "block": "auto ≤4"}}
    doc |= {"rows": rows, "header": {"target": "t", "draft": "d", "cpu": "c"}}
    assert "| 2 |" in concurrency_markdown(doc)
    assert "Batched cycles by block size" in concurrency_markdown(doc)
    assert "Cycles of a request left alone, run as alone: N 1:" in concurrency_markdown(doc)
    assert all(set(r["batch_copies"]) == {"cycles", "tokens"} for r in rows)
    copied = doc | {"rows": [rows[0] | {"batch_copies": {"cycles": 3, "tokens": 9}}]}
    assert "copied tokens taken: N 1: 3 cycles, 9 tokens" in concurrency_markdown(copied)
    assert validate(doc | {"kind": "concurrency"}) == []
    broken = {
        "kind": "concurrency",
        "config": {},
        "header": {},
        "rows": [{"ways": rows[0]["ways"][:2]}],
    }
    assert len(validate(broken)) == 2  # a way missing, no concurrency
    assert parse_levels("4,1,2,2") == [1, 2, 4]
    with pytest.raises(BenchError, match="stream counts"):
        parse_levels("0,2")


# -- penalties and logit bias in a batch ---------------------------------------------------------


def penalties(kw: dict) -> Penalties:
    return Penalties.make(
        kw.get("presence_penalty"), kw.get("frequency_penalty"), kw.get("repetition_penalty"),
        kw.get("logit_bias"),
    )  # fmt: skip


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_penalised_rows_batch_with_plain_ones_each_as_alone(tiny_pair, d2_pair, on_thread, drafter):  # noqa: F811, E501
    """Rows with penalties, with logit bias and with neither in one batch: each row's tokens
    are those of the request alone (the first token too: the prefill's logits are biased)."""
    pair = tiny_pair if drafter == "dflash" else d2_pair
    pens = [penalties(PEN), None, penalties({**PEN, **BIAS}), penalties({"logit_bias": {11: 4.0}})]

    def run():
        jobs = [
            (pair.tokenizer.encode(p), config(30, block=BlockChoice(5), penalties=pen))
            for p, pen in zip(PROMPTS, pens)
        ]
        refs = [alone(pair, ids, cfg) for ids, cfg in jobs]
        plain = alone(pair, jobs[0][0], config(30, block=BlockChoice(5)))
        engine = BatchEngine(pair, 4, 5, auto=False)
        return refs, plain, [r["tokens"] for r in batched(pair, jobs, engine)], engine

    refs, plain, got, engine = on_thread(run)
    assert got == refs and plain != refs[0]  # the penalties changed the output
    assert engine.stats.rows / engine.stats.cycles > 2


def penalised_batch_samples(pair, sp: SamplingParams, kw: dict, n: int) -> list[tuple]:
    """n seeded penalised requests of 3 tokens after PROMPT, 8 at a time, block 4."""
    engine, pen = BatchEngine(pair, 8, 4, auto=False), penalties(kw)
    jobs = [(PROMPT, config(3, sampling=sp, seed=s, penalties=pen)) for s in range(n)]
    return [tuple(r["tokens"]) for r in batched(pair, jobs, engine)]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_batched_penalised_sampling_is_the_targets_distribution(
    small_pair,  # noqa: F811
    small_d2_pair,  # noqa: F811
    on_thread,
    drafter,
):
    pair = small_pair if drafter == "dflash" else small_d2_pair
    sp, kw = SamplingParams(temperature=1.0), {**PEN, **BIAS}
    joint = exact_penalised_joint(pair, sp, kw)
    samples = on_thread(lambda: penalised_batch_samples(pair, sp, kw, 1500))
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_batched_verify_that_forgets_the_block_drafts_is_detected(
    small_pair,  # noqa: F811
    on_thread,
    monkeypatch,
):
    """Teeth: penalising the verify without the block's earlier drafts fails the same test."""
    kw = {"presence_penalty": 2.0, "frequency_penalty": 1.5}
    real = PenaltyContext.apply

    def apply(self, logits, drafts, first=0):
        if logits.shape[0] > 1:  # the verify pass: forget the drafts
            return real(self, logits, mx.zeros((0,), mx.int32), 0)
        return real(self, logits, drafts, first)

    monkeypatch.setattr(PenaltyContext, "apply", apply)
    sp = SamplingParams(temperature=1.0)
    joint = exact_penalised_joint(small_pair, sp, kw)
    samples = on_thread(lambda: penalised_batch_samples(small_pair, sp, kw, 800))
    assert chi_square_p(samples, joint) < 1e-6


def logprobs_alone_and_batched(pair, jobs, bs: int) -> tuple[list, list, BatchEngine]:
    """Each job's log-probabilities served alone, then batched (fixed block `bs`)."""
    refs = [
        [lp for e in speculative_stream(pair, ids, cfg) for lp in e.logprobs or []]
        for ids, cfg in jobs
    ]
    got = [[] for _ in jobs]
    engine = BatchEngine(pair, len(jobs), bs, auto=False)
    for k, (ids, cfg) in enumerate(jobs):
        emit = lambda e, k=k: got[k].extend(e.logprobs or [])  # noqa: E731
        engine.add(BatchRequest(ids, cfg, DecodeState(pair), emit))
    engine.run()
    return refs, got, engine


def assert_same_logprobs(got: list, refs: list, n: int) -> None:
    for a, b in zip(got, refs):
        assert len(a) == len(b) == n
        assert [x.token for x in a] == [x.token for x in b]
        assert [x.logprob for x in a] == pytest.approx([x.logprob for x in b], abs=1e-5)
        assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]


def test_rows_asking_for_logprobs_get_those_of_the_request_alone(tiny_pair, on_thread):
    """Log-probabilities (top 3) through the batch, with penalties on one row and block sizes
    1, 3 and 5: the same entries as each request alone, first token included."""
    blocks, pens = [BlockChoice(1), BlockChoice(3), BlockChoice(5)], [None, penalties(PEN), None]

    def run():
        jobs = [
            (tiny_pair.tokenizer.encode(p), config(16, block=b, penalties=pen, logprobs=3))
            for p, b, pen in zip(PROMPTS, blocks, pens)
        ]
        return logprobs_alone_and_batched(tiny_pair, jobs, 5)

    refs, got, engine = on_thread(run)
    assert engine.stats.rows / engine.stats.cycles > 2
    assert_same_logprobs(got, refs, 16)


def test_packed_rows_of_different_lengths_equal_each_row_alone(tiny_pair, on_thread):
    """Rows of 1, 9, 3 and 5 tokens in one packed pass (a copy beside plain steps and blocks):
    bitwise the logits and caches each row gets by itself."""

    def run():
        pair = tiny_pair
        rows = [DecodeState(pair) for _ in PROMPTS]
        solo = [DecodeState(pair) for _ in PROMPTS]
        for p, a, b in zip(PROMPTS, rows, solo):
            for s in (a, b):
                mx.eval(pair.target(mx.array(pair.tokenizer.encode(p))[None], cache=s.target_cache))
        rng = mx.random.key(2)
        for lengths in ([1, 9, 3, 5], [4, 1, 1, 12]):
            tokens = [mx.random.randint(0, 200, (n,), key=mx.random.key(n + k)) for k, n in
                      enumerate(lengths)]  # fmt: skip
            rng = mx.random.split(rng)[0]
            with ragged_hooks(pair):
                together = forward_rows(pair, tokens, rows)
            assert isinstance(together, list)
            for i, s in enumerate(solo):
                own = pair.target(tokens[i][None], cache=s.target_cache)[0]
                assert together[i].shape == own.shape
                assert mx.array_equal(together[i], own).item(), (lengths, i)
            for a, b in zip(rows, solo):
                assert a.target_cache[0].offset == b.target_cache[0].offset
                for ca, cb in zip(a.target_cache, b.target_cache):
                    assert mx.array_equal(ca.state[0], cb.state[0]).item()

    on_thread(run)


REPEATS = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.mark.parametrize("block", [BlockChoice(1), BlockChoice(5), BlockChoice(8, auto=True)])
def test_rows_that_copy_share_a_batch_with_drafting_rows_each_as_alone(tiny_pair, on_thread, block):
    """Copy drafting in the batch: rows repeating their prompt verify copies (of their own
    lengths, packed beside the others' blocks or plain steps), and every row's tokens are the
    request's alone. Control: without copies the engine runs no copy cycle."""

    def run():
        tok = tiny_pair.tokenizer
        ids = [tok.encode(REPEATS * 3 + REPEATS[:24]), tok.encode(PROMPTS[0])]
        ids += [tok.encode(REPEATS * 2 + REPEATS[:30]), tok.encode(PROMPTS[2])]
        jobs = [(i, config(40 + 5 * k, block=block, copy=True)) for k, i in enumerate(ids)]
        refs = [alone(tiny_pair, i, cfg) for i, cfg in jobs]
        engine = BatchEngine(tiny_pair, 4, block.size, block.auto)
        got = batched(tiny_pair, jobs, engine)
        off = BatchEngine(tiny_pair, 4, block.size, block.auto)
        plain = batched(tiny_pair, [(i, replace(c, copy=False)) for i, c in jobs], off)
        return refs, got, plain, engine, off

    refs, got, plain, engine, off = on_thread(run)
    assert [r["tokens"] for r in got] == refs == [r["tokens"] for r in plain]
    assert engine.stats.copy_cycles > 0 and off.stats.copy_cycles == 0
    assert engine.stats.copied > engine.stats.copy_cycles  # copies were accepted
    assert any(got[0]["req"].row.rec.copied)
    assert engine.stats.rows < off.stats.rows  # the copying rows needed fewer cycles
    assert engine.stats.rows / engine.stats.cycles > 2  # they did decode together
    assert engine.stats.as_dict()["copied_tokens"] == engine.stats.copied


@pytest.mark.parametrize("pause", [8, 10**6])
def test_a_rows_pause_ends_among_plain_steps_queued_ahead(tiny_pair, on_thread, pause, monkeypatch):
    """Batched plain steps queued ahead cannot copy (their anchors are lazy) but each counts
    down a row's pause, as alone: the copying rows resume copies. Control: a pause longer than
    the answers keeps every copy out."""

    def paused(*args, **kwargs):  # each row opens with its copies paused
        row = open_row(*args, **kwargs)
        row.policy.paused = pause
        return row

    monkeypatch.setattr(scheduler, "open_row", paused)

    def run():
        tok = tiny_pair.tokenizer
        ids = [tok.encode(REPEATS * 3 + REPEATS[:24]), tok.encode(REPEATS * 2 + REPEATS[:30])]
        jobs = [(i, config(40, block=BlockChoice(1), copy=True)) for i in ids]
        refs = [alone(tiny_pair, i, replace(cfg, copy=False)) for i, cfg in jobs]
        engine, got = BatchEngine(tiny_pair, 2, 1, False), [[], []]
        for k, (i, cfg) in enumerate(jobs):
            req = BatchRequest(
                i, cfg, DecodeState(tiny_pair), lambda ev, k=k: got[k].extend(ev.tokens)
            )
            engine.add(req)
        while engine.busy:
            engine.step()
        return refs, got, engine

    refs, got, engine = on_thread(run)
    assert got == refs
    if pause > 40:
        assert engine.stats.copy_cycles == 0
    else:
        assert engine.stats.copy_cycles > 0 and engine.stats.copied > engine.stats.copy_cycles


def copy_batch_samples(pair, sp: SamplingParams, n: int, blocks) -> tuple[list[tuple], int]:
    """n seeded 3-token requests after a periodic prompt, 8 at a time, copies on."""
    engine = BatchEngine(pair, 8, max(b.size for b in blocks), auto=False)
    jobs = [
        (PERIODIC, config(3, sampling=sp, seed=s, block=blocks[s % len(blocks)], copy=True))
        for s in range(n)
    ]
    out = [tuple(r["tokens"]) for r in batched(pair, jobs, engine)]
    return out, engine.stats.copied + engine.stats.copy_cycles


@pytest.mark.slow
def test_batched_copies_keep_the_target_distribution(small_pair, on_thread):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp, prompt=PERIODIC)
    blocks = [BlockChoice(4), BlockChoice(1)]
    samples, copies = on_thread(lambda: copy_batch_samples(small_pair, sp, 1200, blocks))
    assert copies >= 300  # the test is about copies
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_lossy_batched_copy_rule_is_detected(small_pair, on_thread, monkeypatch):  # noqa: F811
    """Accepting every copied token fails the same test (at block 1 every draft is a copy)."""
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp, prompt=PERIODIC)
    real = ragged.accept_sampled
    accept_all = accepting_every_draft(real)

    monkeypatch.setattr(ragged, "accept_sampled", accept_all)
    samples, copies = on_thread(lambda: copy_batch_samples(small_pair, sp, 600, [BlockChoice(1)]))
    assert copies >= 150
    assert chi_square_p(samples, joint) < 1e-6


def test_prompts_that_arrive_together_prefill_in_shared_passes_each_as_alone(tiny_pair, on_thread):
    """Four prompts of 7 to 61 tokens in chunks of 16 (engine cap 40 tokens a pass): their
    chunks share packed passes, oldest first, and every answer is the request's alone (same
    chunk boundaries); a prompt of one chunk more than the cap still gets its pass."""

    def run():
        tok = tiny_pair.tokenizer
        texts = [REPEATS * 2, PROMPTS[1], REPEATS[:50], PROMPTS[3] * 3]
        ids = [tok.encode(t) for t in texts]
        jobs = [(i, config(12, block=BlockChoice(4), prefill_step_size=16)) for i in ids]
        refs = [alone(tiny_pair, i, cfg) for i, cfg in jobs]
        engine = BatchEngine(tiny_pair, 4, 4, auto=False, prefill_chunk=40)
        got = batched(tiny_pair, jobs, engine)
        return ids, refs, got, engine

    ids, refs, got, engine = on_thread(run)
    assert [r["tokens"] for r in got] == refs
    chunks = sum(-(-(len(i) - 1) // 16) + 1 for i in ids)  # as `decode.prefill` cuts them
    s = engine.stats
    assert s.prefill_chunks == chunks and s.prefill_passes < chunks
    assert max(len(i) for i in ids) > 40  # the cap was binding somewhere


def test_a_copying_row_asking_for_logprobs_gets_those_of_the_request_alone(tiny_pair, on_thread):
    """Log-probabilities (top 3) of a row that copies its source, beside a penalised row and a
    drafting one: the entries of each request alone."""

    def run():
        tok = tiny_pair.tokenizer
        ids = [tok.encode(REPEATS * 3 + REPEATS[:24]), tok.encode(PROMPTS[1])]
        ids += [tok.encode(PROMPTS[2])]
        kws = [{}, {"penalties": penalties(PEN)}, {}]
        jobs = [
            (i, config(24, block=BlockChoice(4), logprobs=3, copy=True, **kw))
            for i, kw in zip(ids, kws)
        ]
        return logprobs_alone_and_batched(tiny_pair, jobs, 4)

    refs, got, engine = on_thread(run)
    assert engine.stats.copy_cycles > 0
    assert_same_logprobs(got, refs, 24)


def test_sampled_rows_hand_the_batch_rule_their_acceptance_odds(small_pair, on_thread):  # noqa: F811
    """A batch's sampled rows give its block rule their acceptance odds (2 (bs - 1) each, the
    expected accepted drafts close to those accepted), a greedy row its drafts alone; the
    rule's running acceptance takes both (acceptance.positions)."""

    class Recording(BatchBlockRule):
        def update(self, batch, bs, seconds, accepted, odds=()):
            self.seen.append((bs, list(accepted), [tuple(o) for o in odds]))
            super().update(batch, bs, seconds, accepted, odds)

    def run():
        rule = Recording(4, fixed=True)
        rule.seen = []
        engine = BatchEngine(small_pair, 4, 4, auto=False, rule=rule)
        sampled = [config(120, sampling=SamplingParams(1.0), seed=s) for s in range(3)]
        batched(small_pair, [(PROMPT, cfg) for cfg in sampled + [config(120)]], engine)
        return rule

    rule = on_thread(run)
    rows = [(a, o) for bs, acc, odds in rule.seen if bs == 4 for a, o in zip(acc, odds)]
    sampled = [(a, o) for a, o in rows if o]
    assert len(sampled) > 30 and all(len(o) == 6 for _, o in sampled)
    assert any(o == () for _, o in rows)  # the greedy row
    expected = sum(sum(positions(3, a, o)[1]) for a, o in sampled)
    got = sum(a for a, _ in sampled)
    assert got > len(sampled) / 4 and abs(expected - got) < 3 * len(sampled) ** 0.5
    assert 0.0 < rule.alpha < 1.0
