"""Soft-target distillation in `dflash-mac train`: KL to p_T with top-k + tail soft labels."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash2 import DFlash2DraftModel
from dflash_mac.models.distribution import SamplingParams, scatter_candidates
from test_dflash2 import d2_config, randomize
from test_train import _train, prompts_file  # noqa: F401  (fixture)

from dflash_mac.loading.loader import load
from dflash_mac.target.structure import target_head
from dflash_mac.train import TrainError, TrainingArgs
from dflash_mac.train.batches import target_features
from dflash_mac.train.dflash2_loss import selector_q
from dflash_mac.train.soft import (
    LossSpec,
    SoftLabels,
    position_loss,
    selector_soft_loss,
    soft_kl,
    top_k_soft,
    topk_kl,
)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_topk_kl_equals_a_hand_computed_value():
    target = np.array([2.0, 1.0, 0.0, -1.0])
    draft = np.array([0.5, 1.5, -0.5, 0.0])
    T = 0.7
    p, q = _softmax(target / T), _softmax(draft / T)
    # by hand: buckets {0}, {1}, tail {2, 3}
    tail_p, tail_q = p[2] + p[3], q[2] + q[3]
    want = p[0] * math.log(p[0] / q[0]) + p[1] * math.log(p[1] / q[1])
    want += tail_p * math.log(tail_p / tail_q)
    soft = top_k_soft(mx.array(target)[None], [T], 2)
    assert sorted(np.array(soft.ids[0]).tolist()) == [0, 1]
    got = topk_kl(mx.array(draft)[None], soft.ids, soft.probs[0], soft.tail[0], T)
    assert abs(got.item() - want) < 1e-5
    # k = V: no tail, the full forward KL
    full = top_k_soft(mx.array(target)[None], [T], 4)
    got = topk_kl(mx.array(draft)[None], full.ids, full.probs[0], full.tail[0], T).item()
    assert abs(got - float((p * np.log(p / q)).sum())) < 1e-5
    # q = p: zero
    same = topk_kl(mx.array(target)[None], soft.ids, soft.probs[0], soft.tail[0], T).item()
    assert abs(same) < 1e-6


def test_soft_labels_with_the_tail_sum_to_one():
    logits = mx.random.normal((3, 5, 7, 300), key=mx.random.key(1)) * 3
    soft = top_k_soft(logits, [0.5, 0.7, 1.0], 32)
    assert soft.ids.shape == (3, 5, 7, 32) and soft.probs.shape == (3, 3, 5, 7, 32)
    total = np.array(soft.probs.sum(axis=-1) + soft.tail)
    assert np.allclose(total, 1.0, atol=1e-5)
    # lower temperature: more mass in the top-k
    tails = [float(soft.tail[i].mean()) for i in range(3)]
    assert tails[0] < tails[1] < tails[2] and tails[0] > 0
    # the ids are the k largest logits
    kth = mx.sort(logits, axis=-1)[..., -32]
    assert mx.all(mx.take_along_axis(logits, soft.ids, axis=-1) >= kth[..., None]).item()


def test_mix_is_the_weighted_sum_and_kl_decreases_on_a_tiny_fixture():
    target = mx.random.normal((2, 3, 4, 50), key=mx.random.key(2))
    labels = mx.argmax(target, axis=-1)
    spec = LossSpec("mix", (0.7, 1.0), kl_weight=0.25, top_k=8)
    soft = top_k_soft(target, spec.temperatures, spec.top_k)
    x = mx.zeros((2, 3, 4, 50))
    ce = mx.mean(position_loss(x, labels, None, LossSpec("ce"))).item()
    kl = mx.mean(soft_kl(x, soft, spec)).item()
    mix = mx.mean(position_loss(x, labels, soft, spec)).item()
    assert abs(mix - (0.75 * ce + 0.25 * kl)) < 1e-5
    with pytest.raises(ValueError, match="soft labels"):
        position_loss(x, labels, None, spec)

    def f(z):
        return mx.mean(soft_kl(z, soft, LossSpec("kl", (0.7, 1.0), top_k=8)))

    grad = mx.value_and_grad(f)
    first = None
    for _ in range(60):
        v, g = grad(x)
        first = first if first is not None else v.item()
        x = x - 2.0 * g * x.size / 50
    assert f(x).item() < 0.2 * first


def test_selector_soft_loss_counts_only_candidate_mass():
    ids = mx.array([[[[1, 2, 3, 4]]]])  # soft top-4 of p_T
    probs = mx.array([[[[[0.5, 0.3, 0.1, 0.05]]]]])
    soft = SoftLabels(ids, probs, 1.0 - probs.sum(axis=-1))
    cand = mx.array([[[[2, 1, 7]]]])  # token 7 is outside the soft labels: p 0
    scores = mx.array([[[[0.0, 1.0, -1.0]]]])
    loss, covered = selector_soft_loss(scores, cand, soft, LossSpec("kl", (1.0,), top_k=4))
    lq = np.log(_softmax(np.array([0.0, 1.0, -1.0])))
    assert abs(loss.item() - -(0.3 * lq[0] + 0.5 * lq[1])) < 1e-5
    assert abs(covered.item() - 0.8) < 1e-6


def test_dflash2_walk_q_is_the_trained_q(tiny_pair):
    """The walk's sampled proposal q (what verification uses) == `selector_q` (what the
    distillation loss trains) for the walk's own predecessors."""
    cfg = d2_config(tiny_pair.target_config, 259, layers=1, block_size=6, layer_ids=[0, 2])
    drafter = randomize(DFlash2DraftModel(DraftConfig.from_dict(cfg)), 3)
    drafter.bind(target_head(tiny_pair.target))
    feats = mx.random.normal((1, 9, 2 * cfg["hidden_size"]), key=mx.random.key(4))
    cache = drafter.make_cache()
    drafter.extend_context(feats, cache)
    block = mx.array([17, 259, 259, 259, 259, 259])
    T = 0.8
    drafts, q = drafter.propose(block, cache, SamplingParams(temperature=T), mx.random.key(5))
    hidden = drafter.hidden(block[None], cache)[:, 1:]
    logits = drafter.logits(hidden)
    preds = mx.concatenate([block[:1], drafts[:-1].astype(mx.int32)])[None]
    _, cand, q_train = selector_q(drafter.candidate_selector, hidden, logits, preds, T)
    dense = scatter_candidates(cand[0], q_train[0], logits.shape[-1])
    assert np.allclose(np.array(q), np.array(dense), atol=1e-5)
    assert np.allclose(np.array(q.sum(axis=-1)), 1.0, atol=1e-5)
    assert mx.all(q[mx.arange(5), drafts] > 0).item()  # every draft has mass under its q


def test_bad_loss_settings_are_one_sentence(tmp_path):
    for kw, msg in (
        ({"loss": "l2"}, "--loss must be one of ce, kl, mix"),
        ({"kl_temperatures": [0.0]}, "--kl-temperature must be positive"),
        ({"kl_weight": 1.5}, "--kl-weight must be in"),
        ({"top_k_soft": 0}, "--top-k-soft must be at least 1"),
    ):
        with pytest.raises(TrainError, match=msg):
            TrainingArgs("t", tmp_path / "p.jsonl", tmp_path / "o", **kw).check()


@pytest.mark.slow
def test_kl_trained_drafters_roundtrip_through_the_loader(tiny_dirs, prompts_file, tmp_path):  # noqa: F811
    for arch in ("dflash", "dflash2"):
        out = tmp_path / arch
        losses, summary = _train(
            tiny_dirs,
            prompts_file,
            out,
            tmp_path / f"c-{arch}",
            arch=arch,
            steps=24,
            loss="mix",
            kl_temperatures=[0.7, 1.0],
            kl_weight=0.6,
            top_k_soft=16,
            temps=[0.0, 0.7],
            eval_prompts=prompts_file,
            eval_limit=2,
            eval_max_tokens=12,
        )
        assert np.mean(losses[-4:]) < losses[0] - 0.3, arch
        cfg = json.loads((out / "config.json").read_text())
        want = {
            "loss": "mix",
            "kl_temperatures": [0.7, 1.0],
            "kl_weight": 0.6,
            "top_k_soft": 16,
            "data_temperatures": [0.0, 0.7],
        }
        assert cfg["dflash_training"] == want
        assert summary["loss"] == want
        assert json.loads((out / "dflash_training.json").read_text())["loss"] == want
        assert summary["sequences"] == 16  # 8 prompts, answered greedy and sampled
        pair = load(tiny_dirs[0], out)
        assert pair.kind == ("DFlash 2" if arch == "dflash2" else "DFlash")
        assert all(e["identical"] == e["prompts"] for e in summary["eval"])
        # fine-tuning starts from the saved folder (DFlash 2: codebooks stored without .weight)
        more, _ = _train(
            tiny_dirs,
            prompts_file,
            tmp_path / f"ft-{arch}",
            tmp_path / f"c-{arch}",
            arch=arch,
            steps=2,
            loss="mix",
            kl_temperatures=[0.7, 1.0],
            kl_weight=0.6,
            top_k_soft=16,
            temps=[0.0, 0.7],
            init_from=out,
        )
        assert more[0] < losses[0] - 0.3, arch


def test_evaluate_tau_by_length_and_tv_agreement(tiny_pair):
    from dflash_mac.train.evaluate import tau_by_length, tv_agreement

    got = tau_by_length([[1] * 10, [1] * 300, [1] * 20, [1] * 1500], [2.0, 1.0, 4.0, 1.5])
    assert got == {
        "0-256": {"prompts": 2, "tau": 3.0},
        "256-1024": {"prompts": 1, "tau": 1.0},
        "1024-2048": {"prompts": 1, "tau": 1.5},
    }
    bs = tiny_pair.block_size
    prompt, resp = list(range(40, 50)), list(range(60, 60 + bs))  # one anchor: a = len(prompt)
    tv = tv_agreement(tiny_pair, [(prompt, resp)], [0.7, 1.0], anchors=8)
    # by hand, with the inference drafter and a plain target forward
    toks = mx.array(prompt + resp)[None]
    feats = target_features(tiny_pair.target, tiny_pair.layer_ids, toks)
    a = len(prompt)
    cache = tiny_pair.drafter.make_cache()
    tiny_pair.drafter.extend_context(feats[:, :a], cache)
    mask = tiny_pair.drafter.config.mask_token_id
    block = mx.array([(prompt + resp)[a]] + [mask] * (bs - 1))
    q_logits = tiny_pair.drafter(block[None], cache)[0]
    p_logits = tiny_pair.target(toks)[0, a : a + bs - 1]
    for t in (0.7, 1.0):
        p, q = mx.softmax(p_logits / t, axis=-1), mx.softmax(q_logits / t, axis=-1)
        want = np.array(mx.minimum(p, q).sum(axis=-1))
        assert np.allclose(tv[t], want, atol=2e-4), (t, tv[t], want)


def test_training_note_reads_the_config_field(tmp_path):
    from dflash_mac.models.config import training_note

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    assert training_note(tmp_path) is None
    meta = {"loss": "mix", "kl_temperatures": [0.7, 1.0], "data_temperatures": [0.0, 0.7]}
    (tmp_path / "config.json").write_text(json.dumps({"dflash_training": meta}))
    assert training_note(tmp_path) == "loss mix (KL at T 0.7, 1), data T 0, 0.7"
