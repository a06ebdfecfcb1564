"""Hybrid targets (GatedDeltaNet + attention): exact greedy output, exact rollback state,
lossless sampling, and per-instance hooks that leave nothing behind."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from helpers.oracle import OracleDrafter, with_drafter
from helpers.tiny import draft_config
from helpers.tiny_hybrid import (
    build_hybrid_target,
    build_tiny_hybrid_pair,
    hybrid_text_config,
)
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache
from scipy.stats import chisquare

from dflash_mac.drafting.copies import CopyRates
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.engine.verify import SamplingParams, probabilities
from dflash_mac.loading.loader import LoadedPair, load
from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.target import hooks, hybrid
from dflash_mac.target.rollback import RollbackError, TargetRollback
from dflash_mac.target.structure import target_head

PROMPTS = ["def add(a, b):", "The quick brown fox"]
N = 200
GDN_CLASS = qwen3_5.GatedDeltaNet
GDN_CALL = GDN_CLASS.__call__


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load(*build_tiny_hybrid_pair(tmp_path_factory.mktemp("hybrid"), seed=0))


def baseline(pair, ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding of the target (no hooks)."""
    return [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]


@pytest.fixture(scope="module")
def cases(pair):
    assert not hooks.is_hooked(pair.target)
    return [(ids, baseline(pair, ids, N)) for ids in map(pair.tokenizer.encode, PROMPTS)]


def run(pair, ids, state=None, **kw) -> tuple[list[int], list[int]]:
    if "block_size" in kw:  # a fixed size
        kw["block"] = BlockChoice(kw.pop("block_size"))
    events = list(speculative_stream(pair, ids, GenerationConfig(use_eos=False, **kw), state))
    return [t for e in events for t in e.tokens], [e.accepted for e in events[1:]]


def test_pair_is_hybrid(pair):
    kinds = [type(c) for c in DecodeState(pair).target_cache]
    assert kinds.count(ArraysCache) == 4 and kinds.count(KVCache) == 2
    assert DecodeState(pair).rollback.hybrid


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_real_drafter_matches_target(pair, cases, block_size):
    ids, ref = cases[0]
    tokens, acc = run(pair, ids, max_tokens=N, block_size=block_size)
    assert tokens == ref
    assert min(acc) == 1  # the random drafter is rejected: rollback ran


@pytest.mark.parametrize(
    "block_size",
    [pytest.param(2, marks=pytest.mark.slow), 5, pytest.param(16, marks=pytest.mark.slow)],
)
def test_partially_right_drafter_matches_target(pair, cases, block_size):
    for i, (ids, ref) in enumerate(cases):
        oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.3, i))
        tokens, acc = run(oracle, ids, max_tokens=N, block_size=block_size)
        assert tokens == ref
        assert 1 < sum(acc) / len(acc) < block_size
        assert any(1 < a < block_size for a in acc) or block_size == 2


def assert_cache_equals_fresh_prefill(pair, state):
    """Conv, recurrent and attention caches equal those of one prefill of `state.ids`."""
    fresh = pair.target.make_cache()
    mx.eval(pair.target(mx.array([state.ids]), cache=fresh))
    for mine, ref in zip(state.target_cache, fresh):
        if isinstance(ref, ArraysCache):
            for a, b in zip(mine.cache, ref.cache):
                assert a.shape == b.shape and a.dtype == b.dtype == mx.float32
                assert mx.allclose(a, b, atol=1e-5, rtol=1e-4).item()
        else:
            assert mine.offset == ref.offset == len(state.ids)
            n = ref.offset
            for a, b in ((mine.keys, ref.keys), (mine.values, ref.values)):
                assert mx.allclose(a[..., :n, :], b[..., :n, :], atol=1e-5).item()


@pytest.mark.parametrize("strategy", ["replay", "rerun"])
def test_state_after_each_rollback_equals_fresh_prefill(pair, cases, strategy):
    ids, ref = cases[1]
    oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.4, 3))
    state = DecodeState(oracle)
    state.rollback = TargetRollback(pair.target, state.target_cache, strategy)
    partial = 0
    cfg = GenerationConfig(max_tokens=40, block=BlockChoice(6), use_eos=False)
    for ev in speculative_stream(oracle, ids, cfg, state=state):
        partial += 0 < ev.accepted < 6
        assert state.ids == (ids + ref)[: len(state.ids)]
        assert_cache_equals_fresh_prefill(pair, state)
    assert partial >= 3


def test_trim_within_last_verify_and_refusal(pair, cases):
    ids, ref = cases[0]
    eos = ref[30]
    oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.0))
    old = set(pair.tokenizer.eos_token_ids)
    pair.tokenizer.eos_token_ids = {eos}
    try:  # EOS inside a fully accepted block: the engine trims within the last verify
        state = DecodeState(oracle)
        events = list(
            speculative_stream(
                oracle, ids, GenerationConfig(max_tokens=N, block=BlockChoice(16)), state=state
            )
        )
    finally:
        pair.tokenizer.eos_token_ids = old
    out = [t for e in events for t in e.tokens]
    assert out == ref[: ref.index(eos)] and events[-1].finish_reason == "stop"
    assert_cache_equals_fresh_prefill(pair, state)
    state.trim_to(len(state.ids) - 1)  # still inside the last verify window
    assert_cache_equals_fresh_prefill(pair, state)
    with pytest.raises(RollbackError, match="prefilled again"):
        state.trim_to(len(ids))
    # The prompt cache keeps recurrent states only where a span ends: a prefix that ends
    # inside one cannot be rebuilt (a fresh prefill), the whole state can.
    session = Session(oracle)
    session.cache.put(state)
    assert session.reuse(ids + [1, 2]) == 0 and session.state is not state
    assert session.reuse(state.ids + [1, 2]) == len(state.ids)
    assert_cache_equals_fresh_prefill(pair, session.state)


def test_hooks_are_per_instance_and_removed(pair, cases):
    ids, ref = cases[0]
    other = build_hybrid_target({"model_type": "qwen3_5", "text_config": hybrid_text_config()})
    gdn = [m for _, m in pair.target.named_modules() if isinstance(m, GDN_CLASS)]
    stream = speculative_stream(pair, ids, GenerationConfig(max_tokens=N, block=BlockChoice(5)))
    next(stream), next(stream)  # the first token, then a cycle: the cycles run hooked
    assert hooks.is_hooked(pair.target)
    assert all(type(m) is not GDN_CLASS for m in gdn)  # hooked while running ...
    assert all(hooks.original_class(m) is GDN_CLASS for m in gdn)
    assert not hooks.is_hooked(other)  # ... this instance only, the class is untouched
    assert GDN_CLASS.__call__ is GDN_CALL
    assert baseline(pair, ids, 20) == ref[:20]  # unarmed hooks run the original forward
    stream.close()
    assert not hooks.is_hooked(pair.target)
    assert all(type(m) is GDN_CLASS for m in gdn)
    assert baseline(pair, ids, N) == ref


def test_two_caches_share_the_hooked_instances(pair, cases):
    """Two requests with their own caches on one model: each records and rolls back its own
    cache; the last one out restores the class."""
    ids, ref = cases[0]
    states = [DecodeState(pair), DecodeState(pair)]
    with states[0].rollback.hooks():
        with states[1].rollback.hooks():
            for st, (n, keep) in zip(states, [(5, 2), (3, 3)]):
                pair.target(mx.array([ids]), cache=st.target_cache)
                st.rollback.before_verify()
                pair.target(mx.array([ref[:n]]), cache=st.target_cache)
                st.rollback.rollback(n - keep, keep - 1)
                st.ids = ids + ref[:keep]
        assert hooks.is_hooked(pair.target)
        for st in states:
            assert_cache_equals_fresh_prefill(pair, st)
    assert not hooks.is_hooked(pair.target)


def test_hooked_forward_is_bit_exact():
    """The recording forward computes exactly what mlx-lm's layer computes (both variants)."""
    for model_type in ("qwen3_5", "qwen3_next"):
        mx.random.seed(1)
        text = hybrid_text_config(model_type=model_type)
        cfg = {"model_type": "qwen3_5", "text_config": text} if model_type == "qwen3_5" else text
        model = build_hybrid_target(cfg)
        x = mx.array([[5, 17, 99, 3, 250, 42, 7, 8]])
        plain, hooked = model.make_cache(), model.make_cache()
        model(x[:, :5], cache=plain), model(x[:, :5], cache=hooked)
        ref = model(x[:, 5:], cache=plain)
        rb = TargetRollback(model, hooked)
        with rb.hooks():
            rb.before_verify()
            out = model(x[:, 5:], cache=hooked)
        assert rb.gdn.captured() == len(rb.gdn.records) == 4
        assert mx.array_equal(out, ref).item()
        for a, b in zip(hooked, plain):
            pairs = zip(a.cache, b.cache) if isinstance(a, ArraysCache) else zip(a.state, b.state)
            assert all(mx.array_equal(u, v).item() for u, v in pairs)


def test_rollback_adds_no_host_sync(pair, cases, monkeypatch):
    """Rollback is lazy: no eval inside it (the engine syncs once per cycle)."""
    ids, _ = cases[0]
    state = DecodeState(pair)
    rb = state.rollback
    with rb.hooks():
        mx.eval(pair.target(mx.array([ids]), cache=state.target_cache))
        rb.before_verify()
        mx.eval(pair.target(mx.array([[1, 2, 3, 4]]), cache=state.target_cache))
        calls = []
        for name in ("eval", "async_eval"):
            monkeypatch.setattr(mx, name, lambda *a, **k: calls.append(a))
        rb.rollback(2, 1)
        monkeypatch.undo()
    assert calls == []
    assert state.target_cache[0].cache[0].shape[1] == 3


def test_unsupported_non_trimmable_cache_fails_clearly(pair):
    cache = pair.target.make_cache()
    cache[2] = ArraysCache(2)  # an attention layer with a state cache: nothing to replay
    with pytest.raises(RollbackError, match="non-trimmable ArraysCache in layer 2"):
        TargetRollback(pair.target, cache)


V, PROMPT = 6, [1, 4, 2, 5, 0]


@pytest.fixture(scope="module")
def small_pair(pair):
    """A 6-token hybrid target with a moderately flat distribution, and a random drafter."""
    mx.random.seed(3)
    text = hybrid_text_config(vocab=V, hidden=32, layers=4, interval=2)
    cfg = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    target = build_hybrid_target(cfg)
    target.update(
        {"language_model": {"model": {"embed_tokens": {"weight": mx.random.normal((V, 32)) * 0.2}}}}
    )
    dcfg = draft_config(dict(text, rope_theta=1e4), V - 1, layer_ids=[0, 1, 2])
    drafter = DFlashDraftModel(DraftConfig.from_dict(dcfg))
    drafter.bind(target_head(target))
    return LoadedPair(target, drafter, pair.tokenizer, "small-hybrid", "small-draft", 4, cfg)


def exact_joint(pair, sp: SamplingParams) -> dict[tuple, float]:
    """The target's own distribution of the first 3 tokens, by enumeration."""
    joint = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for prefix, pr in joint.items():
            logits = pair.target(mx.array([PROMPT + list(prefix)]))[0, -1]
            for t, p in enumerate(probabilities(logits, sp).tolist()):
                nxt[prefix + (t,)] = pr * p
        joint = nxt
    return joint


def chi_square_p(samples: list[tuple], joint: dict[tuple, float]) -> float:
    """Chi-square p-value of the sampled joint; cells expecting < 5 are pooled."""
    counts = Counter(samples)
    assert all(joint[c] > 0 for c in counts), "an impossible sequence was sampled"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c, p in joint.items():
        e = p * len(samples)
        if e < 5:
            pool_o, pool_e = pool_o + counts[c], pool_e + e
        else:
            obs.append(counts[c])
            exp.append(e)
    obs, exp = obs + [pool_o], exp + [pool_e]
    exp = np.array(exp) * sum(obs) / sum(exp)
    return chisquare(obs, exp).pvalue


def sampled(pair, sp: SamplingParams, n: int) -> tuple[list[tuple], list[int]]:
    out, acc = [], []
    for seed in range(n):
        cfg = GenerationConfig(
            max_tokens=3, block=BlockChoice(4), sampling=sp, seed=seed, use_eos=False
        )
        events = list(speculative_stream(pair, PROMPT, cfg))
        out.append(tuple(t for e in events for t in e.tokens))
        acc += [e.accepted for e in events[1:]]
    return out, acc


@pytest.mark.slow
def test_sampling_is_lossless_through_rollback(small_pair):
    sp = SamplingParams(temperature=1.0)
    samples, acc = sampled(small_pair, sp, 400)
    assert acc.count(1) > 100  # many rejections, each followed by a rollback
    assert chi_square_p(samples, exact_joint(small_pair, sp)) > 1e-3


@pytest.mark.slow
def test_sampling_check_detects_a_skipped_rollback(small_pair, monkeypatch):
    """The check has teeth: leaving the rejected draft in the GatedDeltaNet state fails it."""
    monkeypatch.setattr(hybrid.GDNRollback, "keep", lambda self, n: None)
    sp = SamplingParams(temperature=1.0)
    samples, _ = sampled(small_pair, sp, 150)
    assert chi_square_p(samples, exact_joint(small_pair, sp)) < 1e-6


class Sizes:
    """A controller replaying fixed block sizes: runs of plain steps between drafting cycles."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.i = sizes, 0
        self.copy_rates = CopyRates()

    def choose(self):
        from dflash_mac.sizing.controller import Decision

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


def test_plain_step_runs_between_drafting_cycles_stay_exact(pair, cases):
    """Plain steps queue the next cycle on the still-lazy token; a hybrid's GatedDeltaNet
    state must come through runs of them, and drafting after them, exactly."""
    sizes = [1, 1, 1, 4, 1, 1, 1, 1, 6, 2, 1]
    for i, (ids, ref) in enumerate(cases):
        oracle = with_drafter(pair, OracleDrafter(pair.drafter, ids + ref, 320, 0.4, i))
        for p in (pair, oracle):
            state = DecodeState(p)
            cfg = GenerationConfig(max_tokens=60, use_eos=False)
            events = list(speculative_stream(p, ids, cfg, state, controller=Sizes(sizes)))
            assert [t for e in events for t in e.tokens] == ref[:60]
            assert set(events[-1].stats.block_sizes) >= {1, 4, 6}
            assert_cache_equals_fresh_prefill(pair, state)


def test_cost_curve_on_a_hybrid(pair):
    """`bench --cost-curve` times plain steps one at a time on a hybrid (its state cache trims
    back one verify at most) and leaves no hook behind."""
    from dflash_mac.calibrate import measure

    curve = measure(pair, max_bs=3, context=12, reps=1)
    assert curve["ratios"]["1"] == 1.0 and all(curve["seconds"][b] > 0 for b in "123")
    assert not hooks.is_hooked(pair.target)
