"""Lossless sampling: DFlash's joint distribution of the first tokens equals the target's."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from helpers.lossy import accepting_every_draft
from helpers.tiny import draft_config, target_config
from mlx_lm.models import qwen3
from scipy.stats import chisquare

from dflash_mac.engine.verify import (
    SamplingParams,
    accept_sample_match,
    accept_sampled,
    probabilities,
)
from dflash_mac.loading.loader import LoadedPair
from dflash_mac.session import Session
from dflash_mac.target.structure import target_head

V = 5
N = 1500
PROMPT = [1, 4, 2, 0, 0]
# two layers: the drafter reads layer 1, the rollback spans layers; each layer costs thousands
# of requests' MLX dispatches in every chi-square test that uses these pairs
SMALL_TARGET = target_config(vocab=V, hidden=32, layers=2)


@pytest.fixture(scope="module")
def small_pair(tiny_pair):
    """A 5-token-vocabulary target and a random drafter (q far from p)."""
    mx.random.seed(3)
    tcfg = SMALL_TARGET
    target = qwen3.Model(qwen3.ModelArgs.from_dict(tcfg))
    target.update({"model": {"embed_tokens": {"weight": mx.random.normal((V, 32)) * 0.12}}})
    drafter = DFlashDraftModel(DraftConfig.from_dict(draft_config(tcfg, mask_id=V - 1)))
    drafter.bind(target_head(target))
    mx.eval(target.parameters(), drafter.parameters())  # materialised: used on worker threads
    return LoadedPair(target, drafter, tiny_pair.tokenizer, "small", "small-draft", 4, tcfg)


def exact_joint(
    pair, sp: SamplingParams, n: int = 3, prompt: list[int] = PROMPT
) -> dict[tuple, float]:
    """The target's own distribution over the first n tokens after `prompt`, by enumeration."""
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            if pr == 0:
                continue
            logits = pair.target(mx.array([prompt + list(prefix)]))[0, -1]
            probs = np.array(probabilities(logits, sp)).astype(np.float64)
            for t in range(V):
                nxt[prefix + (t,)] = pr * probs[t]
        joint = nxt
    return joint


def dflash_samples(pair, sp: SamplingParams, block_size: int, n: int = N) -> list[tuple]:
    """n independent DFlash generations (a session reuses the prompt's cached prefix)."""
    session, out = Session(pair), []
    for seed in range(n):
        events = session.stream(
            PROMPT,
            max_tokens=3,
            block_size=block_size,
            temp=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=seed,
            use_eos=False,
        )
        out.append(tuple(t for e in events for t in e.tokens))
    return out


def chi_square_p(samples: list[tuple], joint: dict[tuple, float]) -> float:
    cells = list(itertools.product(range(V), repeat=3))
    counts = {c: 0 for c in cells}
    for s in samples:
        counts[s] += 1
    for c in cells:  # impossible sequences must never appear
        if joint.get(c, 0.0) == 0:
            assert counts[c] == 0, f"sampled impossible sequence {c}"
    obs, exp, small_o, small_e = [], [], 0, 0.0
    for c in cells:
        e = joint.get(c, 0.0) * len(samples)
        if e == 0:
            continue
        if e < 5:
            small_o, small_e = small_o + counts[c], small_e + e
        else:
            obs.append(counts[c])
            exp.append(e)
    assert len(obs) >= 8, "the test distribution is too peaked to be informative"
    if small_e > 0:
        obs.append(small_o)
        exp.append(small_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(obs, exp).pvalue


@pytest.mark.slow
@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=3),
    ],
    ids=["t1", "t0.7-top_p0.9", "top_k3"],
)
def test_joint_distribution_matches_target(small_pair, sp):
    joint = exact_joint(small_pair, sp)
    samples = dflash_samples(small_pair, sp, block_size=4)
    assert chi_square_p(samples, joint) > 0.001


@pytest.mark.slow
def test_a_lossy_rule_is_detected(small_pair):
    """The chi-square check has teeth: accepting every draft (no rejection) fails it."""
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(small_pair, sp)
    import dflash_mac.engine.drafts as engine

    real = engine.accept_sampled
    accept_all = accepting_every_draft(real)

    engine.accept_sampled = accept_all
    try:
        samples = dflash_samples(small_pair, sp, block_size=4, n=600)
    finally:
        engine.accept_sampled = real
    assert chi_square_p(samples, joint) < 1e-6


@pytest.mark.slow
def test_rejection_accepts_more_than_sample_and_match(small_pair):
    """On the same pair and prefix, residual rejection sampling accepts strictly more."""
    sp = SamplingParams(temperature=1.0)
    pair = small_pair
    cache = pair.drafter.make_cache()
    from dflash_mac.target.capture import FeatureCapture

    with FeatureCapture(pair.target, pair.layer_ids) as cap:
        pair.target(mx.array([PROMPT]))
        pair.drafter.extend_context(cap.features(), cache)
    block = mx.array([[PROMPT[-1]] + [V - 1] * 3])
    q = probabilities(pair.drafter(block, cache)[0], sp)
    totals = {"rejection": 0, "match": 0}
    for i in range(600):
        k1, k2, k3 = mx.random.split(mx.random.key(i), 3)
        drafts = mx.random.categorical(mx.log(q), key=k1)
        p = probabilities(pair.target(mx.array([PROMPT + drafts.tolist()]))[0, -4:], sp)
        totals["rejection"] += accept_sampled(drafts, q, p, k2)[0].item()
        totals["match"] += accept_sample_match(drafts, p, k3)[0].item()
    assert totals["rejection"] > totals["match"] * 1.1


def test_transforms_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    for sp in [
        SamplingParams(0.8, top_k=5),
        SamplingParams(1.2, top_p=0.7),
        SamplingParams(1.0, min_p=0.2),
    ]:
        got = np.array(probabilities(mx.array(logits), sp))
        z = logits / sp.temperature
        if sp.top_k:
            kth = np.sort(z, axis=-1)[:, -sp.top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if sp.top_p < 1:
            for r in range(3):
                order = np.argsort(-p[r])
                keep = (np.cumsum(p[r][order]) - p[r][order]) < sp.top_p
                mask = np.zeros(50, bool)
                mask[order[keep]] = True
                p[r] = np.where(mask, p[r], 0)
        if sp.min_p:
            p = np.where(p >= sp.min_p * p.max(-1, keepdims=True), p, 0)
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(got, p, atol=1e-6)
