"""`--block-size auto` (dflash_mac/sizing/) and the pipelined cycle: the controller's
choices on synthetic inputs, and exact greedy output whatever sizes it picks."""

from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.generate import generate_step
from test_sampling import small_pair  # noqa: F401  (fixture)

from dflash_mac.drafting.copies import CopyRates
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.engine.drafts import DraftContext
from dflash_mac.engine.verify import SamplingParams
from dflash_mac.settings import parse_block_size
from dflash_mac.sizing.acceptance import Acceptance, positions
from dflash_mac.sizing.choice import BlockChoice, block_size_for
from dflash_mac.sizing.controller import BlockController, Decision
from dflash_mac.sizing.cost import ContextCost, CostCurve, CostModel
from dflash_mac.sizing.tuning import AutoTuning

BS = 8
CURVE = CostCurve({1: 1.0, **{b: 1.5 + 0.07 * (b - 1) for b in range(2, 17)}}, measured=True)


def controller(**kw) -> BlockController:
    return BlockController(BS, CostModel(CURVE), **kw)


def drive(ctl: BlockController, accept, cycles: int) -> list[int]:
    """Run `cycles` synthetic cycles; `accept(bs)` returns accepted drafts; one step = 10 ms."""
    sizes = []
    for _ in range(cycles):
        bs = ctl.choose().size
        sizes.append(bs)
        ctl.update(bs, accept(bs) if bs > 1 else 0, 0.010 * CURVE.ratio(bs))
    return sizes


def geometric(alpha: float, rng: random.Random):
    def accept(bs: int) -> int:
        a = 0
        while a < bs - 1 and rng.random() < alpha:
            a += 1
        return a

    return accept


def switches(sizes: list[int]) -> int:
    return sum((a == 1) != (b == 1) for a, b in zip(sizes, sizes[1:]))


def test_falls_back_when_acceptance_is_poor_and_returns_when_it_recovers():
    ctl = controller()
    poor = drive(ctl, geometric(0.1, random.Random(0)), 200)
    assert poor[-100:].count(1) >= 90  # plain decoding, with rare probes
    assert "does not pay" in ctl.last.reason or "probing" in ctl.last.reason
    # how soon the probes bring drafting back is their luck: 6-106 cycles over 40 seeds
    good = drive(ctl, geometric(0.9, random.Random(1)), 300)
    assert 1 not in good[-100:]  # back to drafting, and it stays there
    assert max(good[-100:]) >= 6  # wide blocks pay at 90 % acceptance


def test_one_rejected_block_at_a_fresh_start_does_not_turn_drafting_off():
    """The generic guess weighs as much as several drafting cycles at first: a fresh process
    whose first block keeps nothing goes on drafting (a fresh `generate` used to fall back to
    plain steps right after it, on text a fixed block 8 drafted through at τ 4.5)."""

    def first_rejected(rng: random.Random):
        good, calls = geometric(0.85, rng), [0]

        def accept(bs: int) -> int:
            calls[0] += 1
            return 0 if calls[0] == 1 else good(bs)

        return accept

    sizes = drive(controller(), first_rejected(random.Random(3)), 40)
    assert sizes[0] == BS and 1 not in sizes
    assert sizes[-1] >= 6
    # negative control: a guess worth one cycle falls back at once
    bare = drive(controller(acceptance=Acceptance(BS)), first_rejected(random.Random(3)), 40)
    assert bare[1] == 1
    # and the guess gives way to the evidence: poor acceptance from the start still falls back
    poor = drive(controller(), geometric(0.1, random.Random(4)), 40)
    assert poor.index(1) <= 10 and poor[-20:].count(1) >= 18


def test_a_drafter_with_a_measured_acceptance_starts_from_it():
    """Where the registry gives the drafter's measured acceptance, a fresh process starts from
    it as one cycle's evidence: a weak drafter on the text it was measured on decodes plain with
    probes from the first cycle, where the generic guess first drafts at a loss; on text it
    predicts well, the probes bring drafting back."""

    def fresh(guess: float | None, alpha: float, cycles: int) -> list[int]:
        ctl = AutoTuning(greedy_curve=CURVE, guess=guess).controller(BS)
        return drive(ctl, geometric(alpha, random.Random(2)), cycles)

    measured, generic = fresh(0.4, 0.35, 40), fresh(None, 0.35, 40)
    assert measured[1:9] == [1] * 8  # (its first cycle at block 3: at break-even)
    assert measured.count(1) >= 34
    assert generic[:10].count(1) == 0 and generic.count(1) <= 28  # the control
    good = fresh(0.4, 0.9, 150)
    assert 1 not in good[-50:] and max(good[-50:]) >= 6


def test_picks_the_size_with_the_best_expected_rate():
    ctl = controller()
    drive(ctl, geometric(0.6, random.Random(1)), 300)
    rates = ctl.rates()
    best = max((b for b in rates if b > 1), key=rates.get)
    assert ctl.choose().size in (best, ctl.current)
    assert rates[ctl.current] >= rates[best] / 1.05  # within the hysteresis of the best


def test_does_not_flap_near_break_even():
    # at alpha 0.45 E[tokens | 2] / cost(2) = 1.45 / 1.57 < 1 but wider blocks are close to 1
    sizes = drive(controller(), geometric(0.45, random.Random(2)), 600)
    assert switches(sizes) <= 60  # probes at most every 8 plain steps, backing off
    steady = sizes[200:]
    assert switches(steady) <= 2 * len(steady) // 16


def test_measures_a_plain_step_without_a_measured_curve():
    ctl = BlockController(BS, CostModel(CostCurve.generic(BS)))
    sizes = drive(ctl, geometric(0.9, random.Random(3)), 10)
    assert sizes[3:5] == [1, 1] and sizes.count(1) == 2  # the first timing is not used
    assert ctl.cost.calibrated


def test_cost_model_follows_measured_times_within_reason():
    model = CostModel(CURVE)
    for _ in range(30):
        model.observe(1, 0.010)
        model.observe(8, 0.022)  # a bit dearer than the prior's 1.99
    assert model.cost(8) == pytest.approx(2.2, rel=0.01)
    assert model.cost(5) == pytest.approx(CURVE.ratio(5), rel=0.01)  # unmeasured: the prior
    for _ in range(30):
        model.observe(8, 0.200)  # a loaded moment: bounded by the measured prior
    assert model.cost(8) == pytest.approx(CURVE.ratio(8) * CostModel.TRUST)


def test_a_load_spike_does_not_stop_paying_drafting():
    ctl = controller()
    rng = random.Random(4)
    accept = geometric(0.8, rng)
    sizes = []
    for i in range(300):
        bs = ctl.choose().size
        sizes.append(bs)
        slow = 8.0 if 100 <= i < 160 and bs > 1 else 1.0  # drafting cycles hit by other work
        ctl.update(bs, accept(bs) if bs > 1 else 0, 0.010 * CURVE.ratio(bs) * slow)
    assert sizes[100:].count(1) <= 3


def test_acceptance_extrapolates_and_decays():
    acc = Acceptance(8, decay=0.9)
    for _ in range(40):
        acc.observe(3, 2)  # both drafts accepted every time
    assert acc.alphas(7)[0] > 0.95 and acc.alphas(7)[6] > 0.95  # unseen positions inherit
    for _ in range(40):
        acc.observe(3, 0)
    assert acc.alphas(1)[0] < 0.1
    assert acc.expected_tokens(1) == 1.0


def test_cost_curve_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"ratios": {"1": 1.0, "2": 1.4, "3": 1.5}}')
    curve = CostCurve.load(p)
    assert curve.measured and curve.ratio(3) == 1.5 and curve.ratio(5) == pytest.approx(1.7)
    p.write_text("not json")
    assert CostCurve.load(p) is None
    assert CostCurve.load(tmp_path / "missing.json") is None


def test_a_copy_is_priced_without_the_drafter_pass(tmp_path):
    """A copy verifies as many tokens as a chain but runs no drafter pass: priced as the
    chain's cycle less the pass the curve timed alone (`draft_seconds`). On the tiny pair's
    measured curve (block 8 at 2.88 plain steps, of which 0.75 the drafter) a doubtful 8-token
    copy at a fresh start's rate beats the guessed chain; priced as a chain it lost, and auto
    copied in 64 cycles where block 8 copied in 318. Control: a curve that timed no drafter
    pass prices copies as chains, as before."""
    seconds = {"1": 0.0045, "2": 0.0100, "8": 0.0130}
    table = {"ratios": {"1": 1.0, "2": 2.22, "8": 2.88}, "seconds": seconds}
    p = tmp_path / "c.json"
    p.write_text(json.dumps(table | {"draft_seconds": {"2": 0.0027, "8": 0.0034}}))
    curve = CostCurve.load(p)
    assert curve.copy(9) == pytest.approx(2.88 - 0.0034 / 0.0045)
    assert curve.copy(2) == pytest.approx(2.22 - 0.0027 / 0.0045)
    assert CostCurve.generic(8).copy(9) == pytest.approx(CostCurve.generic(8).ratio(9) - 0.5)

    def copies(curve: CostCurve) -> int:
        c = BlockController(8, CostModel(curve), timed=False)
        c.choose()
        return c.copy_length(8, CopyRates().doubtful_rate)

    assert copies(curve) == 8
    p.write_text(json.dumps(table))
    assert CostCurve.load(p).copy(9) == CostCurve.load(p).ratio(9)
    assert copies(CostCurve.load(p)) == 0


def test_policy_auto_is_the_default_and_a_number_is_exact(tiny_pair):
    trained = tiny_pair.drafter.config.block_size
    assert block_size_for(tiny_pair, None) == BlockChoice(trained, auto=True)
    assert block_size_for(tiny_pair, "auto") == BlockChoice(trained, auto=True)
    assert block_size_for(tiny_pair, 3) == BlockChoice(3)
    assert parse_block_size("4") == 4
    with pytest.raises(Exception, match="--block-size must be auto or an integer"):
        parse_block_size("wide")


# -- exact greedy output ----------------------------------------------------------------


class Scripted:
    """A controller replaying fixed sizes (to force plain steps and returns to drafting)."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.i = sizes, 0
        self.last = Decision(1, "scripted")
        self.copy_rates = CopyRates()

    def choose(self) -> Decision:
        self.last = Decision(self.sizes[self.i % len(self.sizes)], "scripted")
        self.i += 1
        return self.last

    def update(self, bs, accepted, seconds, steady=True, tree=0, chain=0, odds=(), reach=0) -> None:
        pass

    def copy_length(self, longest: int, rate: float) -> int:
        return longest

    def copied(self, width: int, seconds: float) -> None:

        pass

    def plain_step(self) -> float | None:
        return None  # untimed: waits for a copy are not priced


def baseline(pair, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]


def tokens_of(pair, ids, cfg, **kw):
    events = list(speculative_stream(pair, ids, cfg, **kw))
    return [t for e in events for t in e.tokens], events[-1].stats


PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]


@pytest.fixture(scope="module")
def refs(tiny_pair):
    return [(ids, baseline(tiny_pair, ids, 48)) for ids in map(tiny_pair.tokenizer.encode, PROMPTS)]


def test_auto_greedy_matches_the_target(tiny_pair, refs):
    for ids, ref in refs:
        tokens, stats = tokens_of(tiny_pair, ids, GenerationConfig(48, use_eos=False))
        assert tokens == ref
        assert stats.auto and len(stats.block_sizes) == stats.cycles


@pytest.mark.parametrize("pipeline", [True, False])
def test_any_block_sizes_and_pipelining_keep_greedy_exact(tiny_pair, refs, pipeline, monkeypatch):
    monkeypatch.setattr(DraftContext, "FLUSH_AT", 5)  # also append during runs of plain steps
    sizes = [1, 1, 3, 1, 8, 2, 1, 1, 1, 1, 1, 1, 1, 5, 8, 4]
    for i, (ids, ref) in enumerate(refs):
        oracle = OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, i)
        for pair in (tiny_pair, with_drafter(tiny_pair, oracle)):
            state = DecodeState(pair)
            cfg = GenerationConfig(48, use_eos=False, pipeline=pipeline)
            tokens, stats = tokens_of(pair, ids, cfg, state=state, controller=Scripted(sizes))
            assert tokens == ref
            assert 1 in stats.block_sizes and 8 in stats.block_sizes
            assert state.draft_cache[0].offset == len(state.ids)  # deferred context appended


def test_deferred_context_equals_the_drafted_one(tiny_pair, refs):
    """Plain steps defer the drafter's context; once appended it holds the same K/V as when
    every cycle drafted."""
    ids, ref = refs[0]
    caches = []
    for ctl in (Scripted([1, 1, 1, 4]), Scripted([4])):
        state = DecodeState(tiny_pair)
        tokens_of(tiny_pair, ids, GenerationConfig(40, use_eos=False), state=state, controller=ctl)
        c = state.draft_cache[0]
        caches.append(c.keys[..., : c.offset, :])
    assert caches[0].shape == caches[1].shape
    assert mx.allclose(caches[0], caches[1], atol=1e-4).item()


def test_auto_runs_on_a_worker_thread(tiny_pair, refs):
    ids, ref = refs[1]
    out = {}

    def work():
        out["tokens"] = tokens_of(tiny_pair, ids, GenerationConfig(48, use_eos=False))[0]

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["tokens"] == ref


def test_cost_curve_is_measured_saved_and_used_by_auto(tiny_pair, tmp_path, monkeypatch):
    from dflash_mac.bench.costcurve import render
    from dflash_mac.calibrate import measure, save
    from dflash_mac.sizing.files import cost_curve_path, load_tuning

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    pair = tiny_pair
    curve = measure(pair, max_bs=3, context=16, reps=1)
    assert set(curve["ratios"]) == {"1", "2", "3"} and curve["ratios"]["1"] == 1.0
    assert all(curve["seconds"][b] > 0 for b in curve["seconds"])
    assert set(curve["draft_seconds"]) == {"2", "3"}  # the drafter pass alone: no plain step
    assert all(s > 0 for s in curve["draft_seconds"].values())
    table = render(curve)
    assert "break-even" in table and "draft ms" in table
    verify = 1000 * (curve["seconds"]["3"] - curve["draft_seconds"]["3"])
    assert f"{verify:.2f}" in table.splitlines()[3]  # bs 3: the rest of the cycle
    older = {k: v for k, v in curve.items() if k != "draft_seconds"}  # curves saved before
    assert "draft ms" not in render(older) and "break-even" in render(older)
    assert not load_tuning(pair).controller(3).cost.prior.measured  # nothing saved: the guess
    path = save(curve, cost_curve_path(pair))
    assert path.is_relative_to(tmp_path)
    prior = load_tuning(pair).controller(3).cost.prior
    assert prior.measured and prior.ratio(3) == pytest.approx(curve["ratios"]["3"])


def test_sampled_requests_use_the_sampled_curve_and_own_timings(tiny_pair, tmp_path, monkeypatch):
    """A saved curve holds a greedy and a sampled table; sampled requests take the sampled one
    as their prior and keep their own measurements (greedy timings do not leak into them)."""
    from dflash_mac.bench.costcurve import render
    from dflash_mac.calibrate import measure_both, save
    from dflash_mac.sizing.files import cost_curve_path, load_tuning

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    pair = tiny_pair
    curve = measure_both(pair, max_bs=3, context=16, reps=1)
    assert curve["sampled"]["temperature"] == 0.7 and curve["sampled"]["ratios"]["1"] == 1.0
    assert "T 0.7" in render(curve)
    for table in (curve, curve["sampled"]):  # timed once (reps=1): a busy host's dip would be
        top = 0.0  # refused as noise (`cost.noise`), which this test is not about
        for b in sorted(table["seconds"], key=int):
            top = table["seconds"][b] = max(table["seconds"][b], top)
        widest = max(table["ratios"], key=int)
        for n, r in table["trees"].items():
            chain = table["ratios"][str(min(int(n) + 1, int(widest)))]
            table["trees"][n] = max(r, chain)
    curve["sampled"]["ratios"]["3"] = curve["ratios"]["3"] + 1.0  # tell the tables apart
    trees = curve["sampled"]["trees"]  # ... keeping it consistent (a tree costs a chain at least)
    curve["sampled"]["trees"] = {n: r + 1.0 for n, r in trees.items()}
    save(curve, cost_curve_path(pair))
    tuning = load_tuning(pair)
    greedy = tuning.controller(3, (0.0,))
    sampled = tuning.controller(3, (0.7,), sampled=True)
    assert greedy.cost is not sampled.cost
    assert greedy.cost.prior.ratio(3) == pytest.approx(curve["ratios"]["3"])
    assert sampled.cost.prior.ratio(3) == pytest.approx(curve["ratios"]["3"] + 1.0)
    assert tuning.controller(3, (1.0,), sampled=True).cost is sampled.cost
    # greedy starts from a heavy guess (one rejected block must not stop drafting), sampled
    # from a light one (poorer acceptance is the rule there)
    assert greedy.acc.boost == BlockController.GUESS_WEIGHT - 1 and sampled.acc.boost == 0
    greedy.update(3, 2, 0.5)
    greedy.update(3, 2, 0.5)  # the first timing at a size is not used
    assert 3 in greedy.cost.seconds and 3 not in sampled.cost.seconds


def test_a_saved_curve_without_a_sampled_table_serves_both(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"ratios": {"1": 1.0, "2": 1.4}}')
    assert CostCurve.load(p, sampled=True).ratio(2) == 1.4


def test_drafting_resumes_only_well_above_break_even():
    """In fallback, an expected rate 7 % above a plain step's is not enough to resume (it is
    within what a busy machine's timings get wrong); 15 % above is."""
    for alpha, resumes in ((0.07, False), (0.15, True)):
        cost = CostModel(CostCurve({1: 1.0, 2: 1.0}, measured=True))
        ctl = BlockController(2, cost, Acceptance(1, prior=0.0))
        ctl.fallback = True
        ctl.acc.observe(2, 0)  # any estimate: replaced below
        ctl.acc.alphas = lambda n, a=alpha: [a] * n
        ctl.countdown = 1000
        assert (ctl.choose().size == 2) == resumes, alpha


def test_seeded_sampling_with_auto_is_reproducible(tiny_pair):
    """Seeded sampling: auto decides from the prior alone, so timing cannot change the draws."""
    ids = tiny_pair.tokenizer.encode("hello world")
    cfg = lambda: GenerationConfig(32, sampling=SamplingParams(1.0), seed=7, use_eos=False)  # noqa: E731
    runs = [tokens_of(tiny_pair, ids, cfg()) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].block_sizes == runs[1][1].block_sizes


def test_requests_with_the_same_setting_continue_one_controller():
    tuning = AutoTuning()
    a = tuning.controller(4, (0.7, 1.0, 0, 0.0))
    assert tuning.controller(4, (0.7, 1.0, 0, 0.0)) is a
    assert tuning.controller(4, (0.0, 1.0, 0, 0.0)) is not a
    assert tuning.controller(4, (0.7, 1.0, 0, 0.0), timed=False) is not a
    assert AutoTuning().controller(4, (0.7, 1.0, 0, 0.0)) is not a  # state lives in the tuning


def test_the_stream_continues_the_tuning_it_is_given_and_reads_no_file(
    tiny_pair, tmp_path, monkeypatch
):
    """`auto`'s state is the `AutoTuning` passed in (no attribute on the pair), and the stream
    reads and writes nothing in the data directory: front ends load and save it."""
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    ids = tiny_pair.tokenizer.encode("hello world")
    tuning = AutoTuning()
    list(speculative_stream(tiny_pair, ids, GenerationConfig(8, use_eos=False), tuning=tuning))
    (ctl,) = tuning.controllers.values()
    cycles = ctl.cycles
    list(speculative_stream(tiny_pair, ids, GenerationConfig(8, use_eos=False), tuning=tuning))
    assert ctl.cycles > cycles  # continued
    assert not any(k.startswith("_dflash") for k in vars(tiny_pair))
    assert list(tmp_path.rglob("*")) == []  # no curve read-and-saved, no acceptance written


@pytest.mark.parametrize("dtype", ["bf16", "4bit"])
def test_cost_curve_on_a_random_shape(dtype):
    from dflash_mac.bench.shapes import random_pair
    from dflash_mac.calibrate import measure

    pair = random_pair("tiny", dtype)
    assert pair.quantized == (dtype == "4bit")
    curve = measure(pair, max_bs=3, context=8, reps=1)
    assert curve["ratios"]["1"] == 1.0 and len(curve["ratios"]) == 3


def test_a_slow_plain_step_does_not_make_drafting_look_cheap():
    model = CostModel(CostCurve.generic(8))
    model.observe(3, 0.016)
    for _ in range(10):
        model.observe(1, 0.050)  # plain steps hit by other work
    assert model.cost(3) >= 1.0 + (CostCurve.generic(8).ratio(3) - 1.0) / (2 * CostModel.TRUST)


def test_only_realised_gains_bring_the_probes_closer():
    """The wait between probes shortens with what drafting gained lately: cycles that
    committed more than they cost, never a fresh controller's guess. (A guess of 2.1x kept a
    long prompt's probes at T 0.7 about 20 cycles apart where none paid: 0.94x plain.)
    Control: a run whose drafts are all accepted does bring them closer."""
    ctl = controller()
    first = ctl.choose()
    assert first.size > 1 and first.rates[first.size] > 1.5  # the guess: drafting pays well
    rejected = drive(ctl, lambda bs: 0, 200)
    assert ctl.upside == 0 and ctl.probe_cap() == ctl.probe_max
    gaps = [i for i, b in enumerate(rejected) if b > 1][-3:]
    assert gaps[-1] - gaps[-2] >= 64  # probes back off far
    paid = controller()
    drive(paid, lambda bs: bs - 1, 40)  # whole blocks: 8 tokens for about 2 steps' time
    assert paid.upside > 1.0 and paid.probe_cap() < 32


def test_probes_back_off_when_one_lucky_block_is_all_they_see():
    """At sampling-like acceptance (30 %) drafting never pays; a probe that happens to accept
    a few drafts must not bring the probes back to every 8 plain steps."""
    ctl = controller()
    sizes = drive(ctl, geometric(0.3, random.Random(3)), 2400)
    probes = sum(b > 1 for b in sizes[800:])  # once the start's drafting gain is forgotten
    assert probes <= 1600 // ctl.probe_max + 3
    assert ctl.interval == ctl.probe_max


def test_plain_first_drafts_only_once_probes_pay():
    ctl = controller(plain_first=True)
    assert ctl.choose().size == 1 and "long context" in ctl.last.reason
    rng = random.Random(4)
    poor = drive(ctl, geometric(0.2, rng), 150)
    assert poor[:6] == [1] * 6 and poor.count(1) >= 135  # plain, with rare probes
    good = drive(ctl, geometric(0.9, rng), 300)
    assert 1 not in good[-100:]  # probes found that drafting pays: back to drafting


def test_long_contexts_get_their_own_controller(tiny_pair, monkeypatch):
    from dataclasses import replace

    from dflash_mac.sizing import files

    entry = replace(_entry(), long_context_tokens=None)
    monkeypatch.setattr(files, "registry_entry", lambda pair: entry)
    tuning = files.load_tuning(tiny_pair)
    short = tuning.controller(BS, ("s",), 100)
    assert tuning.controller(BS, ("s",), 900) is short
    long = tuning.controller(BS, ("s",), files.LONG_CONTEXT)
    assert long is not short and not long.fallback  # its own, but not known to lose
    entry = replace(entry, long_context_tokens=500)  # the registry: the drafter loses from 500
    tuning = files.load_tuning(tiny_pair)
    assert not tuning.controller(BS, ("s",), 499).fallback
    ctl = tuning.controller(BS, ("s",), 500)
    assert ctl.fallback and ctl.choose().size == 1
    assert tuning.controller(BS, ("s",), 800, timed=False).fallback  # seeded too
    entry = replace(entry, long_context_tokens=3500)  # past the long band's start (1,024)
    tuning = files.load_tuning(tiny_pair)
    long = tuning.controller(BS, ("s",), 2000)
    assert long is not tuning.controller(BS, ("s",), 100) and not long.fallback
    losing = tuning.controller(BS, ("s",), 4000)  # after a long one: its own, plain first
    assert losing is not long and losing.fallback and losing.memory is None


def long_drive(ctl: BlockController, cycles: int, seed: int = 5) -> list[int]:
    """Cycles at a long context: a plain step takes 20 ms and a block-b cycle 1.5 + 0.5 (b - 1)
    of them (the curve says 1.5 + 0.07 (b - 1)); 70 % of the drafts are accepted, which pays
    at the curve's costs (block 8: 3.1 tokens for 2.0 steps), not at these (for 5.0)."""
    accept, sizes = geometric(0.7, random.Random(seed)), []
    for _ in range(cycles):
        bs = ctl.choose().size
        sizes.append(bs)
        ctl.update(bs, accept(bs) if bs > 1 else 0, 0.02 * (1.5 + 0.5 * (bs - 1) if bs > 1 else 1))
    return sizes


def test_a_long_context_times_its_own_plain_step_and_sees_dear_cycles():
    """The curve was measured at a short context; at a long one the long band's cost model
    times a plain step afresh and finds drafting dearer than the curve says."""
    tuning = AutoTuning(greedy_curve=CURVE)
    short, long = tuning.controller(BS, (), 100), tuning.controller(BS, (), 4000)
    assert long.cost is not short.cost and short.cost.calibrated and not long.cost.calibrated
    sizes = long_drive(long, 200)
    assert sizes[3:5] == [1, 1] and long.cost.calibrated  # the one-token step, timed here
    assert sizes[-100:].count(1) >= 85  # plain decoding, with rare probes
    # the control: a cost model that trusts the short context's curve keeps drafting
    assert long_drive(BlockController(BS, CostModel(CURVE)), 200)[-100:].count(1) < 50


def _entry():
    from dflash_mac.loading.registry import load_registry

    return load_registry().get("tiny-code")


def test_a_long_prompt_on_a_losing_pair_decodes_plain_and_exact(tiny_pair, refs, monkeypatch):
    from dataclasses import replace

    from dflash_mac.sizing import files

    monkeypatch.setattr(files, "registry_entry", lambda p: replace(_entry(), long_context_tokens=4))
    tuning = files.load_tuning(tiny_pair)
    for ids, ref in refs:
        cfg = GenerationConfig(48, use_eos=False)
        tokens, stats = tokens_of(tiny_pair, ids, cfg, tuning=tuning)
        assert tokens == ref
        assert stats.block_sizes[:7] == (1,) * 7 and "long context" in stats.block_reason


def test_cost_curve_times_plain_steps_as_a_pipelined_run(tiny_pair, monkeypatch):
    """The curve is timed by the decode loop's own pipeline: bs 1 over a run of steps queued
    ahead of their syncs (the plain decoding a drafting cycle replaces), every size in each
    round, and every round starts from the prompt again."""
    from dflash_mac import calibrate
    from dflash_mac.engine.cycle import CyclePipeline

    starts = []
    real = CyclePipeline.start

    def spy(self, bs, anchor, room=0):
        starts.append((bs, self.row.state.target_cache[0].offset, isinstance(anchor, mx.array)))
        return real(self, bs, anchor, room)

    monkeypatch.setattr(CyclePipeline, "start", spy)
    monkeypatch.setattr(calibrate, "NOISY_RETRIES", 0)  # the rounds counted here: no more
    calibrate.measure(tiny_pair, max_bs=3, context=10, reps=1)
    rounds = 1 + calibrate.WARMUP_ROUNDS
    assert sum(offset == 10 for _, offset, _ in starts) == rounds  # each from the prompt
    runs, run = [], []  # the runs of plain steps
    for (bs, offset, lazy), nxt in zip(starts, starts[1:] + [(0, 0, False)]):
        if bs == 1:
            run.append((offset, lazy))
            if nxt[0] != 1:
                runs.append(run)
                run = []
    warm, burst = calibrate.WARMUP_ROUNDS, calibrate.PLAIN_BURST
    assert len(runs) == rounds and all(len(r) >= burst + 1 for r in runs[warm:])
    assert all(len(r) == calibrate.WARMUP_PLAIN for r in runs[:warm])  # the short warm-up
    for r in runs:  # one after another, each on the previous step's lazy token
        assert [o for o, _ in r] == list(range(r[0][0], r[0][0] + len(r)))
        assert all(lazy for _, lazy in r[1:])


def test_cycles_are_timed_only_after_one_of_their_kind(tiny_pair):
    """The first plain step after a drafting cycle waits for its own queueing (nothing was
    queued ahead of it), and the first drafting cycle after plain steps appends their context
    first: both untimed, so the costs the controller learns are those of a run of plain steps
    and of continued drafting. So is the last plain step before a drafting cycle (nothing
    queued ahead of its sync: its interval misses the work of building the next step)."""
    sizes = iter([3, 1, 1, 1, 3, 3, 1, 1] + [1] * 50)

    class Scripted:
        def __init__(self):
            self.updates, self.last = [], Decision(3, "scripted")
            self.copy_rates = CopyRates()

        def choose(self):
            self.last = Decision(next(sizes), "scripted")
            return self.last

        def update(self, bs, accepted, seconds, steady=True, tree=0, chain=0, odds=(), reach=0):
            self.updates.append((bs, steady))

        def copy_length(self, longest: int, rate: float) -> int:
            return longest

        def copied(self, width: int, seconds: float) -> None:

            pass

        def plain_step(self) -> float | None:
            return None  # untimed: waits for a copy are not priced

    plan = Scripted()
    ids = tiny_pair.tokenizer.encode("hello world")
    cfg = GenerationConfig(14, use_eos=False)
    list(speculative_stream(tiny_pair, ids, cfg, controller=plan))
    kinds = [bs for bs, t in plan.updates]
    assert kinds[:8] == [3, 1, 1, 1, 3, 3, 1, 1][: len(kinds[:8])]
    for i, (bs, t) in enumerate(plan.updates):
        after_own_kind = i > 0 and (kinds[i - 1] == 1) == (bs == 1)
        before_a_probe = bs == 1 and i + 1 < len(kinds) and kinds[i + 1] > 1
        assert t == (after_own_kind and not before_a_probe), (i, plan.updates)


def test_known_losing_contexts_probe_rarely():
    """Where the registry says the drafter loses (plain_first), the first probe waits the usual
    longest interval and the back-off goes 4x further; at poor acceptance that keeps probes
    to a handful per thousand steps."""
    ctl = controller(plain_first=True)
    sizes = drive(ctl, geometric(0.2, random.Random(6)), 1500)
    first = next(i for i, b in enumerate(sizes) if b > 1)
    assert first >= ctl.probe_base * 8 - 1  # the usual probe_max (64)
    assert sum(b > 1 for b in sizes[500:]) <= 1000 // 256 + 2
    assert ctl.interval == ctl.probe_max == 4 * 64


class SlowDrafter:
    """The real drafter plus `work` (a lazy chain of matmuls) in every drafting pass: device
    time a cycle's timing must see."""

    def __init__(self, real, work):
        self.real, self.work = real, work
        self.config = real.config

    def make_cache(self):
        return self.real.make_cache()

    def extend_context(self, features, cache):
        self.real.extend_context(features, cache)

    def __call__(self, block, cache):
        return self.real(block, cache) + 0.0 * self.work().sum()


def seconds_of(work) -> float:
    t0 = time.perf_counter()
    mx.eval(work())
    return time.perf_counter() - t0


def test_a_probe_after_plain_steps_runs_outside_their_timing(tiny_pair):
    """A drafting cycle after a plain step is queued after that step's sync: queued ahead, its
    work ran inside the plain step's interval, so the one-token step looked dear and the probe
    nearly free (and `auto` resumed drafting that did not pay). Drafting cycles after drafting
    ones are timed with their own work."""
    m = mx.random.normal((384, 384), key=mx.random.key(0)) / 20

    def work():
        x = m
        for _ in range(12):
            x = x @ m
        return x

    mx.eval(work())
    slow = min(seconds_of(work) for _ in range(3))  # the least is the work's own time
    pair = with_drafter(tiny_pair, SlowDrafter(tiny_pair.drafter, work))
    timed = []

    class Recording(Scripted):
        def update(self, bs, accepted, seconds, steady=True, tree=0, chain=0, odds=(), reach=0):
            timed.append((bs, seconds if steady else None))

    ids = tiny_pair.tokenizer.encode("hello world")
    cfg = GenerationConfig(40, use_eos=False, copy=False)  # the drafter's cycles only
    list(speculative_stream(pair, ids, cfg, controller=Recording([1, 1, 1, 1, 2, 2])))
    drafting = [s for (b, s), (b0, _) in zip(timed[1:], timed) if b == 2 and b0 == 2]
    plain = [s for b, s in timed if b == 1 and s]
    assert len(drafting) >= 5 and len(plain) >= 5
    # Noise only adds time: a drafting cycle holds at least most of the work, a plain step
    # (a one-token forward of the tiny target) far less than half of it.
    assert min(drafting) > 0.6 * slow, (slow, drafting)
    # (one stray descheduled step allowed; with the probe's work inside, every plain step
    # before a probe would be dear: one in four here)
    assert sum(s >= 0.5 * slow for s in plain) <= 1, (slow, plain)


def test_the_first_cycle_at_a_size_is_not_timed():
    """The first cycle at a size compiles its graphs: a one-off that must not make the size
    look dear (later cycles at a dear-looking size are rare, so it would stick)."""
    model = CostModel(CostCurve.generic(8))
    for seconds in (0.050, 0.004, 0.004):  # the first plain step is slow too
        model.observe(1, seconds)
    model.observe(8, 0.100)
    assert 8 not in model.seconds and model.cost(8) == CostCurve.generic(8).ratio(8)
    for seconds in (0.008, 0.010, 0.009):
        model.observe(8, seconds)
    assert model.unit == pytest.approx(0.004)
    assert model.cost(8) == pytest.approx(0.009 / 0.004)  # the mean of the first few


def test_a_probe_pays_only_if_it_beat_the_plain_steps_it_replaced():
    """Whether a probe paid is judged on its measured time (which includes appending the
    waiting context), not the steady cost of its size: break-even by the curve is a loss."""
    for seconds, paid in ((0.030, False), (0.015, True)):
        ctl = controller()
        for _ in range(3):
            ctl.update(1, 0, 0.010)  # the unit: 10 ms
        ctl.fallback, ctl.interval = True, 16
        ctl.update(2, 1, seconds, steady=False)  # 2 tokens; the curve says 1.57 steps
        assert ctl.interval == (8 if paid else 32), seconds
        assert 2 not in ctl.cost.seconds  # a probe's time does not teach the cost model


def test_probes_come_sooner_where_drafting_paid_much():
    """After a stretch where drafting ran near twice a plain step's rate, a poor stretch is
    probed every 16 steps or so, not every 128: a late resume would cost more than probes."""
    ctl = controller()
    rng = random.Random(7)
    drive(ctl, geometric(0.9, rng), 150)
    poor = drive(ctl, geometric(0.05, rng), 300)
    probes = [i for i, b in enumerate(poor) if b > 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and max(gaps) <= 2 * BlockController.PROBE_SCALE + 1, gaps
    assert max(gaps) < ctl.probe_max // 2


def test_a_size_next_to_the_chosen_one_gets_its_own_timing():
    """A quick prior that put block 8 8 % dearer than it is: `auto` drafted at 7 and never
    learnt 8's cost. Sizes next to the chosen one, close in rate and timed by the prior only,
    run now and then until timed, so the controller moves to 8 where 8 pays."""
    true = {1: 1.0, **{b: 1.5 + 0.07 * (b - 1) for b in range(2, 9)}}
    prior = CostCurve({**true, 8: true[8] * 1.08}, measured=True)

    def run(ctl: BlockController) -> list[int]:
        rng, sizes = random.Random(7), []
        accept = geometric(0.85, rng)
        for _ in range(400):
            bs = ctl.choose().size
            sizes.append(bs)
            ctl.update(bs, accept(bs) if bs > 1 else 0, 0.010 * true[bs])
        return sizes

    sizes = run(BlockController(8, CostModel(prior)))
    assert sizes[:16].count(7) >= 14  # the prior's choice first
    assert sizes[-200:].count(8) >= 190  # then 8, once timed
    timing = BlockController(8, CostModel(prior))
    run(timing)
    assert timing.cost.counts[8] >= timing.NEIGHBOUR_TIMINGS
    still = BlockController(8, CostModel(prior))
    still.NEIGHBOUR_EVERY = 10**9  # negative control: no neighbour timings
    assert run(still)[-200:].count(7) >= 190
    # a measured size far off in rate is not run for its timing
    far = BlockController(8, CostModel(CostCurve({**true, 8: true[8] * 1.5}, measured=True)))
    assert 8 not in run(far)
    # nor when choices must not depend on timings (seeded sampling)
    assert 8 not in run(BlockController(8, CostModel(prior), timed=False))


def test_acceptance_state_round_trips_worth_a_few_cycles_at_most():
    acc = Acceptance(8)
    for _ in range(200):
        acc.observe(5, 3)  # three of four drafts, every time
    fresh = Acceptance(8)
    assert fresh.restore(acc.state())
    assert fresh.alphas(3) == pytest.approx(acc.alphas(3), abs=0.01)  # the estimate carries over
    assert fresh.reached[0] == pytest.approx(Acceptance.MEMORY)  # …worth MEMORY cycles at most
    for _ in range(20):
        fresh.observe(5, 0)  # the text at hand soon outweighs it
    assert fresh.alphas(1)[0] < 0.5
    short = Acceptance(4)  # a smaller block: the extra positions are dropped
    assert short.restore(acc.state()) and len(short.reached) == 4
    for bad in (None, {}, {"reached": [1.0], "accepted": [2.0]}, {"reached": "x", "accepted": []}):
        keep = Acceptance(8)
        assert not keep.restore(bad) and keep.alphas(2) == Acceptance(8).alphas(2)


def test_a_new_process_starts_from_the_acceptance_earlier_ones_saw(
    tiny_pair, refs, tmp_path, monkeypatch
):
    """`auto` remembers each setting's acceptance in the data directory: a fresh controller
    (another process) starts from it instead of the generic guess. Seeded requests neither
    read nor write it."""
    from dflash_mac.sizing.files import acceptance_path, load_tuning, save_acceptance

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    ids, ref = refs[0]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320))  # all right
    bs = pair.block_size  # what `auto` runs up to
    tuning = load_tuning(pair)  # a process starts
    greedy = tuning.controller(bs, (0.0, 1.0, 0, 0.0))
    assert greedy.acc.alphas(1)[0] == pytest.approx(0.7)  # nothing remembered yet: the guess
    tokens, _ = tokens_of(pair, ids, GenerationConfig(48, use_eos=False), tuning=tuning)
    assert tokens == ref
    assert not acceptance_path(pair).exists()  # the stream writes nothing; front ends save
    save_acceptance(pair, tuning)
    saved = json.loads(acceptance_path(pair).read_text())
    assert list(saved) == [greedy.memory]
    tuning = load_tuning(pair)  # a new process
    again = tuning.controller(bs, (0.0, 1.0, 0, 0.0))
    assert again is not greedy and again.acc.alphas(1)[0] > 0.9  # what the last run saw
    # a memory only raises the start: one that expects less than the guess is not used
    poor = Acceptance(bs)
    for _ in range(50):
        poor.observe(bs, 0)
    assert not again.start_from(poor.state()) and again.acc.alphas(1)[0] > 0.9
    fresh = BlockController(bs, CostModel(CURVE))
    assert not fresh.start_from(poor.state()) and fresh.acc.alphas(1)[0] == pytest.approx(0.7)
    assert fresh.start_from(saved[greedy.memory]) and fresh.acc.alphas(1)[0] > 0.9
    assert tuning.controller(bs, (0.7, 1.0, 0, 0.0)).acc.alphas(1)[0] == 0.7
    seeded = GenerationConfig(24, sampling=SamplingParams(0.7), seed=3, use_eos=False)
    tuning = load_tuning(pair)
    list(speculative_stream(pair, ids, seeded, tuning=tuning))
    save_acceptance(pair, tuning)
    assert list(json.loads(acceptance_path(pair).read_text())) == [greedy.memory]
    assert tuning.controller(bs, (0.0, 1.0, 0, 0.0), timed=False).memory is None


def test_a_curve_at_a_long_context_charges_each_verified_token_for_the_context():
    """A 9-token verify: 1.58 plain steps at 256 tokens of context, 2.87 at 6,800 (measured
    on this machine, SmolLM2-135M fp32); the guess from the short curve lands near it."""
    short = CostCurve({1: 1.0, 9: 1.58, 33: 2.59})
    assert short.at_context(0).ratios == short.ratios
    assert short.at_context(6800).ratio(9) == pytest.approx(2.87, rel=0.05)
    assert short.at_context(4096).ratio(9) == pytest.approx(2.57, rel=0.05)
    assert short.at_context(2048).ratio(9) == pytest.approx(1.97, rel=0.1)
    assert short.at_context(6800).ratio(1) == 1.0 and not short.at_context(6800).measured


def test_a_long_band_starts_from_a_poor_memory_with_plain_steps():
    """Long contexts take a remembered acceptance that is worse than the guess too: a setting
    that lost there before starts with plain steps and probes, instead of drafting about a
    dozen dear cycles to learn it again (0.9x of a 96-token answer on 2k tokens at T 0.7).
    Control: a short context keeps the guess, and a good probe still brings drafting back."""
    poor = Acceptance(BS)
    for _ in range(50):
        poor.observe(BS, 0)
    setting, memory = (0.7, 1.0, 0, 0.0), json.dumps([BS, [0.7, 1.0, 0, 0.0], True])
    tuning = AutoTuning(greedy_curve=CURVE, sampled_curve=CURVE, remembered={memory: poor.state()})
    long = tuning.controller(BS, setting, 2000, sampled=True)
    assert long.memory == memory and long.acc.alphas(1)[0] < 0.2
    sizes = drive(long, lambda bs: bs - 1, 80)  # then the text turns predictable
    assert sizes[:6] == [1] * 6 and sizes[-30:] == [BS] * 30  # back within a few probes
    short = tuning.controller(BS, setting, 100, sampled=True)
    assert short.acc.alphas(1)[0] == pytest.approx(0.7) and short.choose().size > 1
    assert not BlockController(BS, CostModel(CURVE)).start_from(poor.state())


def test_the_context_fit_recovers_how_costs_grow_and_auto_prices_with_it(tmp_path):
    """`ContextCost.fit` inverts `at_context`: points timed on a machine whose plain step grows
    0.3 and whose verified tokens add 0.1 per 1,000 tokens give those back, and a saved curve
    with that fit prices long contexts by it (dearer than the default) while a malformed fit
    falls back to the default. Control: points that do not grow fit zero growth."""
    g, s, bs, base = 0.3, 0.1, 8, 128
    points = []
    for n in (base, 1024, 2048, 4096):
        k = (n - base) / 1000
        plain = 0.05 * (1 + g * k)
        points.append({"context": n, "plain": plain, "cycle": plain + 0.05 * (0.6 + 7 * s * k)})
    fit = ContextCost.fit(points, bs)
    assert fit.measured and fit.base == base
    assert fit.growth == pytest.approx(g) and fit.slope == pytest.approx(s)
    flat = [dict(p, plain=0.05, cycle=0.08) for p in points]
    assert ContextCost.fit(flat, bs).growth == 0 and ContextCost.fit(flat, bs).slope == 0
    assert not ContextCost.fit(points[:1], bs).measured  # one context: nothing to fit
    p = tmp_path / "c.json"
    table = {"1": 1.0, "8": 1.6}
    long = {"base": fit.base, "growth": fit.growth, "slope": fit.slope}
    p.write_text(json.dumps({"ratios": table, "long_context": long}))
    curve = CostCurve.load(p)
    assert curve.context == fit and curve.at_context(4096).measured
    expected = points[-1]["cycle"] / points[-1]["plain"]  # 0.6 extra at the base: 1.6
    assert curve.at_context(4096).ratio(8) == pytest.approx(expected)
    assert curve.at_context(4096).ratio(8) > CostCurve({1: 1.0, 8: 1.6}).at_context(4096).ratio(8)
    p.write_text(json.dumps({"ratios": table, "long_context": {"base": "x"}}))
    assert CostCurve.load(p).context == ContextCost() and not CostCurve.load(p).context.measured


def test_bench_cost_curve_times_long_contexts_and_auto_takes_the_fit(
    tiny_pair, tmp_path, monkeypatch
):
    """The long-context part of `bench --cost-curve` on a real (tiny) pair: a plain step and a
    cycle timed at each context that fits, shown as a table, saved, and the prior of the long
    bands from then on."""
    from dflash_mac.bench.costcurve import render
    from dflash_mac.calibrate import contexts_for, measure, measure_contexts, save
    from dflash_mac.sizing.files import cost_curve_path, load_tuning

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    pair = tiny_pair
    small = SimpleNamespace(context_length=2048)  # 2,048 leaves no room for the cycles
    assert contexts_for(small, 3) == [1024] and contexts_for(small, 3, (512, 4096)) == [512]
    curve = measure(pair, max_bs=3, context=16, reps=1)
    curve |= measure_contexts(pair, 3, base=16, contexts=(256, 1024, 4096), reps=1)
    long = curve["long_context"]
    assert [p["context"] for p in long["points"]] == [16, 256, 1024]
    assert all(p["cycle"] > 0 and p["plain"] > 0 for p in long["points"])
    assert long["base"] == 16 and long["block_size"] == 3 and long["growth"] >= 0
    table = render(curve)
    rows = table[table.index("Long contexts") :].splitlines()[2:5]
    assert [int(r.split()[0]) for r in rows] == [16, 256, 1024]
    save(curve, cost_curve_path(pair))
    tuning = load_tuning(pair)
    prior = tuning.prior(3, sampled=False, band=1024)
    assert prior.context == ContextCost.read(long) and prior.context.measured and prior.measured


def test_long_contexts_keep_a_cost_model_per_band():
    tuning = AutoTuning(greedy_curve=CURVE)
    ctl = {n: tuning.controller(BS, (), n) for n in (100, 1500, 2100, 5000, 7000)}
    assert ctl[1500] is not ctl[2100] and ctl[5000] is ctl[7000]  # bands from 1,024, 2,048, ...
    costs = [ctl[n].cost.cost(BS) for n in (100, 1500, 2100, 5000)]
    assert costs == sorted(costs) and costs[-1] > costs[0] + 0.7
    assert tuning.band(1023) == 0 and tuning.band(1024) == 1024 and tuning.band(5000) == 4096


def test_a_copy_is_as_long_as_it_pays():
    """A copy runs whole where it beats the chosen cycle; else it is cut to the length that
    pays best, or dropped. A short context keeps copies that a long one cuts."""
    tuning = AutoTuning(greedy_curve=CURVE)
    short, long = tuning.controller(BS, (), 100), tuning.controller(BS, (), 7000)
    for ctl in (short, long):
        ctl.last = Decision(1, "plain", {1: 1.0})
    assert short.copy_length(32, 0.95) == 32 and short.copy_length(8, 0.6) == 8
    assert 0 < long.copy_length(8, 0.6) < 8 and long.copy_length(32, 0.1) == 0
    assert long.copy_length(32, 0.99) == 32
    short.last = Decision(4, "drafting", {1: 1.0, 4: 1.8})  # a copy must beat that chain
    assert short.copy_length(8, 0.3) == 0
    # the control: the short context's costs at a long one keep every doubtful copy whole
    trusting = BlockController(BS, CostModel(CURVE))
    trusting.last = Decision(1, "plain", {1: 1.0})
    assert trusting.copy_length(8, 0.6) == 8


def test_copies_learn_their_cost_from_their_own_cycles():
    """A copy is priced as a chain as wide less its drafter pass, never timed until copies
    run: on the tiny pair short copies ran a fifth under that estimate and `auto` dropped
    doubtful ones that block 6 took. Copies timed at half their estimate make doubtful copies
    run longer; timed at twice it, shorter. The factor stays within the costs' TRUST, and a
    controller that times nothing learns nothing (reproducible choices)."""

    def controller(timed: bool = True) -> BlockController:
        ctl = BlockController(BS, CostModel(CURVE), timed=timed)
        ctl.cost.observe(1, 0.01)
        ctl.cost.observe(1, 0.01)  # the unit: 10 ms (a size's first timing is not used)
        ctl.last = Decision(4, "drafting", {1: 1.0, 4: 1.585})  # a copy must beat this chain
        return ctl

    before = controller().copy_length(8, 0.7)
    cheap, dear, untimed = controller(), controller(), controller(timed=False)
    for width in (3, 5, 9, 4) * 5:
        for ctl, times in ((cheap, 0.5), (dear, 2.0), (untimed, 0.5)):
            ctl.copied(width, times * CostModel(CURVE).copy(width) * 0.01)
    assert 0 < before < 8  # cut to the length that pays best
    assert cheap.cost.copy_scale < 0.6 and dear.cost.copy_scale > 1.8
    assert cheap.copy_length(8, 0.7) == 8 and dear.copy_length(8, 0.7) == 0
    estimate = CostModel(CURVE).copy(9)
    assert cheap.cost.copy(9) == pytest.approx(max(1.0, estimate / CostModel.TRUST))
    assert untimed.cost.copies == 0 and untimed.copy_length(8, 0.7) == before


def test_copy_rates_are_remembered_between_processes(tiny_pair, tmp_path, monkeypatch):
    """What a setting's copies got (`CopyRates`) is saved with its acceptance: a new process
    starts its copies from it. Another setting, a memory from before copy rates were kept and
    a malformed one start from the defaults."""
    from dflash_mac.drafting.copies import CopyRates
    from dflash_mac.sizing.files import acceptance_path, load_tuning, save_acceptance

    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    bs, sampled = tiny_pair.block_size, (0.7, 1.0, 0, 0.0)
    tuning = load_tuning(tiny_pair)
    c = tuning.controller(bs, sampled, sampled=True)
    assert c.copy_rates == CopyRates()
    c.copy_rates.sure_rate, c.copy_rates.doubtful_rate = 0.5, 0.2  # a sampled target said no
    save_acceptance(tiny_pair, tuning)
    again = load_tuning(tiny_pair).controller(bs, sampled, sampled=True)
    assert again is not c and again.copy_rates == CopyRates(0.5, 0.2)
    assert load_tuning(tiny_pair).controller(bs, (0.0, 1.0, 0, 0.0)).copy_rates == CopyRates()
    path = acceptance_path(tiny_pair)
    for bad in ({"sure_rate": 7.0}, "x", None):
        data = json.loads(path.read_text())
        data[c.memory]["copy"] = bad
        path.write_text(json.dumps(data))
        assert (
            load_tuning(tiny_pair).controller(bs, sampled, sampled=True).copy_rates == CopyRates()
        )
    data = json.loads(path.read_text())
    del data[c.memory]["copy"]  # written before copy rates were kept
    path.write_text(json.dumps(data))
    assert load_tuning(tiny_pair).controller(bs, sampled, sampled=True).copy_rates == CopyRates()


def odds_world(rng: random.Random, n: int) -> tuple[int, list[float]]:
    """One sampled cycle of n drafts in a toy world where the previous draft steers the target:
    q = [0.6, 0.2, 0.2] at every position; p = GOOD after draft 0 (and at the first position),
    BAD after 1 or 2. Drafts drawn from q, accepted while u * q(d) < p(d) (the rejection
    sampler's rule); (accepted, odds) as `verify.acceptance_odds` gives them."""
    q, good, bad = [0.6, 0.2, 0.2], [0.9, 0.05, 0.05], [0.05, 0.15, 0.8]
    took, expect, accepted, ok, prev = [], [], 0, True, 0
    for _ in range(n):
        p = good if prev == 0 else bad
        d = rng.choices(range(3), q)[0]
        took.append(min(1.0, p[d] / q[d]))
        expect.append(sum(min(a, b) for a, b in zip(p, q)))
        ok = ok and rng.random() * q[d] < p[d]
        accepted += ok
        prev = d
    return accepted, took + expect


def odds_world_truth(n: int) -> list[float]:
    """alpha_k = P(drafts 1..k accepted) / P(drafts 1..k-1 accepted), by enumeration."""
    q, good, bad = [0.6, 0.2, 0.2], [0.9, 0.05, 0.05], [0.05, 0.15, 0.8]
    mass = {0: 1.0}  # P(all accepted so far, last draft = d)
    survive = [1.0]
    for _ in range(n):
        nxt = {0: 0.0, 1: 0.0, 2: 0.0}
        for prev, m in mass.items():
            p = good if prev == 0 else bad
            for d in range(3):
                nxt[d] += m * q[d] * min(1.0, p[d] / q[d])
        mass = nxt
        survive.append(sum(mass.values()))
    return [survive[k + 1] / survive[k] for k in range(n)]


def test_sampled_cycles_count_expected_acceptance_not_the_draws():
    """A sampled cycle is counted by its acceptance odds: the same per-position estimate as
    counting accepted drafts (both unbiased against the exact alphas, where acceptance at a
    position depends on the drafts before it), with far less spread between runs, so `auto`
    at T > 0 decides on fewer cycles. Control: counting every position as reached, ignoring
    the odds of getting there, is biased and the test tells."""
    n, runs, cycles = 4, 60, 200
    truth = odds_world_truth(n)
    est: dict[str, list[list[float]]] = {"odds": [], "draws": [], "control": []}
    for seed in range(runs):
        rng = random.Random(seed)
        accs = {k: Acceptance(n + 1, decay=1.0, weight=0.0) for k in est}
        for _ in range(cycles):
            a, odds = odds_world(rng, n)
            accs["odds"].observe(n + 1, a, odds=odds)
            accs["draws"].observe(n + 1, a)
            for k in range(n):  # the control: every position reached, hit by its expectation
                accs["control"].reached[k] += 1
                accs["control"].accepted[k] += odds[n + k]
        for k, acc in accs.items():
            est[k].append(acc.alphas(n))
    mean = {k: [sum(r[j] for r in v) / runs for j in range(n)] for k, v in est.items()}
    sd = {
        k: [(sum((r[j] - mean[k][j]) ** 2 for r in v) / (runs - 1)) ** 0.5 for j in range(n)]
        for k, v in est.items()
    }
    for j in range(n):
        assert abs(mean["draws"][j] - truth[j]) < 4 * sd["draws"][j] / runs**0.5 + 0.01
        assert abs(mean["odds"][j] - truth[j]) < 4 * sd["odds"][j] / runs**0.5 + 0.01
        assert sd["odds"][j] < 0.75 * sd["draws"][j], (j, sd)
    assert min(abs(mean["control"][j] - truth[j]) for j in range(1, n)) > 0.04


def test_acceptance_odds_are_the_rejection_samplers_probabilities():
    """`acceptance_odds` against a direct computation: min(1, p(d)/q(d)) per draft, then
    sum(min(p, q)) per position."""
    from dflash_mac.engine.verify import acceptance_odds

    rng = random.Random(5)
    n, v = 3, 7
    q = [[rng.random() for _ in range(v)] for _ in range(n)]
    p = [[rng.random() for _ in range(v)] for _ in range(n + 1)]
    q = [[x / sum(r) for x in r] for r in q]
    p = [[x / sum(r) for x in r] for r in p]
    d = [2, 0, 5]
    got = acceptance_odds(mx.array(d), mx.array(q), mx.array(p)).tolist()
    want = [min(1.0, p[k][d[k]] / q[k][d[k]]) for k in range(n)]
    want += [sum(min(a, b) for a, b in zip(p[k], q[k])) for k in range(n)]
    assert got == pytest.approx(want, abs=1e-6)


def test_sampled_chains_hand_auto_their_odds_and_greedy_ones_none(small_pair):  # noqa: F811
    """Every sampled drafter cycle gives its controller 2 (bs - 1) odds in [0, 1] whose
    expected accepted drafts match the drafts it accepted, over the cycles (a 5-token
    vocabulary: a random drafter gets drafts accepted); greedy cycles give none. Control:
    counting every position as reached overshoots what was accepted."""

    class Recording(Scripted):
        def __init__(self, sizes):
            super().__init__(sizes)
            self.seen = []

        def update(self, bs, accepted, seconds, steady=True, tree=0, chain=0, odds=(), reach=0):
            self.seen.append((bs, accepted, tuple(odds)))

    def run(temp: float):
        plan = Recording([4])
        cfg = GenerationConfig(
            400, sampling=SamplingParams(temp), use_eos=False, copy=False, seed=1
        )
        list(speculative_stream(small_pair, [1, 4, 2, 0, 0], cfg, controller=plan))
        return plan.seen

    sampled = run(1.0)
    expected = control = 0.0
    for bs, accepted, odds in sampled:
        assert len(odds) == 2 * (bs - 1) and all(-1e-6 <= x <= 1 + 1e-6 for x in odds)
        expected += sum(positions(bs - 1, accepted, odds)[1])
        control += sum(odds[bs - 1 :])
    got = sum(a for _, a, _ in sampled)
    n = len(sampled)
    assert got > n / 4  # drafts do get accepted here
    assert abs(expected - got) < 3 * n**0.5, (expected, got, n)
    assert control > got + 6 * n**0.5, (control, got, n)
    assert all(odds == () for _, _, odds in run(0.0))


def host_drive(ctl: BlockController, ratios: dict[int, float], accepted: list[int], cycles: int):
    """`cycles` cycles on a host whose one-token step goes from 10 to 13 ms over the first
    half (a drift of a third, as measured on this project's CPU); a cycle at `bs` costs
    `ratios[bs]` steps and accepts the next of `accepted` (cycled; at most bs - 1). A cycle is
    timed amid its kind when the one before was of its kind (plain or drafting), as the
    pipeline times it. Returns the sizes chosen."""
    rng, sizes, last = random.Random(3), [], 0
    for i in range(cycles):
        bs = ctl.choose().size
        unit = 0.010 * (1 + 0.3 * min(i / (cycles / 2), 1.0))
        steady = last > 0 and (bs > 1) == (last > 1)
        a = min(accepted[i % len(accepted)], bs - 1)
        ctl.update(bs, a, unit * ratios[bs] * rng.uniform(0.97, 1.03), steady)
        sizes.append(bs)
        last = bs
    return sizes


def test_a_size_run_for_minutes_keeps_the_ratio_it_was_timed_at_while_the_host_drifts():
    """The costs are ratios to a one-token step. A size run on end tracks the host's speed
    through its ratio: it does not divide its current seconds by a plain step timed minutes
    earlier (a host slowed by 30 % made block 4 look 30 % dearer; sped up, cheaper)."""
    model = CostModel(CostCurve({1: 1.0, 4: 2.0}, measured=True))
    for seconds in (0.010, 0.010, 0.010):  # the first of each size is not used
        model.observe(1, seconds)
    for seconds in (0.020,) * 6:  # timed beside the plain steps: a ratio of 2.0
        model.observe(4, seconds)
    for k in range(200):  # then only block 4, while the host slows by 30 %
        model.observe(4, 0.020 * (1 + 0.3 * min(k / 100, 1.0)))
    assert model.cost(4) == pytest.approx(2.0, rel=0.01)
    assert model.unit == pytest.approx(0.013, rel=0.02)  # the host's speed, tracked
    # the control: where block 4 itself got dearer, a plain step timed beside it shows it
    for seconds in (0.013, 0.013):
        model.observe(1, seconds)
    for _ in range(8):
        model.observe(4, 0.0325)
    assert model.cost(4) > 2.4  # most of the way to 2.5 in one fresh window


def test_timed_plain_steps_find_out_a_curve_that_underprices_the_running_size():
    """A curve timed at another moment priced block 4 at 1.91 plain steps where it costs 2.43
    (the tiny pair at T 0.7, where `auto` kept block 4 at 0.8x plain for 713 cycles): with
    drafts accepted 60 % of the time block 4 looks worth 1.14x plain and is 0.9x. A few plain
    steps timed while drafting show it and `auto` falls back to plain steps. The control:
    without them it drafts on, and where the curve is right the timings stay rare."""
    prior = {1: 1.0, **{b: 1.5 + 0.137 * (b - 1) for b in range(2, 9)}}  # 1.91 at 4
    true = {1: 1.0, **{b: r * 1.27 for b, r in prior.items() if b > 1}}
    curve = CostCurve(prior, measured=True)
    # 20 cycles: alpha 0.55, 0.55, 0.5 at positions 1-3, none further: 2.0 tokens at block 4
    poor = [0, 1, 0, 2, 0, 3, 1, 0, 2, 0, 3, 0, 1, 0, 3, 1, 0, 2, 0, 1]

    class Untimed(BlockController):
        UNIT_EVERY = (10**9,) * 3

    plain = lambda s: s[-1000:].count(1)  # noqa: E731
    assert plain(host_drive(BlockController(8, CostModel(curve)), true, poor, 2000)) > 800
    assert plain(host_drive(Untimed(8, CostModel(curve)), true, poor, 2000)) < 100
    right = BlockController(8, CostModel(curve))  # the curve is right: timings grow rare
    sizes = host_drive(right, prior, poor, 2000)
    assert sizes.count(1) < 0.02 * len(sizes) and right.unit_every == right.UNIT_EVERY[2]
    paying = BlockController(8, CostModel(curve))  # past the costs' TRUST: none at all
    assert 1 not in host_drive(paying, true, [7, 3, 5, 7, 2, 7], 2000)
