"""Greedy DFlash output is token-identical to mlx-lm's own greedy decoding of the target."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.generate import generate_step

from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.engine.textstream import TextStream
from dflash_mac.sizing.choice import BlockChoice

PROMPTS = [
    "def add(a, b):",
    "import os",
    "class Stack:",
    "hello world",
    "for i in range(10):",
    "# utility",
    "x = [1, 2, 3]",
    "while True:",
    "return None",
    "print('hi')",
    "from typing import Any",
    "async def main():",
    "try:",
    "with open(p) as f:",
    "lambda x: x",
    "if __name__ == '__main__':",
    "raise ValueError",
    "yield from it",
    "assert a == b",
    "global counter",
    "a",
    "The quick brown fox",
]


def baseline(pair, ids: list[int], n: int) -> list[int]:
    """mlx-lm's plain greedy decoding of the target (no hooks)."""
    return [t for t, _ in generate_step(mx.array(ids), pair.target, max_tokens=n)]


def run(pair, ids, **kw) -> tuple[list[int], list, str]:
    """The drafter's cycles (no copy drafting, tested in test_copydraft.py)."""
    if "block_size" in kw:  # a fixed size
        kw["block"] = BlockChoice(kw.pop("block_size"))
    kw.setdefault("copy", False)
    events = list(speculative_stream(pair, ids, GenerationConfig(**kw)))
    tokens = [t for e in events for t in e.tokens]
    return tokens, [e.accepted for e in events[1:]], events[-1].finish_reason


@pytest.fixture(scope="module")
def cases(tiny_pair):
    out = []
    for p in PROMPTS:
        ids = tiny_pair.tokenizer.encode(p)
        out.append((ids, baseline(tiny_pair, ids, 64)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_real_drafter_matches_target(tiny_pair, cases, block_size):
    for ids, ref in cases:
        tokens, _, reason = run(tiny_pair, ids, max_tokens=64, block_size=block_size, use_eos=False)
        assert tokens == ref
        assert reason == "length"


@pytest.mark.parametrize(
    "block_size",
    [pytest.param(2, marks=pytest.mark.slow), 5, pytest.param(16, marks=pytest.mark.slow)],
)
def test_partially_right_drafter_matches_target(tiny_pair, cases, block_size):
    """An oracle drafter wrong 30% of the time exercises partial acceptance and rollback."""
    for i, (ids, ref) in enumerate(cases):
        pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.3, i))
        tokens, acc, _ = run(pair, ids, max_tokens=64, block_size=block_size, use_eos=False)
        assert tokens == ref
        if block_size > 2:
            assert 1 < sum(acc) / len(acc) < block_size


@pytest.mark.parametrize("max_tokens", [1, 7, 23])
def test_max_tokens_mid_block(tiny_pair, cases, max_tokens):
    ids, ref = cases[0]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.0))
    tokens, _, reason = run(pair, ids, max_tokens=max_tokens, block_size=5, use_eos=False)
    assert tokens == ref[:max_tokens]
    assert reason == "length"


def test_eos_mid_block_stops_exactly(tiny_pair, cases):
    for ids, ref in cases[:8]:
        eos = ref[20]
        stop_at = ref.index(eos)
        pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.0))
        old = set(tiny_pair.tokenizer.eos_token_ids)
        tiny_pair.tokenizer.eos_token_ids = {eos}
        try:
            tokens, _, reason = run(pair, ids, max_tokens=64, block_size=16)
        finally:
            tiny_pair.tokenizer.eos_token_ids = old
        assert tokens == ref[:stop_at]
        assert reason == "stop"


def test_mask_token_output_is_kept(tiny_pair, cases):
    """An output equal to mask_token_id is a legal token and must not be stripped: the drafter's
    mask id is set to a token the target really generates, and the output still equals the
    target's own greedy decoding, mask token included."""
    ids, ref = cases[1]
    mask = ref[5]
    assert mask not in tiny_pair.eos_ids
    real = SimpleNamespace(config=dataclasses.replace(tiny_pair.drafter.config, mask_token_id=mask))
    pair = with_drafter(tiny_pair, OracleDrafter(real, ids + ref, 320, 0.0))
    tokens, _, _ = run(pair, ids, max_tokens=64, block_size=5, use_eos=False)
    assert mask in tokens
    assert tokens == ref


def test_stop_string_on_committed_text(tiny_pair, cases):
    checked = 0
    for ids, ref in cases[:8]:
        free = TextStream(tiny_pair.tokenizer, [], set())
        full = free.push(ref, 10**6)
        starts = [
            i
            for i in range(10, len(full) - 2)
            if full[i : i + 2].isascii()
            and full[i : i + 2].isprintable()
            and full[i : i + 2].strip()
        ]
        if not starts:
            continue
        stop = full[starts[0] : starts[0] + 2]
        pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.0))
        events = list(
            speculative_stream(
                pair,
                ids,
                GenerationConfig(max_tokens=64, block=BlockChoice(16), stop=[stop], use_eos=False),
            )
        )
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop"
        assert text == full[: full.find(stop)]
        checked += 1
    assert checked >= 3


def test_agreeing_drafter_tau_equals_block_size(tiny_pair, cases):
    ids, ref = cases[2]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.0))
    tokens, acc, _ = run(pair, ids, max_tokens=1 + 5 * 12, block_size=5, use_eos=False)
    assert tokens == ref[: 1 + 5 * 12]
    assert acc == [5] * 12


def test_wrong_drafter_tau_is_one(tiny_pair, cases):
    ids, ref = cases[3]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 1.0))
    tokens, acc, _ = run(pair, ids, max_tokens=40, block_size=8, use_eos=False)
    assert tokens == ref[:40]
    assert set(acc) == {1}


def test_rollback_state_equals_fresh_prefill(tiny_pair, cases):
    """After forced rejections the cache holds exactly the committed ids, and the next logits
    equal those of a fresh prefill of that sequence."""
    ids, ref = cases[4]
    pair = with_drafter(tiny_pair, OracleDrafter(tiny_pair.drafter, ids + ref, 320, 0.5, 7))
    state = DecodeState(pair)
    events = list(
        speculative_stream(
            pair,
            ids,
            GenerationConfig(max_tokens=30, block=BlockChoice(8), use_eos=False),
            state=state,
        )
    )
    out = [t for e in events for t in e.tokens]
    assert any(0 < e.accepted < 8 for e in events[1:])
    committed = ids + out[:-1]
    assert state.ids == committed
    assert all(c.offset == len(committed) for c in state.target_cache)
    assert state.draft_cache[0].offset == len(committed)
    nxt = mx.array([[out[-1]]])
    logits = pair.target(nxt, cache=state.target_cache)[0, -1]
    fresh = pair.target(mx.array([committed + [out[-1]]]))[0, -1]
    assert mx.allclose(logits, fresh, atol=1e-5).item()


def test_interleaved_streams_share_hooks(tiny_pair, cases):
    """Two live generations on the same target instance, advanced alternately, each equal their
    own baseline; no hook is left afterwards."""
    from dflash_mac.target.hooks import is_hooked

    (ids_a, ref_a), (ids_b, ref_b) = cases[5], cases[6]
    a = speculative_stream(
        tiny_pair, ids_a, GenerationConfig(max_tokens=30, block=BlockChoice(4), use_eos=False)
    )
    b = speculative_stream(
        tiny_pair, ids_b, GenerationConfig(max_tokens=30, block=BlockChoice(4), use_eos=False)
    )
    out_a, out_b = [], []
    for ev_a, ev_b in zip(a, b):
        out_a += ev_a.tokens
        out_b += ev_b.tokens
    for ev in a:
        out_a += ev.tokens
    for ev in b:
        out_b += ev.tokens
    assert out_a == ref_a[:30] and out_b == ref_b[:30]
    assert not is_hooked(tiny_pair.target)


def test_layer_queueing_keeps_tokens_and_unhooks(tiny_pair, cases, monkeypatch):
    """Queueing every target layer as it is built (the CPU default) changes no token; the hook
    queues exactly the layers' outputs, nested captures keep their own setting, and leaving
    restores every layer."""
    from dflash_mac.engine import cycle, decode
    from dflash_mac.target import capture
    from dflash_mac.target.capture import FeatureCapture, layer_queue
    from dflash_mac.target.hooks import is_hooked
    from dflash_mac.target.structure import decoder_layers

    ids, ref = cases[3]
    for queued in (True, False):
        monkeypatch.setattr(decode, "queues_layers", lambda q=queued: q)
        monkeypatch.setattr(cycle, "queues_layers", lambda q=queued: q)
        tokens, _, _ = run(tiny_pair, ids, max_tokens=40, block_size=4, use_eos=False)
        assert tokens == ref[:40]
    queued_outputs = []
    real = mx.async_eval
    monkeypatch.setattr(capture.mx, "async_eval", lambda *a: queued_outputs.append(a) or real(*a))
    n_layers = len(decoder_layers(tiny_pair.target))
    with FeatureCapture(tiny_pair.target, tiny_pair.layer_ids) as cap:
        tiny_pair.target(mx.array([ids]))
        assert queued_outputs == []  # capture alone queues nothing
        with layer_queue(tiny_pair.target):
            tiny_pair.target(mx.array([ids]))
            assert len(queued_outputs) == n_layers
        tiny_pair.target(mx.array([ids]))
        assert len(queued_outputs) == n_layers  # the outer capture does not queue
        assert (
            cap.features().shape[-1] == len(tiny_pair.layer_ids) * tiny_pair.target.args.hidden_size
        )
    assert not is_hooked(tiny_pair.target)
