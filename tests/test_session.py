"""Sessions: the second turn prefills only its new tokens; output equals a fresh generation."""

from __future__ import annotations

from dflash_mac.api import generate
from dflash_mac.session import Session, common_prefix


def turn(session, ids, **kw):
    events = list(session.stream(ids, max_tokens=24, use_eos=False, **kw))
    return [t for e in events for t in e.tokens], events[-1]


def test_second_turn_prefills_only_new_tokens(tiny_pair):
    tok = tiny_pair.tokenizer
    s = Session(tiny_pair)
    ids1 = tok.encode("def add(a, b):")
    out1, last1 = turn(s, ids1)
    assert last1.stats.cached_tokens == 0
    ids2 = ids1 + out1 + tok.encode("\n# next question")
    out2, last2 = turn(s, ids2)
    cached = len(ids1) + len(out1) - 1  # the last output token was never run through the target
    assert last2.stats.cached_tokens == cached
    assert last2.stats.prompt_tokens - last2.stats.cached_tokens == len(ids2) - cached
    fresh = generate(tiny_pair, ids2, max_tokens=24, use_eos=False)
    assert out2 == fresh.tokens


def test_edit_falls_back_to_common_prefix(tiny_pair):
    tok = tiny_pair.tokenizer
    s = Session(tiny_pair)
    ids1 = tok.encode("class Stack:\n    def push(self, x):")
    turn(s, ids1)
    edited = ids1[:5] + tok.encode("Xtotally different")
    out, last = turn(s, edited)
    assert common_prefix(ids1, edited) == 5
    assert last.stats.cached_tokens == 5
    assert out == generate(tiny_pair, edited, max_tokens=24, use_eos=False).tokens


def test_regenerate_same_prompt(tiny_pair):
    ids = tiny_pair.tokenizer.encode("import os")
    s = Session(tiny_pair)
    a, _ = turn(s, ids)
    b, last = turn(s, ids)
    assert a == b
    assert last.stats.cached_tokens == len(ids) - 1


def test_cancel_leaves_session_consistent(tiny_pair):
    ids = tiny_pair.tokenizer.encode("while True:")
    s = Session(tiny_pair)
    calls = {"n": 0}

    def stop_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    events = list(s.stream(ids, should_stop=stop_after_two, max_tokens=64, use_eos=False))
    assert events[-1].finish_reason == "cancelled"
    out = [t for e in events for t in e.tokens]
    assert len(s.state.ids) == len(ids) + len(out) - 1
    assert all(c.offset == len(s.state.ids) for c in s.state.target_cache)
    assert s.state.ids == ids + out[:-1]
    # The next turn continues from exactly the committed ids.
    nxt = ids + out + tiny_pair.tokenizer.encode(" more")
    o2, last = turn(s, nxt)
    assert o2 == generate(tiny_pair, nxt, max_tokens=24, use_eos=False).tokens
