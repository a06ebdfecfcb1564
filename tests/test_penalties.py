"""Penalties and logit bias stay lossless: p and q are penalised alike at every block position,
given that position's prefix (committed tokens + the earlier drafts of the block)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.penalties import Penalties, PenaltyContext
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_dflash2 import d2_pair, small_d2_pair  # noqa: F401  (fixtures)
from test_greedy_exact import PROMPTS
from test_sampling import PROMPT, V, chi_square_p, small_pair  # noqa: F401  (fixture)

import dflash_mac.engine.drafts as engine
from dflash_mac.api import PromptError, generate, make_config
from dflash_mac.engine.verify import SamplingParams, probabilities
from dflash_mac.serve.schema import APIError, parse_chat
from dflash_mac.session import Session

PEN = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3)
BIAS = dict(logit_bias={3: -1.5, 0: 0.7})


def processors(kw: dict, context_size: int = 20):
    return make_logits_processors(
        logit_bias=kw.get("logit_bias"),
        repetition_penalty=kw.get("repetition_penalty"),
        repetition_context_size=context_size,
        presence_penalty=kw.get("presence_penalty"),
        presence_context_size=context_size,
        frequency_penalty=kw.get("frequency_penalty"),
        frequency_context_size=context_size,
    )


def mlx_lm_penalised(logits: mx.array, tokens: list[int], kw: dict, context_size=20):
    out = logits[None]
    for proc in processors(kw, context_size):
        out = proc(mx.array(tokens), out)
    return out[0]


@pytest.mark.parametrize("context_size", [3, 20])
def test_block_positions_match_mlx_lm_processors(context_size):
    """Row j of `apply` equals mlx-lm's processors on history + drafts[:j] (sliding window)."""
    kw = {**PEN, **BIAS}
    pen = Penalties.make(**kw, context_size=context_size)
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(6, 8)).astype(np.float32) * 2)
    history, drafts = [1, 1, 5, 2, 1, 7], [5, 5, 3, 1, 1]
    got = pen.bind(history).apply(logits, mx.array(drafts))
    for j in range(6):
        want = mlx_lm_penalised(logits[j], history + drafts[:j], kw, context_size)
        np.testing.assert_allclose(np.array(got[j]), np.array(want), rtol=1e-6, atol=1e-6)
    # one position at a time (how drafts are drawn) gives the same rows
    ctx = pen.bind(history)
    for j in range(6):
        row = ctx.apply(logits[j : j + 1], mx.array(drafts[:j]), first=j)
        np.testing.assert_allclose(np.array(row[0]), np.array(got[j]), rtol=1e-6, atol=1e-6)


def test_nothing_set_costs_nothing_and_bad_values_are_refused():
    assert Penalties.make() is None
    assert Penalties.make(0.0, 0.0, None, {}) is None
    assert make_config().penalties is None
    with pytest.raises(PromptError) as e:
        make_config(repetition_penalty=-1.0)
    assert str(e.value) == "--repetition-penalty must be > 0.0 and <= 10.0 (got -1.0)."


@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", 0),  # once "off" on the command line, a 400 on the server
        ("presence_penalty", 5),  # once accepted on the command line, a 400 on the server
        ("frequency_penalty", -3),
        ("logit_bias", 101),
    ],
)
def test_one_penalty_rule_for_the_cli_and_the_server(field, value):
    """The command line and the server refuse the same values in the same words; each names
    the setting its own way (a flag, a request field)."""
    kw = {field: {7: value} if field == "logit_bias" else value}
    with pytest.raises(PromptError) as cli:
        make_config(**kw)
    body = {field: {"7": value} if field == "logit_bias" else value}
    with pytest.raises(APIError) as server:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, 16, 16)
    flag = "--" + field.replace("_", "-")
    assert str(cli.value) == f"{flag} must be {RANGES[field]} (got {float(value)})."
    assert server.value.message == f"'{field}' must be {RANGES[field]} (got {value})."


RANGES = {
    "repetition_penalty": "> 0.0 and <= 10.0",
    "presence_penalty": ">= -2.0 and <= 2.0",
    "frequency_penalty": ">= -2.0 and <= 2.0",
    "logit_bias": ">= -100.0 and <= 100.0",
}


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_pair):
    with pytest.raises(PromptError, match="--logit-bias token 99999 is not in the vocabulary"):
        generate(tiny_pair, [1, 2, 3], max_tokens=2, logit_bias={99999: 1.0})


def baseline_penalised(pair, ids: list[int], n: int, kw: dict) -> list[int]:
    """mlx-lm's own greedy decoding of the target with the same logits processors."""
    steps = generate_step(
        mx.array(ids), pair.target, max_tokens=n, logits_processors=processors(kw)
    )
    return [t for t, _ in steps]


@pytest.mark.parametrize(
    "kw",
    [PEN, pytest.param({"logit_bias": {11: 3.0, 13: -2.0}}, marks=pytest.mark.slow)],
    ids=["pen", "bias"],
)
@pytest.mark.parametrize("drafter", ["dflash", pytest.param("dflash2", marks=pytest.mark.slow)])
def test_greedy_with_penalties_matches_mlx_lm(tiny_pair, d2_pair, kw, drafter):  # noqa: F811
    pair = tiny_pair if drafter == "dflash" else d2_pair
    for p in PROMPTS[:4]:
        ids = pair.tokenizer.encode(p)
        ref = baseline_penalised(pair, ids, 40, kw)
        out = generate(pair, ids, max_tokens=40, block_size=5, use_eos=False, **kw)
        assert out.tokens == ref
    plain = generate(pair, ids, max_tokens=40, block_size=5, use_eos=False)
    assert plain.tokens != out.tokens  # the penalties changed the output


@pytest.mark.slow
def test_banned_token_never_appears(tiny_pair):
    """logit_bias -100 on the tokens a plain run produces most: none of them appears."""
    ids = tiny_pair.tokenizer.encode(PROMPTS[0])
    plain = generate(tiny_pair, ids, max_tokens=40, temp=1.0, seed=0, use_eos=False).tokens
    banned = {t: -100.0 for t in set(plain[:5])}
    for seed in range(4):
        for temp in (0.0, 1.0):
            out = generate(
                tiny_pair,
                ids,
                max_tokens=40,
                temp=temp,
                seed=seed,
                use_eos=False,
                block_size=5,
                logit_bias=banned,
            )
            assert not set(out.tokens) & set(banned), (seed, temp)


def test_worker_thread_runs_penalties(tiny_pair):
    import threading

    box = {}

    def go():
        box["out"] = generate(tiny_pair, [5, 6, 7], max_tokens=12, temp=0.8, seed=1, **PEN)

    t = threading.Thread(target=go)
    t.start()
    t.join()
    assert len(box["out"].tokens) == 12


# -- chi-square: the joint distribution of the first three tokens ------------------------------


def exact_penalised_joint(pair, sp: SamplingParams, kw: dict, n: int = 3) -> dict:
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            if pr == 0:
                continue
            logits = pair.target(mx.array([PROMPT + list(prefix)]))[0, -1]
            logits = mlx_lm_penalised(logits, PROMPT + list(prefix), kw)
            probs = np.array(probabilities(logits, sp)).astype(np.float64)
            for t in range(V):
                nxt[prefix + (t,)] = pr * probs[t]
        joint = nxt
    return joint


def penalised_samples(pair, sp: SamplingParams, kw: dict, n: int) -> list[tuple]:
    session, out = Session(pair), []
    for seed in range(n):
        events = session.stream(
            PROMPT,
            max_tokens=3,
            block_size=4,
            temp=sp.temperature,
            top_p=sp.top_p,
            seed=seed,
            use_eos=False,
            **kw,
        )
        out.append(tuple(t for e in events for t in e.tokens))
    return out


@pytest.fixture(scope="module")
def small_pairs(small_pair, small_d2_pair):  # noqa: F811
    return {"dflash": small_pair, "dflash2": small_d2_pair}


CASES = {
    "pen": (SamplingParams(temperature=1.0), PEN),
    "bias": (SamplingParams(temperature=1.0), BIAS),
    "all-top_p": (SamplingParams(temperature=0.8, top_p=0.95), {**PEN, **BIAS}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_penalised_joint_distribution_matches_target(small_pairs, drafter, case):
    sp, kw = CASES[case]
    pair = small_pairs[drafter]
    joint = exact_penalised_joint(pair, sp, kw)
    assert chi_square_p(penalised_samples(pair, sp, kw, 1500), joint) > 0.001


CONTROLS = {  # the penalties each wrong rule shows up under
    "p-ignores-block-drafts": {"presence_penalty": 2.0, "frequency_penalty": 1.5},  # in range
    # the raw q puts half its mass on token 4, which the penalised q never draws
    "q-unpenalised": {"logit_bias": {4: -5.0}, "frequency_penalty": 0.3},
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
@pytest.mark.parametrize("bug", list(CONTROLS))
def test_a_wrong_penalty_rule_is_detected(small_pairs, monkeypatch, bug, wrong):
    """Teeth: penalising the target without the block's earlier drafts, or reporting a q that
    is not the penalised one the drafts were drawn from, fail the check the engine passes
    under the same penalties."""
    kw = CONTROLS[bug]
    pair, sp = small_pairs["dflash"], SamplingParams(temperature=1.0)
    joint = exact_penalised_joint(pair, sp, kw)
    real_apply, real_propose = PenaltyContext.apply, engine.propose
    if wrong and bug == "p-ignores-block-drafts":

        def apply(self, logits, drafts, first=0):
            if logits.shape[0] > 1:  # the verify pass: forget the drafts
                return real_apply(self, logits, mx.zeros((0,), mx.int32), 0)
            return real_apply(self, logits, drafts, first)

        monkeypatch.setattr(PenaltyContext, "apply", apply)
    elif wrong:

        def propose(pair, block, cache, sp, key, penalty=None):
            drafts, _ = real_propose(pair, block, cache, sp, key, penalty)
            q = probabilities(pair.drafter(block[None], cache)[0], sp)
            return drafts, q

        monkeypatch.setattr(engine, "propose", propose)
    p = chi_square_p(penalised_samples(pair, sp, kw, 800), joint)
    assert p < 1e-6 if wrong else p > 0.001


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_penalised_propose_and_verify_are_lazy(tiny_pair, d2_pair, monkeypatch, drafter):  # noqa: F811
    """No eval while drafting from the penalised q or penalising the verify logits: the cycle
    keeps its one host sync."""
    pair = tiny_pair if drafter == "dflash" else d2_pair
    from dflash_mac.target.capture import FeatureCapture

    cache = pair.drafter.make_cache()
    ids = pair.tokenizer.encode(PROMPTS[0])
    with FeatureCapture(pair.target, pair.layer_ids) as cap:
        mx.eval(pair.target(mx.array([ids])))
        pair.drafter.extend_context(cap.features(), cache)
    mx.eval([c.state for c in cache])
    ctx = Penalties.make(**PEN, **BIAS).bind(ids)
    block = mx.array([ids[-1]] + [pair.drafter.config.mask_token_id] * 4)
    calls = []
    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, lambda *a, **k: calls.append(a))
    sp = SamplingParams(temperature=0.9, top_k=20)
    drafts, q = engine.propose(pair, block, cache, sp, mx.random.key(0), ctx)
    logits = ctx.apply(mx.zeros((5, q.shape[-1])), drafts)
    monkeypatch.undo()
    assert calls == []
    assert drafts.shape == (4,) and q.shape[0] == 4 and logits.shape[0] == 5
    picked = mx.take_along_axis(q, drafts[:, None].astype(mx.int32), axis=-1)
    assert (picked > 0).all().item()  # each draft was drawn from its own q row
