"""Suffix drafting through the engine: drafts from earlier answers leave greedy output exactly
the target's (forced block sizes and `auto`, one request and the batch engine, on a worker
thread), keep the sampled distribution (chi-square, with a lossy rule the test rejects), and a
session's second request drafts from the first's answer."""

from __future__ import annotations

import threading

import pytest
from dflash_mac.models.distribution import SamplingParams
from helpers.lossy import accepting_every_draft
from test_sampling import chi_square_p, exact_joint, small_pair  # noqa: F401  (fixture)

from dflash_mac.api import generate, make_config
from dflash_mac.batching.scheduler import BatchEngine, BatchRequest
from dflash_mac.engine.decode import DecodeState
from dflash_mac.session import Session
from dflash_mac.sizing.choice import block_size_for
from dflash_mac.sizing.tuning import AutoTuning

SRC = "def add(a, b):\n    return a + b\n"


def on_worker(fn):
    """Run `fn` on a thread of its own (as the server does); its result or its exception."""
    got: dict = {}

    def work():
        try:
            got["out"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised on the caller's thread)
            got["err"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "err" in got:
        raise got["err"]
    return got["out"]


def reference(pair, ids, n=40):
    return generate(pair, ids, max_tokens=n, use_eos=False, block_size=1, copy=False).tokens


@pytest.mark.parametrize("block", [1, 4, "auto"])
def test_greedy_output_is_the_targets_through_suffix_drafts(tiny_pair, block):
    ids = tiny_pair.tokenizer.encode(SRC)
    ref = reference(tiny_pair, ids)

    def run(seed_answer):
        tuning = AutoTuning()
        tuning.answers.add(seed_answer)
        return generate(
            tiny_pair, ids, max_tokens=40, use_eos=False, block_size=block, copy=False,
            suffix=True, tuning=tuning,
        )  # fmt: skip

    right = on_worker(lambda: run(ref))  # an earlier answer that goes on as this one does
    assert right.tokens == ref
    assert right.stats.suffix_cycles > 0 and right.stats.suffix_tokens > right.stats.suffix_cycles
    assert right.stats.cycles < len(ref)
    # an earlier answer that goes wrong after a few tokens: rejected there, output unchanged
    wrong = ref[:6] + [(t + 1) % 200 + 50 for t in ref[6:]]
    assert on_worker(lambda: run(wrong)).tokens == ref


def test_suffix_off_drafts_nothing_from_earlier_answers(tiny_pair):
    ids = tiny_pair.tokenizer.encode(SRC)
    ref = reference(tiny_pair, ids)
    tuning = AutoTuning()
    tuning.answers.add(ref)
    out = generate(
        tiny_pair, ids, max_tokens=40, use_eos=False, block_size=4, copy=False, suffix=False,
        tuning=tuning,
    )  # fmt: skip
    assert out.tokens == ref and out.stats.suffix_cycles == 0


def test_a_session_drafts_from_its_earlier_answer(tiny_pair):
    """The second request asks for the same text in another conversation: its answer repeats
    the first's, which only the memory holds (its own prompt does not)."""
    session = Session(tiny_pair, cache_size=2, tuning=AutoTuning())
    a = tiny_pair.tokenizer.encode("# one\n" + SRC)
    b = tiny_pair.tokenizer.encode("# two\n" + SRC)

    def ask(ids):
        events = list(
            session.stream(ids, max_tokens=40, use_eos=False, block_size=4, copy=False, suffix=True)
        )
        return [t for e in events for t in e.tokens], events[-1].stats

    first, s1 = on_worker(lambda: ask(a))
    assert s1.suffix_cycles == 0 and session.tuning.answers.tokens == len(first)
    second, s2 = on_worker(lambda: ask(b))
    assert second == reference(tiny_pair, b)
    if second[:8] == first[:8]:  # the tiny target answers both alike: the memory pays
        assert s2.suffix_cycles > 0


def test_the_batch_engine_drafts_from_earlier_answers(tiny_pair):
    ids = tiny_pair.tokenizer.encode(SRC)
    ref = reference(tiny_pair, ids)
    other = tiny_pair.tokenizer.encode("import os\n")
    tuning = AutoTuning()
    tuning.answers.add(ref)
    engine = BatchEngine(tiny_pair, max_batch=2, block_size=4, auto=False, solo=tuning)
    got: dict[int, list] = {0: [], 1: []}
    last = {}

    def request(i, prompt):
        cfg = make_config(max_tokens=40, use_eos=False, copy=False, suffix=True)
        cfg.block = block_size_for(tiny_pair, 4)

        def emit(ev):
            got[i] += ev.tokens
            last[i] = ev.stats

        return BatchRequest(prompt, cfg, DecodeState(tiny_pair), emit)

    def run():
        engine.add(request(0, ids))
        engine.add(request(1, other))  # two rows: batched cycles, not the lone loop
        engine.run()

    on_worker(run)
    assert got[0] == ref and got[1] == reference(tiny_pair, other)
    assert last[0].suffix_cycles > 0 and engine.stats.suffix_cycles > 0
    assert engine.answers is tuning.answers and tuning.answers.tokens >= len(ref) * 2


# -- sampled: the target's distribution, exactly ------------------------------------------------
PERIODIC = [0, 3, 0, 1, 0, 3, 1, 2, 0, 3, 2, 3, 0, 3, 3, 4, 0, 3, 4, 0, 0, 3]


def seeded_tuning() -> AutoTuning:
    """Earlier answers that go on from the prompt's last three tokens and any next token."""
    tuning = AutoTuning()
    for x in range(5):
        tuning.answers.add([0, 0, 3, x, (x + 1) % 5, (x + 2) % 5])
    return tuning


def samples_with_suffixes(pair, sp, block, n) -> tuple[list[tuple], int]:
    session, out, drafts = Session(pair, tuning=seeded_tuning()), [], 0
    for _ in range(n):
        events = list(
            session.stream(
                PERIODIC, max_tokens=3, block_size=block, temp=sp.temperature,
                use_eos=False, copy=False, suffix=True,  # unseeded: see the test below
            )
        )  # fmt: skip
        out.append(tuple(t for e in events for t in e.tokens))
        drafts += events[-1].stats.suffix_cycles
    return out, drafts


@pytest.mark.slow
def test_sampled_suffix_drafts_keep_the_target_distribution(small_pair):  # noqa: F811
    sp = SamplingParams(temperature=1.0)
    samples, drafts = samples_with_suffixes(small_pair, sp, 1, 1200)
    assert drafts >= 1000  # the test is about suffix drafts: nearly every sample had one
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=PERIODIC)) > 0.001


@pytest.mark.slow
def test_a_lossy_suffix_rule_is_detected(small_pair, monkeypatch):  # noqa: F811
    """Accepting every proposed token (no rejection) must fail the same test."""
    import dflash_mac.engine.drafts as engine

    monkeypatch.setattr(engine, "accept_sampled", accepting_every_draft(engine.accept_sampled))
    sp = SamplingParams(temperature=1.0)
    samples, drafts = samples_with_suffixes(small_pair, sp, 1, 600)
    assert drafts >= 500
    assert chi_square_p(samples, exact_joint(small_pair, sp, prompt=PERIODIC)) < 1e-6


def test_a_seeded_sampled_request_drafts_nothing_from_earlier_answers():
    """Same seed, same text: its random draws must not follow what earlier requests said."""
    seeded = make_config(temp=0.7, seed=3, suffix=True)
    assert not seeded.suffixes
    assert make_config(temp=0.7, suffix=True).suffixes and make_config(seed=3, suffix=True).suffixes
