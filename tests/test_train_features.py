"""`--cache-features`: the frozen target's side of training read from disk equals the live one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_train import _train, prompts_file  # noqa: F401  (fixture)

from dflash_mac.target.structure import target_head
from dflash_mac.train.args import TrainSettings
from dflash_mac.train.batches import make_batch, target_forward
from dflash_mac.train.data import Sequence
from dflash_mac.train.features import FeatureStore
from dflash_mac.train.soft import LossSpec, target_soft_labels


def _seqs(rng, vocab: int) -> list[Sequence]:
    return [
        Sequence(rng.integers(5, vocab, 7).tolist(), rng.integers(5, vocab, n).tolist())
        for n in (20, 33, 12)
    ]


def _live_and_stored(tiny_pair, tmp_path, layer_ids, stored_ids=None):
    rng = np.random.default_rng(0)
    target = tiny_pair.target
    vocab = target_head(target).embed.weight.shape[0]
    seqs = _seqs(rng, vocab)
    spec = LossSpec("mix", (0.7, 1.0), 0.5, 8)
    data_file = tmp_path / "regen-x.jsonl"
    store = FeatureStore.open_or_build(target, stored_ids or layer_ids, seqs, data_file, 64, spec)
    s = TrainSettings(block_size=5, anchors=6, max_length=64, target_layer_ids=layer_ids)
    idx = [2, 0, 1]
    batch = make_batch(seqs, idx, 0, s)
    feats, hidden = target_forward(target, layer_ids, batch.tokens, want_hidden=True)
    live = target_soft_labels(
        target_head(target), hidden, mx.array(batch.anchors), s.block_size, spec
    )
    return store, idx, batch, feats, live


def test_stored_features_and_soft_labels_equal_the_live_forward(tiny_pair, tmp_path):
    store, idx, batch, feats, live = _live_and_stored(tiny_pair, tmp_path, [1, 2])
    got = store.features(idx, batch.tokens.shape[1])
    for j, i in enumerate(idx):  # real positions only; padding is zeros in the store
        n = store.layout.lengths[i]
        assert np.allclose(np.array(got[j, :n]), np.array(feats[j, :n]), atol=1e-5)
        assert not np.array(got[j, n:]).any()
    soft = store.soft(idx, batch.anchors, 5)
    assert np.array_equal(np.sort(np.array(soft.ids), -1), np.sort(np.array(live.ids), -1))
    order = lambda s: np.argsort(np.array(s.ids), -1)  # noqa: E731  (top-k comes unordered)
    for a, b in ((soft, order(soft)), (live, order(live))):
        a.sorted = np.take_along_axis(np.array(a.probs), b[None], -1)
    assert np.allclose(soft.sorted, live.sorted, atol=1e-6)
    # the store sums its normalisers in float64 (`host_log_normalisers`): a few fp32 ulps of
    # lse apart, which 1 - sum(p) shows undamped
    assert np.allclose(np.array(soft.tail), np.array(live.tail), atol=1e-5)


def test_features_of_other_layers_do_not_match(tiny_pair, tmp_path):
    """Negative control: the equality above can fail (features of the wrong layers)."""
    store, idx, batch, feats, _ = _live_and_stored(tiny_pair, tmp_path, [1, 2], stored_ids=[0, 3])
    got = np.array(store.features(idx, batch.tokens.shape[1]))
    n = store.layout.lengths[idx[0]]
    assert not np.allclose(got[0, :n], np.array(feats[0, :n]), atol=1e-3)


def test_building_resumes_and_reopens(tiny_pair, tmp_path):
    rng = np.random.default_rng(1)
    target = tiny_pair.target
    vocab = target_head(target).embed.weight.shape[0]
    seqs = _seqs(rng, vocab) * 7  # 21 sequences: one progress write at 16
    spec = LossSpec("kl", (1.0,), 1.0, 4)
    seen = []
    full = FeatureStore.open_or_build(
        target, [1], seqs, tmp_path / "r.jsonl", 64, spec, progress=lambda d, n: seen.append(d)
    )
    assert seen == [16, 21]
    ref = np.array(full.features([20], 64))
    meta = full.folder / "meta.json"
    meta.write_text(json.dumps({"done": 16}))  # as if stopped after the first write
    rows = np.load(full.folder / "features.npy", mmap_mode="r+")
    rows[full.layout.starts[16] :] = 0.0
    rows.flush()
    again = FeatureStore.open_or_build(
        target, [1], seqs, tmp_path / "r.jsonl", 64, spec, progress=lambda d, n: seen.append(d)
    )
    assert seen == [16, 21, 21]  # only the last five were computed again
    assert np.array_equal(np.array(again.features([20], 64)), ref)


@pytest.mark.slow
def test_training_with_cached_features_follows_the_live_trajectory(
    tiny_dirs,
    prompts_file,  # noqa: F811
    tmp_path,
):
    kw = dict(steps=6, loss="mix", kl_temperatures=[0.7, 1.0])
    live, _ = _train(tiny_dirs, prompts_file, tmp_path / "a", tmp_path / "ca", **kw)
    cached, _ = _train(
        tiny_dirs, prompts_file, tmp_path / "b", tmp_path / "cb", cache_features=True, **kw
    )
    assert np.allclose(live, cached, rtol=1e-4, atol=1e-5)
    assert list((tmp_path / "cb" / "data").glob("features-*/features.npy"))


def test_a_store_set_reads_several_data_files_as_one(tiny_pair, tmp_path):
    """New data adds a store of its own: two stores read together give exactly what one store
    of all the sequences gives (features, soft labels, the soft mass the vocabulary counts)."""
    from dflash_mac.train.features import StoreSet

    rng = np.random.default_rng(2)
    target = tiny_pair.target
    seqs = _seqs(rng, target_head(target).embed.weight.shape[0]) * 2
    spec = LossSpec("mix", (0.7, 1.0), 0.5, 8)
    one = FeatureStore.open_or_build(target, [1, 2], seqs, tmp_path / "all.jsonl", 64, spec)
    parts = StoreSet(
        [
            FeatureStore.open_or_build(target, [1, 2], seqs[:2], tmp_path / "a.jsonl", 64, spec),
            FeatureStore.open_or_build(target, [1, 2], seqs[2:], tmp_path / "b.jsonl", 64, spec),
        ]
    )
    s = TrainSettings(block_size=5, anchors=6, max_length=64, target_layer_ids=[1, 2])
    idx = [4, 1, 2]
    batch = make_batch(seqs, idx, 0, s)
    L = batch.tokens.shape[1]
    assert np.allclose(np.array(parts.features(idx, L)), np.array(one.features(idx, L)))
    a, b = parts.soft(idx, batch.anchors, 5), one.soft(idx, batch.anchors, 5)
    assert np.array_equal(np.array(a.ids), np.array(b.ids))
    assert np.allclose(np.array(a.probs), np.array(b.probs))
    assert np.allclose(np.array(a.tail), np.array(b.tail))
    for i in (0, 3, 5):
        m1, m2 = parts.soft_mass(i, 6, 15), one.soft_mass(i, 6, 15)
        assert np.array_equal(m1[0], m2[0]) and np.allclose(m1[1], m2[1])


def test_two_stage_top_k_and_host_normalisers_equal_the_one_pass_ones():
    """`top_k_ids` partitions groups first at a large vocabulary; the ids equal one full
    partition's (ties aside); the host log-normalisers equal MLX's."""
    from dflash_mac.train.soft import host_log_normalisers, log_normalisers, top_k_ids

    x = mx.random.normal((6, 49_152 + 37), key=mx.random.key(3)) * 4
    got = np.sort(np.array(top_k_ids(x, 32)), -1)
    ref = np.sort(np.array(mx.argpartition(-x, kth=31, axis=-1)[:, :32]), -1)
    assert np.array_equal(got, ref)
    shuffled = np.sort(np.array(top_k_ids(x[:, ::-1], 32)), -1)  # a control: other columns
    assert not np.array_equal(shuffled, ref)
    host = host_log_normalisers(np.array(x), (0.7, 1.0))
    x64 = np.array(x).astype(np.float64)
    exact = np.stack([np.log(np.exp(x64 / t).sum(-1)) for t in (0.7, 1.0)], -1)
    assert np.allclose(host, exact, rtol=0, atol=1e-5)  # MLX's fp32 sum: ~1e-4 off here
    assert np.allclose(np.array(log_normalisers(x, (0.7, 1.0))), exact, rtol=0, atol=3e-4)


def test_stores_built_in_worker_processes_equal_one_process(tiny_dirs, tiny_pair, tmp_path):
    """Two worker processes (spawned, each its own target) build what one process builds."""
    from dflash_mac.train.parallel_features import build_in_workers
    from dflash_mac.train.trainer import load_target

    rng = np.random.default_rng(4)
    target = tiny_pair.target
    seqs = _seqs(rng, target_head(target).embed.weight.shape[0]) * 2
    spec = LossSpec("mix", (0.7, 1.0), 0.5, 8)
    parts = [(seqs[:4], tmp_path / "w" / "a.jsonl"), (seqs[4:], tmp_path / "w" / "b.jsonl")]
    (tmp_path / "w").mkdir()
    logs = []
    build_in_workers(load_target, tiny_dirs[0], parts, [1, 2], 64, spec, 2, logs.append)
    assert logs and logs[-1].startswith("target features: 6/6 sequences in 2 processes")
    for k, (part, file) in enumerate(parts):
        one = FeatureStore.open_or_build(target, [1, 2], part, tmp_path / f"{k}.jsonl", 64, spec)
        built = FeatureStore.open_or_build(target, [1, 2], part, file, 64, spec)
        for name in one.arrays:
            assert np.allclose(built.arrays[name], one.arrays[name], atol=1e-5), name


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process tree from /proc")
def test_workers_stop_when_their_parent_is_killed(tiny_dirs, tmp_path):
    """A build killed (SIGKILL, no clean-up) leaves no worker computing on: each exits at its
    next written chunk (`_orphaned`), and a rerun resumes from there."""
    script = f"""
import numpy as np
from pathlib import Path
from dflash_mac.train.data import Sequence
from dflash_mac.train.parallel_features import build_in_workers
from dflash_mac.train.soft import LossSpec
from dflash_mac.train.trainer import load_target
rng = np.random.default_rng(0)
seqs = [Sequence(rng.integers(5, 200, 7).tolist(), rng.integers(5, 200, 60).tolist())
        for _ in range(40_000)]
out = Path({str(tmp_path)!r})
parts = [(seqs[:20_000], out / "a.jsonl"), (seqs[20_000:], out / "b.jsonl")]
build_in_workers(load_target, Path({str(tiny_dirs[0])!r}), parts, [1, 2], 64,
                 LossSpec("mix", (0.7, 1.0), 0.5, 8), 2, print)
"""
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("features-*/meta.json"))) < 2:  # both workers writing
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.5)
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        workers = [int(c) for c in children if "spawn_main" in _cmdline(int(c))]
        assert len(workers) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{w}").exists() and _cmdline(w) for w in workers):
        assert time.monotonic() < deadline, "a worker outlived its parent by a minute"
        time.sleep(0.5)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
