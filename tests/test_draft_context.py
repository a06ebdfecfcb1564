"""The drafter's bounded context cache (models/dflash.py: ContextCache): it keeps sink + window
rows, and decodes exactly like an unbounded cache while the context is shorter than that."""

from __future__ import annotations

import mlx.core as mx
from dflash_mac.models.dflash import ContextCache
from mlx_lm.generate import generate_step

from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.sizing.choice import BlockChoice


def run(pair, ids, n, bs=5):
    state = DecodeState(pair)
    events = list(
        speculative_stream(pair, ids, GenerationConfig(n, BlockChoice(bs), use_eos=False), state)
    )
    return [t for e in events for t in e.tokens], events[-1].stats.acceptance_lengths, state


def test_context_cache_keeps_sink_and_window_with_true_positions():
    c = ContextCache(sink=2, window=3)
    for i in range(4):
        c.update_and_fetch(mx.full((1, 1, 2, 4), i), mx.full((1, 1, 2, 4), i))
    assert c.offset == 8 and c.rows == 5
    assert c.positions().tolist() == [0, 1, 5, 6, 7]
    assert c.keys[0, 0, :, 0].tolist() == [0, 0, 2, 3, 3]
    assert c.trim(2) == 2 and c.offset == 6 and c.positions().tolist() == [0, 1, 5]
    assert c.trim(5) == 1  # the sink stays
    unbounded = ContextCache()
    unbounded.update_and_fetch(mx.zeros((1, 1, 9, 4)), mx.zeros((1, 1, 9, 4)))
    assert unbounded.positions() is None and unbounded.rows == 9


def test_bounded_decodes_like_unbounded_below_the_window(tiny_pair, monkeypatch):
    ids = tiny_pair.tokenizer.encode("def add(a, b):")
    bounded = run(tiny_pair, ids, 40)  # default bound 64 + 1024: far above this context
    monkeypatch.setattr(tiny_pair.drafter, "context_window", None)
    unbounded = run(tiny_pair, ids, 40)
    assert bounded[0] == unbounded[0] and bounded[1] == unbounded[1]


def test_bounded_cache_keeps_its_size_and_stays_lossless(tiny_pair, monkeypatch):
    monkeypatch.setattr(tiny_pair.drafter, "context_sink", 4)
    monkeypatch.setattr(tiny_pair.drafter, "context_window", 16)
    ids = tiny_pair.tokenizer.encode("The quick brown fox")
    ref = [t for t, _ in generate_step(mx.array(ids), tiny_pair.target, max_tokens=60)]
    tokens, _, state = run(tiny_pair, ids, 60)
    assert tokens == ref
    assert all(c.rows <= 20 for c in state.draft_cache)
    assert state.draft_cache[0].offset == len(state.ids)
