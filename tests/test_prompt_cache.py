"""The prompt cache: several conversations each reuse their own prefix (LRU by count and bytes),
and a reused state decodes exactly like a fresh prefill."""

from __future__ import annotations

import threading

import pytest

from dflash_mac.api import generate
from dflash_mac.prefix.cache import PromptCache
from dflash_mac.session import Session

N = 16


def turn(session: Session, ids: list[int]) -> tuple[list[int], int]:
    """(output tokens, cached tokens) of one greedy turn."""
    events = list(session.stream(ids, max_tokens=N, use_eos=False))
    return [t for e in events for t in e.tokens], events[-1].stats.cached_tokens


def fresh(pair, ids: list[int]) -> list[int]:
    return generate(pair, ids, max_tokens=N, use_eos=False).tokens


@pytest.fixture(scope="module")
def convs(tiny_pair):
    tok = tiny_pair.tokenizer
    return {
        "a": tok.encode("def add(a, b):"),
        "b": tok.encode("The quick brown fox"),
        "c": tok.encode("import os\nimport sys"),
    }


def test_alternating_conversations_prefill_only_their_new_tokens(tiny_pair, convs):
    tok = tiny_pair.tokenizer
    s = Session(tiny_pair, cache_size=2)
    a1, b1 = convs["a"], convs["b"]
    out_a1, cached = turn(s, a1)
    assert cached == 0
    out_b1, cached = turn(s, b1)
    assert cached == 0
    a2 = a1 + out_a1 + tok.encode("\n# and subtract")
    out_a2, cached = turn(s, a2)
    assert cached == len(a1) + len(out_a1) - 1  # the last output token was never run
    b2 = b1 + out_b1 + tok.encode(" jumps")
    out_b2, cached = turn(s, b2)
    assert cached == len(b1) + len(out_b1) - 1
    # reused (rolled back and extended) states decode exactly like a fresh prefill
    assert out_a2 == fresh(tiny_pair, a2)
    assert out_b2 == fresh(tiny_pair, b2)
    assert len(s.cache) == 2


def test_a_single_state_session_loses_the_other_conversation(tiny_pair, convs):
    """The control: with one entry, alternating conversations re-prefill each time."""
    tok = tiny_pair.tokenizer
    s = Session(tiny_pair)
    out_a1, _ = turn(s, convs["a"])
    turn(s, convs["b"])
    _, cached = turn(s, convs["a"] + out_a1 + tok.encode("\n#"))
    assert cached < len(convs["a"])


def test_lru_eviction_by_count(tiny_pair, convs):
    s = Session(tiny_pair, cache_size=2)
    outs = {k: turn(s, convs[k])[0] for k in ("a", "b", "c")}  # "a" is evicted by "c"
    assert len(s.cache) == 2
    _, cached = turn(s, convs["a"] + outs["a"])
    assert cached == 0
    _, cached = turn(s, convs["c"] + outs["c"])  # "c" was kept; "b" went when "a" came back
    assert cached == len(convs["c"]) + len(outs["c"]) - 1
    _, cached = turn(s, convs["b"] + outs["b"])
    assert cached == 0


def test_lru_eviction_by_bytes(tiny_pair, convs):
    probe = Session(tiny_pair, cache_size=4)
    turn(probe, convs["a"])
    one = probe.cache.nbytes
    assert one > 0
    s = Session(tiny_pair, cache_size=4, cache_bytes=one * 3 // 2)  # room for one state
    out_a, _ = turn(s, convs["a"])
    out_b, _ = turn(s, convs["b"])
    assert len(s.cache) == 1 and s.cache.nbytes <= one * 3 // 2
    _, cached = turn(s, convs["b"] + out_b)
    assert cached == len(convs["b"]) + len(out_b) - 1
    _, cached = turn(s, convs["a"] + out_a)
    assert cached == 0
    none = Session(tiny_pair, cache_size=4, cache_bytes=0)
    turn(none, convs["a"])
    assert len(none.cache) == 0
    assert turn(none, convs["a"] + out_a)[1] == 0


def test_a_short_shared_prefix_does_not_cut_another_conversation(tiny_pair, convs):
    """A new prompt sharing a little with a cached conversation reuses that little and leaves
    the conversation whole (its node is split, not cut back); an edit reuses up to the edit."""
    tok = tiny_pair.tokenizer
    s = Session(tiny_pair, cache_size=3)
    a = convs["a"]
    out_a, _ = turn(s, a)
    other = a[:2] + tok.encode(" something else entirely, and longer")
    out_o, cached = turn(s, other)
    assert cached == 2 and len(s.cache) == 2
    assert out_o == fresh(tiny_pair, other)
    _, cached = turn(s, a + out_a)  # "a" is intact
    assert cached == len(a) + len(out_a) - 1
    edit = a + out_a[:-3] + tok.encode("X")
    out_e, cached = turn(s, edit)
    assert cached == len(a) + len(out_a) - 3
    assert out_e == fresh(tiny_pair, edit)


def test_cache_runs_on_a_worker_thread(tiny_pair, convs):
    s, box = Session(tiny_pair, cache_size=2), {}

    def go():
        out, _ = turn(s, convs["a"])
        box["cached"] = turn(s, convs["a"] + out)[1]
        box["n"] = len(convs["a"]) + len(out) - 1

    t = threading.Thread(target=go)
    t.start()
    t.join()
    assert box["cached"] == box["n"]


def test_bad_sizes_are_refused(tiny_pair):
    with pytest.raises(ValueError, match=r"^--prompt-cache-size must be at least 1 \(got 0\)\.$"):
        PromptCache(tiny_pair, 0)
    with pytest.raises(ValueError, match=r"^--prompt-cache-bytes must be >= 0 \(got -1\)\.$"):
        PromptCache(tiny_pair, 1, -1)
