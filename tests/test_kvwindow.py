"""`--max-kv-size`: greedy DFlash over a rotating window equals mlx-lm's own plain decoding with
the same `max_kv_size`, however the verify passes are accepted and rolled back."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers.oracle import OracleDrafter, with_drafter
from mlx_lm.generate import generate_step

from dflash_mac.api import generate
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.errors import PromptError, RollbackError, UserError
from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice
from dflash_mac.target.kvwindow import KEEP, SLACK, WindowKVCache, check_max_kv_size

LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n"  # 49 byte tokens
N = 72


def reference(pair, ids: list[int], n: int, window: int | None, step: int = 2048) -> list[int]:
    """mlx-lm's plain greedy decoding of the target with `max_kv_size=window`."""
    steps = generate_step(
        mx.array(ids), pair.target, max_tokens=n, max_kv_size=window, prefill_step_size=step
    )
    return [t for t, _ in steps]


def dflash(pair, ids, window, bs: int, n: int = N, step: int = 2048, state=None) -> list[int]:
    cfg = GenerationConfig(max_tokens=n, block=BlockChoice(bs), use_eos=False)
    cfg.prefill_step_size = step
    state = state or DecodeState(pair, window)
    return [t for e in speculative_stream(pair, ids, cfg, state=state) for t in e.tokens]


# (prompt, window, prefill step): the window wraps while generating; a prompt longer than the
# window (mlx-lm's chunked prefill path); a prompt prefilled in several chunks
CASES = [("import os", 24, 2048), (LONG, 20, 2048), (LONG, 16, 8)]


@pytest.fixture(scope="module")
def refs(tiny_pair):
    out = {}
    for text, window, step in CASES:
        ids = tiny_pair.tokenizer.encode(text)
        out[text, window, step] = ids, reference(tiny_pair, ids, N, window, step)
    return out


def test_the_window_changes_the_reference(tiny_pair, refs):
    """The cases are meaningful: the unbounded target decodes differently."""
    for (_, window, _), (ids, ref) in refs.items():
        assert len(ids) + N > window
        assert reference(tiny_pair, ids, N, None) != ref


@pytest.mark.parametrize(
    "bs", [pytest.param(2, marks=pytest.mark.slow), 5, pytest.param(16, marks=pytest.mark.slow)]
)
def test_real_drafter_matches_mlx_lm_rotating_cache(tiny_pair, refs, bs):
    for (text, window, step), (ids, ref) in refs.items():
        assert dflash(tiny_pair, ids, window, bs, step=step) == ref, (text, window, step)


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_rollback_after_the_window_wraps(tiny_pair, refs, error_rate):
    """An oracle drafter right, partly wrong or always wrong: full blocks, partial acceptance
    and rejection of whole blocks, all past the point where the window wrapped."""
    for i, ((text, window, step), (ids, ref)) in enumerate(refs.items()):
        oracle = OracleDrafter(tiny_pair.drafter, ids + ref, 320, error_rate, i)
        pair = with_drafter(tiny_pair, oracle)
        assert dflash(pair, ids, window, 8, step=step) == ref, (text, window, error_rate)


def test_memory_stays_bounded(tiny_pair):
    """Rows held by the target stay within the window + the rollback slack + one compaction
    step + a block; the drafter's context within its sink and the slack (a window this
    small), and within the window once it is larger than the slack."""
    ids = tiny_pair.tokenizer.encode("x")
    state = DecodeState(tiny_pair, 16)
    dflash(tiny_pair, ids, 16, 5, n=300, state=state)  # past a compaction of stale rows
    assert all(c.offset == len(state.ids) for c in state.target_cache)
    assert max(c.rows for c in state.target_cache) <= 16 + SLACK + 64 + 5
    assert max(c.rows for c in state.draft_cache) <= KEEP + SLACK
    big = DecodeState(tiny_pair, 512).draft_cache[0]
    assert (big.sink, big.window) == (KEEP, 512 - KEEP)
    own = tiny_pair.drafter.make_cache()[0]
    roomy = DecodeState(tiny_pair, 10**6).draft_cache[0]
    assert (roomy.sink, roomy.window) == (own.sink, own.window)  # its own bound is smaller


def test_api_and_session_pass_the_window(tiny_pair, refs):
    (ids, ref) = refs["import os", 24, 2048]
    out = generate(tiny_pair, ids, max_tokens=N, block_size=4, use_eos=False, max_kv_size=24)
    assert out.tokens == ref
    session = Session(tiny_pair, max_kv_size=24)
    assert isinstance(session.state.target_cache[0], WindowKVCache)
    events = session.stream(ids, max_tokens=N, block_size=4, use_eos=False)
    assert [t for e in events for t in e.tokens] == ref
    assert all(isinstance(s.target_cache[0], WindowKVCache) for s in session.cache.whole.entries)


def test_trim_reaches_back_within_the_slack_only(tiny_pair):
    ids = tiny_pair.tokenizer.encode("import os")
    state = DecodeState(tiny_pair, 12)
    dflash(tiny_pair, ids, 12, 4, n=300, state=state)
    n = len(state.ids)
    state.trim_to(n - SLACK // 2)  # a rollback deeper than any block: still exact
    assert all(c.offset == n - SLACK // 2 for c in state.target_cache)
    with pytest.raises(RollbackError):  # far behind the window: a fresh prefill instead
        state.trim_to(10)


def test_trimmed_window_continues_like_a_fresh_prefill(tiny_pair):
    """Cut back past the wrap, the cache gives the next position the logits of the same
    sequence decoded one token at a time by mlx-lm's rotating cache."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = tiny_pair.tokenizer.encode("class Stack:")
    state = DecodeState(tiny_pair, 20)
    out = dflash(tiny_pair, ids, 20, 6, n=60, state=state)
    state.trim_to(len(state.ids) - 7)
    seq = (ids + out)[: len(state.ids) + 1]
    logits = tiny_pair.target(mx.array([seq[-1:]]), cache=state.target_cache)[0, -1]
    ref_cache = make_prompt_cache(tiny_pair.target, max_kv_size=20)
    tiny_pair.target(mx.array([ids[:-1]]), cache=ref_cache)  # as mlx-lm prefills, then steps
    for t in seq[len(ids) - 1 :]:
        ref = tiny_pair.target(mx.array([[t]]), cache=ref_cache)[0, -1]
    assert mx.allclose(logits, ref, atol=1e-4).item()


@pytest.mark.parametrize("value", [0, 3, KEEP])
def test_too_small_a_window_is_one_sentence(value):
    with pytest.raises(PromptError, match="--max-kv-size must be more than 4"):
        check_max_kv_size(value)
    assert check_max_kv_size(None) is None and check_max_kv_size(KEEP + 1) == KEEP + 1


def test_a_target_with_its_own_cache_is_refused(tiny_pair):
    """mlx-lm would ignore max_kv_size for such a target; we say so."""
    target = SimpleNamespace(make_cache=lambda: [], layers=[])
    pair = SimpleNamespace(target=target, mirror=None, drafter=tiny_pair.drafter)
    with pytest.raises(UserError, match="builds its own cache"):
        DecodeState(pair, 64)


def test_the_server_gives_every_conversation_the_window(tiny_pair):
    from dflash_mac.serve.app import create_app

    app = create_app(tiny_pair, max_kv_size=24, prompt_cache_size=2)
    session = app.state.session
    assert session.cache.max_kv_size == 24
    assert isinstance(session.state.target_cache[0], WindowKVCache)
    app.state.worker.close()


def test_the_chat_gives_its_session_the_window(tiny_dirs):
    from dflash_mac.app.backend import ChatOptions, load_backend

    model, draft = tiny_dirs
    backend = load_backend(ChatOptions(str(model), str(draft), block_size=4, max_kv_size=24))
    assert backend.session.cache.max_kv_size == 24
    assert isinstance(backend.session.state.target_cache[0], WindowKVCache)
