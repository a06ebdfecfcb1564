"""The prefix tree and its disk tier: any request reuses the longest prefix any conversation
cached, rebuilt caches equal a fresh prefill (the target's and the drafter's, its window too),
and files on disk survive a restart, with corrupt, truncated and foreign ones removed."""

from __future__ import annotations

import logging
import shutil
import threading

import mlx.core as mx
import pytest
from helpers.tiny_hybrid import build_tiny_hybrid_pair
from mlx_lm.models.cache import ArraysCache

from dflash_mac.api import generate
from dflash_mac.engine.decode import DecodeState, GenerationConfig, speculative_stream
from dflash_mac.loading.loader import load
from dflash_mac.prefix.disk import DiskTier, decode, encode
from dflash_mac.prefix.tree import PrefixTree, Span
from dflash_mac.session import Session
from dflash_mac.sizing.choice import BlockChoice

N = 12
CFG = dict(max_tokens=N, use_eos=False, block_size=4)


def turn(session: Session, ids: list[int]) -> tuple[list[int], int]:
    events = list(session.stream(ids, **CFG))
    return [t for e in events for t in e.tokens], events[-1].stats.cached_tokens


def fresh(pair, ids: list[int]) -> list[int]:
    return generate(pair, ids, **CFG).tokens


def cold_state(pair, ids: list[int]) -> DecodeState:
    """The caches of one cold prefill of `ids` (a one-token request leaves exactly those)."""
    state = DecodeState(pair)
    cfg = GenerationConfig(max_tokens=1, use_eos=False, block=BlockChoice(4))
    list(speculative_stream(pair, ids, cfg, state=state))
    assert state.ids == ids
    return state


def assert_same_caches(mine: DecodeState, ref: DecodeState) -> None:
    """Target K/V (or recurrent states) and the drafter's kept context rows and positions."""
    assert mine.ids == ref.ids
    for a, b in zip(mine.target_cache, ref.target_cache):
        if isinstance(b, ArraysCache):
            for x, y in zip(a.cache, b.cache):
                assert mx.allclose(x, y, atol=1e-5, rtol=1e-4).item()
        else:
            n = b.offset
            assert a.offset == n
            assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item()
            assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-5).item()
    for a, b in zip(mine.draft_cache, ref.draft_cache):
        assert a.offset == b.offset and a.rows == b.rows
        pa, pb = a.positions(), b.positions()
        assert (pa is None) == (pb is None) and (pa is None or mx.array_equal(pa, pb).item())
        assert mx.allclose(a.keys, b.keys, atol=1e-5).item()
        assert mx.allclose(a.values, b.values, atol=1e-5).item()


@pytest.fixture(scope="module")
def texts(tiny_pair):
    tok = tiny_pair.tokenizer
    system = tok.encode(
        "You are a careful coding assistant. Tools: read(path), edit(path, text).\n"
    )
    return {
        "x": system + tok.encode("Fix the bug in add(a, b)."),
        "y": system + tok.encode("Rename the class Stack."),
        "z": tok.encode("import os\nimport sys\n"),
    }


@pytest.fixture(scope="module")
def windowed(tiny_dirs):
    """The tiny pair with a drafter keeping 4 sink rows and a 12-row window."""
    pair = load(*tiny_dirs)
    pair.drafter.context_sink, pair.drafter.context_window = 4, 12
    return pair


def test_a_new_conversation_reuses_a_shared_system_prompt(tiny_pair, texts):
    x, y = texts["x"], texts["y"]
    shared = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
    s = Session(tiny_pair, cache_size=4)
    out_x, cached = turn(s, x)
    assert cached == 0
    out_y, cached = turn(s, y)
    assert cached == shared and out_y == fresh(tiny_pair, y)
    # copy-on-extend: the first conversation was split, not cut back
    out_x2, cached = turn(s, x + out_x)
    assert cached == len(x) + len(out_x) - 1
    assert out_x2 == fresh(tiny_pair, x + out_x)
    assert len(s.cache) == 2
    assert s.cache.stats()["hits_ram"] == 2 and s.cache.stats()["misses"] == 1


@pytest.mark.parametrize("which", ["tiny", "windowed"])
def test_rebuilt_caches_equal_a_cold_prefill(tiny_pair, windowed, texts, which):
    """Target K/V and the drafter's context rows come back exactly, also where the drafter's
    window had dropped rows by the end of the request that cached them."""
    pair = tiny_pair if which == "tiny" else windowed
    x, y = texts["x"], texts["y"]
    s = Session(pair, cache_size=4)
    out_x, _ = turn(s, x)
    turn(s, y)
    for ids in (x + out_x[:-1], y[:-2], x[:20]):
        keep = s.reuse(ids + [5])
        assert keep == len(ids)
        assert_same_caches(s.state, cold_state(pair, ids))
        s.cache.put(s.state)
    assert turn(s, x + out_x)[0] == fresh(pair, x + out_x)


def test_a_lost_window_row_is_not_guessed(windowed, texts):
    """Negative control: a prefix whose drafter rows were dropped before they were stored is
    not rebuilt from what remains (the tree stores them at prefill, so clear them here)."""
    s = Session(windowed, cache_size=4)
    x = texts["x"]
    turn(s, x)
    for node in s.cache.tree.nodes():
        node.span.drafter = None
    assert s.reuse(x + [5]) == 0


def test_least_recently_used_conversations_go_first(tiny_pair, texts):
    x, y, z = texts["x"], texts["y"], texts["z"]
    s = Session(tiny_pair, cache_size=2)
    outs = {k: turn(s, texts[k])[0] for k in ("x", "y")}
    turn(s, x + outs["x"])  # x is now more recent than y
    turn(s, z)  # a third conversation: y's own leaf goes, the shared prompt stays
    assert len(s.cache) == 2
    shared = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
    assert turn(s, y + outs["y"])[1] == shared
    by_bytes = Session(tiny_pair, cache_size=8, cache_bytes=s.cache.nbytes // 3)
    for k in ("x", "y", "z"):
        turn(by_bytes, texts[k])
        assert by_bytes.cache.nbytes <= s.cache.nbytes // 3


def test_tree_splits_and_counts_bytes():
    def span(start, toks):
        rows = [[mx.full((1, 2, len(toks), 4), float(start)), mx.zeros((1, 2, len(toks), 4))]]
        return Span(start, toks, rows, [[mx.ones((1, 1, len(toks), 2))] * 2])

    tree = PrefixTree()
    tree.insert([1, 2, 3, 4], [span(0, [1, 2, 3, 4])])
    tree.insert([1, 2, 9], [span(2, [9])])
    assert sorted(len(n.span.tokens) for n in tree.nodes()) == [1, 2, 2]
    assert tree.nbytes == sum(n.span.nbytes for n in tree.nodes())
    path, reach = tree.match([1, 2, 3, 7])
    assert reach == 3 and [n.span.start for n in path] == [0, 2]
    assert tree.insert([5, 6], [span(3, [6])]) == []  # positions before the span are unknown
    tree.evict(None, 1)
    assert len(tree.leaves()) == 1 and tree.nbytes == sum(n.span.nbytes for n in tree.nodes())


def test_disk_round_trip_keeps_every_array(tiny_pair, texts):
    s = Session(tiny_pair)
    turn(s, texts["x"])
    for node in s.cache.tree.nodes():
        arrays, meta = encode(node.span)
        back = decode(arrays, meta)
        assert back.start == node.span.start and back.tokens == node.span.tokens
        for a, b in zip(node.span.arrays(), back.arrays()):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_a_restart_reads_the_disk_tier(tiny_pair, texts, tmp_path):
    x = texts["x"]
    disk = DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path)
    s = Session(tiny_pair, disk=disk)
    out_x, _ = turn(s, x)
    s.cache.close()
    assert disk.stats()["files"] >= 1
    again = Session(tiny_pair, disk=DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path))
    out, cached = turn(again, x + out_x)
    assert cached == len(x) + len(out_x) - 1 and again.cache.last.source == "disk"
    assert out == fresh(tiny_pair, x + out_x)
    assert again.cache.stats()["hits_disk"] == 1
    keep = again.reuse(x + [7])
    assert_same_caches(again.state, cold_state(tiny_pair, x))
    assert keep == len(x)


def test_bad_files_are_removed_with_one_line_each(tiny_pair, texts, tmp_path, caplog):
    x = texts["x"]
    disk = DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path)
    s = Session(tiny_pair, disk=disk)
    out_x, _ = turn(s, x)
    s.cache.close()
    folder = disk.folder
    files = sorted(folder.glob("*.safetensors"))
    (folder / "garbage.safetensors").write_bytes(b"not a safetensors file")
    elsewhere = tmp_path / "another-pair"
    elsewhere.mkdir()
    shutil.copy(files[0], elsewhere / files[0].name)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_mac.prompt_cache"):
        foreign = DiskTier(elsewhere, "another-pair", 1 << 30)  # another pair never reads ours
    assert foreign.stats()["files"] == 0 and not (elsewhere / files[0].name).exists()
    assert any("another pair" in r.getMessage() for r in caplog.records)
    big = max(files, key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])  # truncated data, header intact
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_mac.prompt_cache"):
        again = Session(tiny_pair, disk=DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path))
        out, cached = turn(again, x + out_x)
    assert out == fresh(tiny_pair, x + out_x)
    assert not (folder / "garbage.safetensors").exists() and not big.exists()
    removed = [r for r in caplog.records if "removed" in r.getMessage()]
    assert len(removed) >= 2 and all("\n" not in r.getMessage() for r in removed)


def test_an_unwritable_data_dir_leaves_memory_only(tiny_pair, texts, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="dflash_mac.prompt_cache"):
        disk = DiskTier.for_pair(tiny_pair, 1 << 30, blocker)
        s = Session(tiny_pair, disk=disk)
        out, _ = turn(s, texts["x"])
        assert turn(s, texts["x"] + out)[1] == len(texts["x"]) + len(out) - 1
    assert disk.broken and len([r for r in caplog.records if "disk tier is off" in r.message]) == 1


def test_disk_bound_removes_oldest_leaves(tiny_pair, texts, tmp_path):
    disk = DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path)
    s = Session(tiny_pair, cache_size=8, disk=disk)
    turn(s, texts["x"])
    disk.flush()
    one = disk.stats()["bytes"]
    disk.max_bytes = one + one // 2
    turn(s, texts["z"])
    disk.flush()
    assert 0 < disk.stats()["bytes"] <= disk.max_bytes
    assert sum(p.stat().st_size for p in disk.folder.glob("*.safetensors")) <= disk.max_bytes
    s.cache.close()


def test_the_cache_runs_on_worker_threads(tiny_pair, texts, tmp_path):
    """A request thread rebuilds from the tree; the disk writer thread saves evaluated arrays."""
    box = {}

    def go():
        s = Session(tiny_pair, disk=DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path))
        out, _ = turn(s, texts["z"])
        box["cached"] = turn(s, texts["z"] + out)[1]
        box["n"] = len(texts["z"]) + len(out) - 1
        s.cache.close()

    t = threading.Thread(target=go)
    t.start()
    t.join()
    assert box["cached"] == box["n"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load(*build_tiny_hybrid_pair(tmp_path_factory.mktemp("hybrid"), seed=0))


def test_hybrid_targets_restore_recurrent_states_exactly(hybrid, tmp_path):
    tok = hybrid.tokenizer
    system = tok.encode("def helper(values):\n    return sorted(values)\n\n")
    x, y = system + tok.encode("print(helper"), system + tok.encode("class A:")
    s = Session(hybrid, cache_size=4, disk=DiskTier.for_pair(hybrid, 1 << 30, tmp_path))
    out_x, _ = turn(s, x)
    # a span ends where x's prompt ends (a prefill chunk) and where its answer ends
    out, cached = turn(s, x + out_x)
    assert cached == len(x) + len(out_x) - 1 and out == fresh(hybrid, x + out_x)
    # y diverges inside x's prompt span: no recurrent state there, so a cold prefill
    assert turn(s, y)[1] == 0
    keep = s.reuse(x + [3])
    assert keep == len(x)
    assert_same_caches(s.state, cold_state(hybrid, x))
    s.cache.put(s.state)
    s.cache.close()
    again = Session(hybrid, disk=DiskTier.for_pair(hybrid, 1 << 30, tmp_path))
    assert again.reuse(x + [3]) == len(x) and again.cache.last.source == "disk"
    assert_same_caches(again.state, cold_state(hybrid, x))


def test_after_a_restart_a_new_conversation_finds_the_shared_blocks(tiny_pair, texts, tmp_path):
    """Files end at every block boundary: a conversation sharing only the system prompt with
    a cached one reads the blocks they share (in memory it would share every token)."""
    x, y = texts["x"], texts["y"]
    shared = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
    s = Session(tiny_pair, disk=DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path, block=16))
    turn(s, x)
    s.cache.close()
    again = Session(tiny_pair, disk=DiskTier.for_pair(tiny_pair, 1 << 30, tmp_path, block=16))
    out, cached = turn(again, y)
    assert cached == shared // 16 * 16 > 0 and again.cache.last.source == "disk"
    assert out == fresh(tiny_pair, y)


def test_a_stream_closed_mid_answer_gives_back_what_is_consistent(tiny_pair, texts):
    """A client that disconnects closes the stream between cycles: the prompt stays cached and
    the next request decodes exactly as a fresh one."""
    x = texts["x"]
    s = Session(tiny_pair)
    stream = s.stream(x, max_tokens=40, use_eos=False, block_size=4)
    seen = [t for _, ev in zip(range(3), stream) for t in ev.tokens]
    stream.close()
    nxt = x + seen + [7]
    out, cached = turn(s, nxt)
    assert len(x) <= cached <= len(x) + len(seen) and out == fresh(tiny_pair, nxt)
