"""The quick cost curve measured at the first use of `--block-size auto` (dflash_mac/calibrate.py):
when it is measured, what it saves, that `auto` takes it as its prior, and that it leaves the
pair decoding exactly, on worker threads."""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import pytest
from helpers.oracle import with_drafter
from mlx_lm.generate import generate_step

from dflash_mac import calibrate
from dflash_mac.engine.decode import GenerationConfig, speculative_stream
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.sizing.files import cost_curve_path, load_tuning


@pytest.fixture
def pair(tiny_pair, tmp_path, monkeypatch):
    """The tiny pair with nothing learnt and a fresh data directory."""
    monkeypatch.setenv("DFLASH_MAC_HOME", str(tmp_path))
    monkeypatch.delenv(calibrate.CALIBRATE_ENV, raising=False)
    return with_drafter(tiny_pair, tiny_pair.drafter)


def test_non_decreasing_pools_the_dips():
    assert calibrate.non_decreasing([1.7, 1.9, 1.8, 2.2]) == pytest.approx([1.7, 1.85, 1.85, 2.2])
    assert calibrate.non_decreasing([2.0, 1.0, 1.5]) == pytest.approx([1.5, 1.5, 1.5])
    rising = [1.5, 1.6, 1.6, 2.0]
    assert calibrate.non_decreasing(rising) == rising


def test_the_quick_curve_times_fewer_sizes_and_fills_the_rest_between_its_neighbours(
    pair, monkeypatch
):
    assert calibrate.quick_sizes(8) == [1, 2, 3, 4, 6, 8]
    assert calibrate.quick_sizes(16) == [1, 2, 3, 4, 6, 8, 10, 12, 14, 16]
    assert calibrate.quick_sizes(5) == [1, 2, 3, 4, 5] and calibrate.quick_sizes(2) == [1, 2]
    filled = calibrate.interpolate({1: 1.0, 4: 2.5, 6: 3.0}, 6)
    assert filled == pytest.approx({1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 2.75, 6: 3.0})
    timed = set()
    real = calibrate.script

    def spy(arms, rng, warmup=False):
        timed.update(bs for bs, tree in arms if not tree)
        return real(arms, rng, warmup)

    monkeypatch.setattr(calibrate, "script", spy)
    curve = calibrate.measure(pair, max_bs=6, context=16, reps=1, sizes=calibrate.quick_sizes(6))
    assert timed == {1, 2, 3, 4, 6} and curve["interpolated"] == [5]
    secs = {int(b): s for b, s in curve["seconds"].items()}
    assert secs[5] == pytest.approx((secs[4] + secs[6]) / 2)
    assert set(curve["ratios"]) == {str(b) for b in range(1, 7)}
    assert "interpolated" not in calibrate.measure(pair, max_bs=2, context=16, reps=1)


def test_measured_ratios_never_fall_with_the_block_size(pair):
    curve = calibrate.measure(pair, max_bs=6, context=16, reps=1)
    ratios = [curve["ratios"][str(b)] for b in range(1, 7)]
    assert ratios[0] == 1.0
    assert all(b >= a for a, b in zip(ratios[1:], ratios[2:]))


def test_the_curve_times_tree_cycles_and_auto_takes_them(pair, tmp_path):
    from dflash_mac.bench.costcurve import render
    from dflash_mac.sizing.controller import TREES
    from dflash_mac.sizing.cost import CostCurve, tree_curve

    curve = calibrate.measure(pair, max_bs=4, context=16, reps=2)
    assert set(curve["trees"]) == {str(b) for b in TREES} and curve["tree_depth"] == 3
    assert all(r > 1.0 for r in curve["trees"].values())  # a tree costs more than a step
    assert "Tree cycles (depth 3)" in render(curve)
    path = calibrate.save(curve, tmp_path / "curve.json")
    loaded = CostCurve.load(path)
    prior = tree_curve(loaded, TREES)
    assert prior.measured and prior.ratio(8) == pytest.approx(curve["trees"]["8"])


def test_a_quick_curve_of_fast_cycles_times_more_rounds(pair, monkeypatch, tmp_path):
    """Where the quick rounds take less than QUICK_SECONDS (a small model: cycles of a few
    milliseconds, whose medians over three rounds priced the tiny pair's block 8 at 2.9 plain
    steps where twelve said 2.4) more are timed, up to FULL_REPS, beyond the progress count
    the front ends show; the control: a budget already spent stops at QUICK_REPS."""
    monkeypatch.setattr(calibrate, "cost_curve_path", lambda pair: tmp_path / "curve.json")
    for budget, reps in ((1e9, calibrate.FULL_REPS), (0.0, calibrate.QUICK_REPS)):
        monkeypatch.setattr(calibrate, "QUICK_SECONDS", budget)
        steps = []
        calibrate.calibrate(pair, 2, progress=lambda s=steps: s.append(1))
        saved = json.loads((tmp_path / "curve.json").read_text())
        assert saved["reps"] == saved["sampled"]["reps"] == reps
        assert len(steps) == calibrate.rounds(calibrate.QUICK_REPS)


def test_first_use_measures_and_saves_a_quick_curve_that_auto_takes(pair, monkeypatch):
    monkeypatch.setattr(calibrate, "QUICK_SECONDS", 0.0)  # the rounds it always times
    bs = 3
    assert calibrate.missing(pair, bs)
    assert not load_tuning(pair).controller(bs).cost.prior.measured  # before: the guess
    steps = []
    path = calibrate.calibrate(pair, bs, progress=lambda: steps.append(1))
    assert path == cost_curve_path(pair) and path.exists()
    assert len(steps) == calibrate.rounds(calibrate.QUICK_REPS)
    saved = json.loads(path.read_text())
    assert saved["quick"] and saved["reps"] == calibrate.QUICK_REPS
    assert set(saved["ratios"]) == set(saved["sampled"]["ratios"]) == {"1", "2", "3"}
    assert not calibrate.missing(pair, bs)  # once per pair and machine
    assert calibrate.missing(pair, bs + 1)  # auto may now pick wider than the curve reaches
    tuning = load_tuning(pair)
    for sampled in (False, True):
        prior = tuning.controller(bs, (sampled,), sampled=sampled).cost.prior
        table = saved["sampled"]["ratios"] if sampled else saved["ratios"]
        assert prior.measured and prior.ratio(3) == pytest.approx(table["3"])


def test_no_curve_is_measured_when_turned_off_or_for_plain_decoding(pair, monkeypatch):
    assert calibrate.needed(pair, BlockChoice(4, auto=True))
    assert not calibrate.needed(pair, BlockChoice(4))  # a fixed size does not use the curve
    assert not calibrate.missing(pair, 1)  # auto up to 1 is plain decoding: nothing to time
    monkeypatch.setenv(calibrate.CALIBRATE_ENV, "0")
    assert not calibrate.missing(pair, 3)


def test_an_unreadable_or_greedy_only_curve_is_measured_again(pair):
    path = cost_curve_path(pair)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibrate.missing(pair, 3)
    path.write_text(json.dumps({"ratios": {"1": 1.0, "2": 1.5, "3": 1.6}}))
    assert calibrate.missing(pair, 3)  # no sampled table: sampled requests would guess


def test_calibrating_on_one_thread_then_decoding_on_another_stays_exact(pair):
    """The chat app measures the curve on its engine thread and serve on the main thread; the
    pair must then decode exactly on whichever thread runs the requests."""
    ids = pair.tokenizer.encode("def add(a, b):")
    ref = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), pair.target), range(32))]
    out: dict = {}

    def measure():
        out["path"] = calibrate.calibrate(pair, 3)

    def decode():
        events = list(speculative_stream(pair, ids, GenerationConfig(32, use_eos=False)))
        out["tokens"] = [t for e in events for t in e.tokens]

    for job in (measure, decode):
        t = threading.Thread(target=job)
        t.start()
        t.join(120)
    assert out["path"].exists() and out["tokens"] == ref


def test_a_curve_that_cannot_be_saved_is_one_sentence_and_generation_goes_on(pair, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibrate, "save", full)
    said = calibrate.calibrate(pair, 2)
    assert said == (
        f"could not save the cost curve of --block-size auto to {cost_curve_path(pair)} "
        "(No space left on device)."
    )
    monkeypatch.setenv("DFLASH_MAC_HOME", "/proc/self/no-such-home")  # cannot be made
    assert not calibrate.missing(pair, 3)  # nowhere to keep a curve: auto keeps the guess


def test_a_curve_measured_under_another_blas_is_not_taken(pair, monkeypatch):
    """A first run before OpenBLAS was installed timed a block-8 verify at ~9 plain steps with
    the reference BLAS; under OpenBLAS that curve priced every draft and copy out for good."""
    import dflash_mac.host as machine

    monkeypatch.setattr(machine, "device_name", lambda: "cpu")
    monkeypatch.setattr(machine, "blas_in_use", lambda: "reference BLAS (MLX wheel)")
    calibrate.calibrate(pair, 3)
    assert not calibrate.missing(pair, 3)
    monkeypatch.setattr(machine, "blas_in_use", lambda: "OpenBLAS")
    assert calibrate.missing(pair, 3)  # measured again under this BLAS
    assert not load_tuning(pair).controller(3).cost.prior.measured
    monkeypatch.setattr(machine, "device_name", lambda: "gpu")
    gpu = cost_curve_path(pair)
    monkeypatch.setattr(machine, "blas_in_use", lambda: "reference BLAS (MLX wheel)")
    assert cost_curve_path(pair) == gpu  # the GPU's matmuls do not run on the BLAS


# a quick curve saved on this 2-core host while a training job kept both cores busy (ms)
BUSY = {
    "seconds": {"1": 0.104, "2": 0.146, "3": 0.191, "4": 0.129, "5": 0.294, "6": 0.460},
    "ratios": {"1": 1.0, "2": 1.41, "3": 1.55, "4": 1.55, "5": 2.84, "6": 2.90},
    "trees": {"4": 1.39, "8": 2.19, "16": 1.77},
}
# the same pair on the idle host
IDLE = {
    "seconds": {"1": 0.058, "2": 0.081, "3": 0.084, "4": 0.089, "5": 0.091, "6": 0.094},
    "ratios": {"1": 1.0, "2": 1.39, "3": 1.45, "4": 1.52, "5": 1.56, "6": 1.60},
    "trees": {"4": 1.92, "8": 1.88, "16": 2.24},
}


def test_a_curve_timed_on_a_busy_machine_is_told_from_a_steady_one():
    from dflash_mac.sizing.cost import noise

    assert noise(IDLE) == [] and noise(IDLE | {"trees": {}}) == []
    assert noise(BUSY) == [
        "block 4 timed at 68% of a smaller block",
        "tree of 4 timed at 49% of a chain as wide",  # below a block-5 chain
        "tree of 8 timed at 76% of a chain as wide",  # below the widest chain
        "tree of 16 timed at 61% of a chain as wide",
    ]
    jitter = {"1": 0.0018, "2": 0.0047, "3": 0.0032, "4": 0.0025}  # a tiny pair's milliseconds
    assert noise({"seconds": jitter, "ratios": {"1": 1.0}}) == []
    assert noise({"seconds": {"1": 1}}) == ["unreadable"]


def test_auto_ignores_a_busy_curve_and_first_use_measures_it_again(pair, monkeypatch):
    """A busy curve priced drafting wrong for good (the online costs stay near the prior): auto
    starts from the guess instead, and the next first uses time the curve again, up to
    QUICK_TRIES times in all."""
    path = cost_curve_path(pair)
    path.parent.mkdir(parents=True)
    busy = BUSY | {"sampled": IDLE | {"temperature": 0.7}, "quick": True}
    path.write_text(json.dumps(busy))
    tuning = load_tuning(pair)
    assert not tuning.controller(6).cost.prior.measured  # greedy: busy, the guess
    sampled = tuning.controller(6, (0.7,), sampled=True).cost.prior
    assert sampled.measured and sampled.ratio(6) == pytest.approx(1.60)  # steady: taken
    assert calibrate.missing(pair, 3)  # measured again at the next first use
    assert "busy machine" in calibrate.prior_name(pair)
    monkeypatch.setattr(calibrate, "measure_both", lambda *a, **k: busy)
    calibrate.calibrate(pair, 3)
    assert json.loads(path.read_text())["tries"] == 2 and calibrate.missing(pair, 3)
    calibrate.calibrate(pair, 3)
    assert json.loads(path.read_text())["tries"] == 3
    assert not calibrate.missing(pair, 3)  # a host that stays busy: no more waits
    steady = IDLE | {"sampled": IDLE}
    monkeypatch.setattr(calibrate, "measure_both", lambda *a, **k: steady)
    calibrate.calibrate(pair, 3)
    assert json.loads(path.read_text())["tries"] == 1 and not calibrate.missing(pair, 3)
    assert load_tuning(pair).controller(6).cost.prior.measured
    path.write_text(json.dumps(busy | {"quick": False}))  # bench --cost-curve's: the user's call
    assert not calibrate.missing(pair, 3)
