"""Log-probabilities of the committed tokens come from the target's own distribution at each
position (the verify pass's logits): mlx-lm's `generate_step` logprobs (after logit bias and
penalties, before temperature), the same with and without DFlash."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from test_greedy_exact import PROMPTS
from test_penalties import mlx_lm_penalised, processors

from dflash_mac.api import PromptError, generate, make_config, stream_generate
from dflash_mac.engine.verify import logprob_rows, read_logprobs

K = 5


def run(pair, ids, **kw):
    """(tokens, logprobs) of one generation, the events' logprobs concatenated."""
    tokens, lps = [], []
    for ev in stream_generate(pair, ids, use_eos=False, **kw):
        assert ev.logprobs is not None and len(ev.logprobs) == len(ev.tokens)
        tokens += ev.tokens
        lps += ev.logprobs
    assert [lp.token for lp in lps] == tokens
    return tokens, lps


@pytest.mark.parametrize("kw", [{}, {"logit_bias": {11: 3.0, 13: -2.0}}], ids=["raw", "bias"])
def test_greedy_logprobs_match_mlx_lm(tiny_pair, kw):
    """Tokens, their log-probabilities and the top K equal mlx-lm's plain decoding on the same
    weights, with DFlash (block 5) and plain steps (block 1) alike."""
    for p in PROMPTS[:3]:
        ids = tiny_pair.tokenizer.encode(p)
        steps = generate_step(
            mx.array(ids), tiny_pair.target, max_tokens=24, logits_processors=processors(kw)
        )
        ref = [(t, np.array(lp)) for t, lp in steps]
        for bs in (1, 5):
            tokens, lps = run(tiny_pair, ids, max_tokens=24, block_size=bs, logprobs=K, **kw)
            assert tokens == [t for t, _ in ref]
            for lp, (t, want) in zip(lps, ref):
                assert lp.logprob == pytest.approx(float(want[t]), abs=2e-5)
                top = np.argsort(-want, kind="stable")[:K]
                assert [i for i, _ in lp.top] == top.tolist()
                np.testing.assert_allclose([v for _, v in lp.top], want[top], atol=2e-5)


def test_sampled_logprobs_are_the_targets_with_and_without_dflash(tiny_pair):
    """Sampled runs with penalties, at block 1, `auto` and 6: every committed token's value is
    the target's (penalised) log-softmax at its position, recomputed here by one plain forward
    over prompt + output. Temperature does not enter it (0.9 here)."""
    ids = tiny_pair.tokenizer.encode(PROMPTS[4])
    pen = {"presence_penalty": 0.5, "logit_bias": {7: 1.0}}
    for bs in (1, "auto", 6):
        tokens, lps = run(
            tiny_pair, ids, max_tokens=30, block_size=bs, temp=0.9, seed=3, logprobs=K, **pen
        )
        logits = tiny_pair.target(mx.array([ids + tokens]))[0, len(ids) - 1 : -1]
        for j, lp in enumerate(lps):
            row = mlx_lm_penalised(logits[j], ids + tokens[:j], pen)
            want = np.array(row - mx.logsumexp(row))
            assert lp.logprob == pytest.approx(float(want[lp.token]), abs=5e-5)
            assert [i for i, _ in lp.top] == np.argsort(-want, kind="stable")[:K].tolist()


def test_only_when_asked_and_the_range_is_checked(tiny_pair):
    events = list(stream_generate(tiny_pair, [5, 6, 7], max_tokens=8, block_size=4))
    assert all(ev.logprobs is None for ev in events)
    with pytest.raises(PromptError, match=r"^logprobs must be between 0 and 20 \(got 21\)\.$"):
        make_config(logprobs=21)
    _, lps = run(tiny_pair, [5, 6, 7], max_tokens=6, block_size=4, logprobs=0)
    assert len(lps) == 6 and all(lp.top == () for lp in lps)


def test_rows_are_lazy_and_read_back_in_order(monkeypatch):
    """`logprob_rows` queues no evaluation (the cycle keeps its one host sync); the host reads
    values and the top k back in order, and refused tokens (-inf) are left out of the top."""
    logits = mx.array([[0.0, 1.0, -mx.inf, 2.0], [3.0, -mx.inf, -mx.inf, -mx.inf]])
    calls = []
    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, lambda *a, **k: calls.append(a))
    rows = logprob_rows(logits, mx.array([1, 0]), 3)
    monkeypatch.undo()
    assert calls == []
    got = read_logprobs(rows.tolist(), 2, [1, 0])
    lse = float(np.log(np.exp(0) + np.exp(1) + np.exp(2)))
    assert got[0].token == 1 and got[0].logprob == pytest.approx(1 - lse, abs=1e-6)
    assert [i for i, _ in got[0].top] == [3, 1, 0]
    assert got[1].logprob == pytest.approx(0.0) and got[1].top == ((0, 0.0),)


def test_generate_returns_one_logprob_per_kept_token(tiny_pair):
    """The budget cuts a cycle's committed tokens: their log-probabilities go with them."""
    result = generate(tiny_pair, [5, 6, 7], max_tokens=7, block_size=6, logprobs=2)
    assert len(result.tokens) == 7
    assert [lp.token for lp in result.logprobs] == result.tokens
    assert generate(tiny_pair, [5, 6, 7], max_tokens=3).logprobs is None
