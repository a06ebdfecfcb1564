"""Copy drafting: the index finds earlier occurrences (never the suffix itself), the policy
sizes and pauses copies, greedy output is unchanged, and sampled output keeps the target's
exact distribution (chi-square, with a lossy rule the test must reject)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from dflash_mac.models.distribution import SamplingParams
from helpers.lossy import accepting_every_draft
from helpers.oracle import OracleDrafter, with_drafter
from test_sampling import chi_square_p, exact_joint, small_pair  # noqa: F401  (fixture)

from dflash_mac.api import generate
from dflash_mac.drafting.copies import CopyIndex, CopyPolicy, CopyRates
from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.engine.stats import DecodeStats
from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.sizing.controller import BlockController
from dflash_mac.sizing.tuning import AutoTuning

# (0, 3, x) occurred for every token x, and the prompt ends with (0, 3): whatever the first
# token, the next cycle copies what followed it
PERIODIC = [0, 3, 0, 1, 0, 3, 1, 2, 0, 3, 2, 3, 0, 3, 3, 4, 0, 3, 4, 0, 0, 3]


def test_index_finds_the_latest_earlier_occurrence():
    idx = CopyIndex([5, 6, 7, 8, 9, 5, 6, 7, 1])
    assert idx.propose(3, 3) == []  # (7, 1, 3) never occurred, nor 3 after the source left
    idx = CopyIndex([5, 6, 7, 8, 9, 5, 6])
    assert idx.propose(7, 3) == [8, 9, 5]  # (5, 6, 7) ended at 2: what followed
    assert idx.propose(7, 7) == [8, 9, 5, 6, 7, 8, 9]  # to the anchor, then again (a loop)
    idx.extend([7, 2, 2, 5, 6])  # (5, 6, 7) now also ended at 7
    assert idx.propose(7, 2) == [2, 2]
    assert idx.may_match() and not CopyIndex([1, 2, 3]).may_match()


def test_a_pair_seen_before_is_not_a_repeat():
    # (1, 2) occurred, but the text does not follow anything earlier: steps may be queued ahead
    idx = CopyIndex([1, 2, 9, 4, 5, 6, 7, 8, 10, 11, 12, 13, 1, 2])
    assert not idx.may_match()
    idx.extend([9])  # now it follows the start: the next anchor may go on with a copy
    assert idx.may_match() and idx.propose(4, 2) == [5, 6]


def test_the_copy_follows_its_source_past_later_repeats_of_a_few_tokens():
    # the answer copies the first line; (2, 3, 4) also occurred later, followed by 7
    idx = CopyIndex([1, 2, 3, 4, 5, 6, 2, 3, 4, 7, 1, 2, 3])
    assert idx.propose(4, 2) == [5, 6]  # the source the copy started from, not the latest
    idx.extend([4, 5])
    assert idx.propose(6, 3) == [2, 3, 4]
    idx.extend([6, 8])  # the answer leaves the source: the latest occurrence again
    assert idx.follow is None and idx.propose(9, 2) == []


def test_a_copy_resumes_right_after_an_edit():
    # source: 1 2 3 40 5 6 7 8 (40: a name); the answer renames it to 41 42
    idx = CopyIndex([1, 2, 3, 40, 5, 6, 7, 8, 0, 1, 2, 3, 41, 42])
    assert idx.propose(5, 3) == [6, 7, 8]  # no (41, 42, 5) anywhere: resumed past the name
    idx.extend([5, 6, 7, 8])
    assert idx.propose(0, 2) == [1, 2]  # and the copy goes on
    far = CopyIndex([1, 2, 3, 40, 5, 6, 7, 8, 0, 1, 2, 3, *range(50, 62)])
    assert far.propose(5, 3) == []  # left the source long ago: no guess


def test_index_never_matches_the_suffix_itself():
    idx = CopyIndex([3, 3])
    assert idx.propose(3, 4) == []  # (3, 3, 3) would only match itself
    idx.extend([3])
    assert idx.propose(3, 4) == [3, 3, 3, 3]  # (3, 3, 3) ended before the anchor: a loop


def test_policy_grows_shrinks_and_pauses():
    p = CopyPolicy(longest=16, budget=4)
    assert p.length() == 4
    p.update(4, 4)
    assert p.length() == 8
    p.update(8, 3)
    assert p.length() == 5
    for _ in range(3):
        p.update(5, 0)
    assert [p.length() for _ in range(9)] == [0] * 8 + [2]  # paused 8 cycles, then small
    for _ in range(3):
        p.update(2, 0)
    assert sum(p.length() == 0 for _ in range(20)) == 16  # the next pause is twice as long
    assert p.counts == {"cycles": 8, "tokens": 7}


@pytest.mark.parametrize("block", [1, 4, "auto"])
def test_greedy_output_is_unchanged(tiny_pair, block):
    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    off = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=block, copy=False)
    on = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=block, copy=True)
    assert on.tokens == off.tokens
    assert off.stats.copy_cycles == 0 and on.stats.copy_cycles > 0
    assert on.stats.copy_tokens > on.stats.copy_cycles  # some copies were accepted
    assert on.stats.cycles < off.stats.cycles
    # the drafter's own acceptance pictures leave copies out
    assert sum(on.stats.histogram) == on.stats.draft_cycles
    assert on.stats.draft_cycles + on.stats.copy_cycles + on.stats.plain_steps >= on.stats.cycles


def test_greedy_with_an_oracle_drafter_wrong_30_percent(tiny_pair):
    ids = tiny_pair.tokenizer.encode("import os\nimport os\nimport")
    ref = generate(tiny_pair, ids, max_tokens=40, use_eos=False, block_size=1, copy=False).tokens
    oracle = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, 1))
    out = generate(oracle, ids, max_tokens=40, use_eos=False, block_size=6, copy=True)
    assert out.tokens == ref


def samples_with_copies(pair, sp, block, n) -> tuple[list[tuple], int]:
    session, out, copies = Session(pair), [], 0
    for seed in range(n):
        events = list(
            session.stream(
                PERIODIC, max_tokens=3, block_size=block, temp=sp.temperature, seed=seed,
                use_eos=False, copy=True,
            )
        )  # fmt: skip
        out.append(tuple(t for e in events for t in e.tokens))
        copies += events[-1].stats.copy_cycles
    return out, copies


@pytest.mark.slow
@pytest.mark.parametrize("block", [1, 4])
def test_sampled_copies_keep_the_target_distribution(small_pair, block):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp, prompt=PERIODIC)
    samples, copies = samples_with_copies(small_pair, sp, block, 1200)
    assert copies >= 1000  # the test is about copies: nearly every sample had one
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_lossy_copy_rule_is_detected(small_pair, monkeypatch):  # noqa: F811
    """Accepting every copied token (no rejection) must fail the same test; at block 1 every
    draft is a copy."""
    import dflash_mac.engine.drafts as engine

    real = engine.accept_sampled
    accept_all = accepting_every_draft(real)

    monkeypatch.setattr(engine, "accept_sampled", accept_all)
    sp = SamplingParams(temperature=1.0)
    samples, copies = samples_with_copies(small_pair, sp, 1, 600)
    assert copies >= 500
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=PERIODIC)) < 1e-6


def test_the_policy_keeps_apart_how_whole_and_partial_copies_go_on():
    policy = CopyPolicy()
    rates = policy.rates
    sure, doubtful = rates.sure_rate, rates.doubtful_rate
    policy.update(8, 2)  # a partial copy (the policy was not sure): the doubtful rate moves
    assert rates.doubtful_rate != doubtful and rates.sure_rate == sure
    assert not policy.sure and policy.rate == rates.doubtful_rate
    policy.update(4, 4)  # whole: the next is sure
    assert policy.sure and policy.rate == rates.sure_rate
    policy.update(8, 1)  # a sure copy that broke off early lowers the sure rate
    assert rates.sure_rate < sure


def test_what_copies_got_carries_over_to_the_next_request_of_the_setting(tiny_pair):
    """The `auto` controller of a setting keeps its requests' copy rates (`CopyRates`): the next
    request starts from what the last ones' copies got, not from the fresh 0.95 / 0.6 (a
    sampled target that turned copies down does not pay for them again). Control: a request
    with a fixed block size keeps its rates to itself."""
    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    cfg = GenerationConfig(48, use_eos=False)
    tuning = AutoTuning()
    first = list(speculative_stream(tiny_pair, ids, cfg, tuning=tuning))
    assert first[-1].stats.copied.count(True) > 0
    (ctl,) = tuning.controllers.values()
    learnt = replace(ctl.copy_rates)
    assert learnt != CopyRates()  # the copies moved them
    list(speculative_stream(tiny_pair, ids, cfg, tuning=tuning))
    assert ctl.copy_rates != learnt  # the next request's copies went on from them
    kept = replace(ctl.copy_rates)
    fixed = GenerationConfig(48, use_eos=False, block=BlockChoice(4))
    assert any(e.stats.copied.count(True) for e in speculative_stream(tiny_pair, ids, fixed))
    assert ctl.copy_rates == kept


def test_text_that_repeats_is_copied_after_poor_copies_elsewhere(tiny_pair, monkeypatch):
    """Rates carried over from text whose copies failed price every copy out, and rates move
    only when copies run: a probing copy after a few refusals, priced at a fresh start's
    rate for a repeat taken whole, finds out that this request repeats its prompt. Controls:
    without the probe it never copies, nor where even that rate would not pay (a long
    context's costs)."""
    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    cfg = GenerationConfig(48, use_eos=False, tree=0)
    fresh, refused = CopyRates().doubtful_rate, []

    def costs(self, longest: int, rate: float) -> int:  # copies pay at a fresh start's rates
        refused.append(rate < fresh)
        return longest if rate >= fresh else 0

    def run() -> DecodeStats:
        tuning = AutoTuning()
        ctl = tuning.controller(tiny_pair.block_size, (0.0, 1.0, 0, 0.0))
        ctl.copy_rates = CopyRates(sure_rate=0.3, doubtful_rate=0.1, doubtful_hit=0.2)
        events = list(speculative_stream(tiny_pair, ids, cfg, tuning=tuning))
        assert [t for e in events for t in e.tokens] == plain.tokens
        return events[-1].stats

    plain = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=1, copy=False)
    monkeypatch.setattr(BlockController, "copy_length", costs)
    stats = run()
    assert any(refused) and stats.copy_cycles > 0
    assert stats.copy_tokens > 2 * stats.copy_cycles  # the probes' copies were accepted
    monkeypatch.setattr(BlockController, "copy_length", lambda self, longest, rate: 0)
    assert run().copy_cycles == 0  # even a fresh start's rates lose: no probe
    monkeypatch.setattr(BlockController, "copy_length", costs)
    monkeypatch.setattr(CopyPolicy, "probe", lambda self, longest: 0)
    assert run().copy_cycles == 0


def test_where_only_whole_repeats_pay_a_probe_finds_them(tiny_pair, monkeypatch):
    """Where a verify is dear (the bundled tiny pair on a CPU: a 5-token verify costs over two
    plain steps) a copy pays only if it is taken whole. A probe priced at a fresh start's
    doubtful rate never ran there, and `auto` copied nothing on text that repeats, where
    block 8 copied in 318 of its 701 cycles. Priced as a repeat taken whole, the probe runs,
    is taken whole, and the copies after it are priced at the sure rate it taught. Control:
    where even a whole repeat would not pay, nothing is copied."""
    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    cfg = GenerationConfig(48, use_eos=False, tree=0)
    plain = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=1, copy=False)

    def run(pays: float) -> DecodeStats:
        monkeypatch.setattr(BlockController, "copy_length", lambda s, n, r: n if r >= pays else 0)
        events = list(speculative_stream(tiny_pair, ids, cfg, tuning=AutoTuning()))
        assert [t for e in events for t in e.tokens] == plain.tokens
        return events[-1].stats

    stats = run(CopyRates().sure_rate)
    assert stats.copy_cycles > 0 and stats.copy_tokens > 2 * stats.copy_cycles
    assert run(1.0).copy_cycles == 0


@pytest.mark.parametrize("pause", [8, 10**6])
def test_a_pause_ends_among_plain_steps_queued_ahead(tiny_pair, monkeypatch, pause):
    """Plain steps are queued ahead on a lazy anchor and cannot copy, but each is a cycle of
    the pause: a pause begun among them ends, and copies resume (a looping answer of the
    default pair ran 100 plain steps with no copy: the pause only counted cycles that could
    copy). Control: a pause longer than the answer keeps every copy out."""
    import functools

    import dflash_mac.engine.row as row

    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    monkeypatch.setattr(row, "CopyPolicy", functools.partial(CopyPolicy, paused=pause))
    plain = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=1, copy=False)
    out = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=1, copy=True)
    assert out.tokens == plain.tokens
    if pause > 48:
        assert out.stats.copy_cycles == 0
    else:
        assert out.stats.copy_cycles > 0 and out.stats.copy_tokens > out.stats.copy_cycles


def test_waits_for_an_anchor_stop_where_they_lost_but_every_eighth():
    """Where waiting for a plain step's token on the host (a copy may follow it) gained
    lately, every chance waits; where it lost, only every WAIT_PROBE-th, so the gain stays
    measured. What a wait gained moves the average, clamped to a missed step at worst."""
    policy = CopyPolicy()
    assert all(policy.waits() for _ in range(20))  # the prior: waits run until measured
    for _ in range(40):
        policy.waited(-5.0)  # clamped: a wait never costs more than a step
    assert -1.0 <= policy.rates.wait_gain < -0.9
    waits = [policy.waits() for _ in range(4 * CopyPolicy.WAIT_PROBE)]
    assert sum(waits) == 4 and waits[CopyPolicy.WAIT_PROBE - 1]
    for _ in range(40):
        policy.waited(6.0)  # a long copy taken whole
    assert policy.rates.wait_gain > 5 and all(policy.waits() for _ in range(20))
    assert CopyRates.read(CopyRates(wait_gain=-3.0).state()) == CopyRates()  # out of range


class PlainSteps:
    """Plain steps only, with copies priced in and a one-token step of `unit` seconds."""

    def __init__(self, unit: float, rates: CopyRates):
        from dflash_mac.sizing.controller import Decision

        self.unit, self.copy_rates = unit, rates
        self.last = Decision(1, "scripted")

    def choose(self):
        return self.last

    def update(self, *args, **kwargs) -> None:
        pass

    def copy_length(self, longest: int, rate: float) -> int:
        return longest

    def copied(self, width: int, seconds: float) -> None:

        pass

    def plain_step(self) -> float | None:
        return self.unit


@pytest.mark.parametrize("unit, pays", [(1e3, True), (1e-9, False)])
def test_the_cycle_learns_what_waiting_for_an_anchor_gains(tiny_pair, monkeypatch, unit, pays):
    """Plain steps on text that repeats: each that may be followed by a copy waits for its
    token, and the cycle after it teaches the policy what the wait gained against a step
    queued ahead, in plain steps of the controller's timing: with a dear step (1,000 s) the
    copies' tokens dwarf any wait, so waits go on; with a cheap one (1 ns) every wait is
    a lost step, so they stop but for every 8th. Output is the target's either way."""
    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    plain = generate(tiny_pair, ids, max_tokens=64, use_eos=False, block_size=1, copy=False)
    asked = []
    real = CopyPolicy.waits
    monkeypatch.setattr(CopyPolicy, "waits", lambda self: asked.append(real(self)) or asked[-1])
    plan = PlainSteps(unit, CopyRates())
    cfg = GenerationConfig(64, use_eos=False, tree=0)
    events = list(speculative_stream(tiny_pair, ids, cfg, controller=plan))
    assert [t for e in events for t in e.tokens] == plain.tokens
    assert len(asked) > 8
    if pays:
        assert plan.copy_rates.wait_gain > 0.5 and all(asked)
        assert events[-1].stats.copy_cycles > 0
    else:
        assert plan.copy_rates.wait_gain < 0 and sum(asked) < len(asked) / 2


def test_copy_cycles_teach_the_controller_what_a_copy_costs(tiny_pair, monkeypatch):
    """A copy is priced from the curve (a chain as wide less its drafter pass) and corrected
    by what copy cycles measure: each steady copy cycle's width and time reach the cost model
    (`CostModel.observe_copy`), no drafting cycle's do. Output is the target's. Control: a
    controller that times nothing (seeded sampling) learns nothing."""
    from dflash_mac.sizing.cost import CostModel

    tok = tiny_pair.tokenizer
    src = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(src * 3 + "# again\n" + src[:20])
    plain = generate(tiny_pair, ids, max_tokens=48, use_eos=False, block_size=1, copy=False)
    seen = []
    real = CostModel.observe_copy
    monkeypatch.setattr(
        CostModel, "observe_copy", lambda self, w, s: seen.append((w, s)) or real(self, w, s)
    )
    monkeypatch.setattr(BlockController, "copy_length", lambda self, longest, rate: longest)
    for timed in (True, False):
        seen.clear()
        tuning = AutoTuning()
        ctl = tuning.controller(tiny_pair.block_size, (0.0, 1.0, 0, 0.0), timed=timed)
        cfg = GenerationConfig(48, use_eos=False, tree=0)
        events = list(speculative_stream(tiny_pair, ids, cfg, controller=ctl))
        assert [t for e in events for t in e.tokens] == plain.tokens
        stats = events[-1].stats
        assert stats.copy_cycles > 1
        if timed:
            widths = [b for b, c in zip(stats.block_sizes, stats.copied) if c]
            assert seen and len(seen) <= stats.copy_cycles
            assert all(w in widths and s > 0 for w, s in seen)
            assert 0 < ctl.cost.copies <= len(seen)  # those after a plain step was timed
            assert ctl.cost.copy_scale != 1.0
        else:
            assert ctl.cost.copies == 0
