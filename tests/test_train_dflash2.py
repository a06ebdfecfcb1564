"""DFlash 2 training: the conv forward equals inference, the selector loss, `--arch dflash2`."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash2 import DFlash2DraftModel
from test_dflash2 import d2_config, randomize
from test_train import _train, prompts_file  # noqa: F401  (fixture)

from dflash_mac.loading.loader import load
from dflash_mac.target.structure import target_head
from dflash_mac.train.batches import target_features
from dflash_mac.train.blocks import block_inputs, position_weights
from dflash_mac.train.dflash2_loss import selector_loss, train_hidden2
from dflash_mac.train.forward import layer_masks


def test_training_forward_equals_inference(tiny_pair):
    """Blocks of the DFlash 2 training pass == `drafter.hidden(block, cache)` (convs per block)."""
    cfg = d2_config(tiny_pair.target_config, 259, layers=2, block_size=6, layer_ids=[0, 2])
    drafter = randomize(DFlash2DraftModel(DraftConfig.from_dict(cfg)), 6)
    drafter.bind(target_head(tiny_pair.target))
    tokens = mx.array([list(range(40, 70)), list(range(90, 120))])
    feats = target_features(tiny_pair.target, [0, 2], tokens)
    anchors = np.array([[4, 11, 17, 24], [9, 3, 20, 20]])
    ids = np.stack([block_inputs(np.array(t), a, 6, 259)[0] for t, a in zip(tokens, anchors)])
    masks = layer_masks(drafter, anchors, tokens.shape[1], 6)
    hidden = train_hidden2(drafter, feats, mx.array(ids), mx.array(anchors.astype(np.int32)), masks)
    for (b, n), a in np.ndenumerate(anchors):
        cache = drafter.make_cache()
        drafter.extend_context(feats[b : b + 1, :a], cache)
        ref = drafter.hidden(mx.array(ids[b, n])[None], cache)[0]
        assert np.allclose(np.array(hidden[b, n]), np.array(ref), atol=1e-4), (b, a)


def test_selector_loss_teacher_forced():
    """CE over the k candidate scores at the true token; labels outside the top-k are skipped."""
    cfg = d2_config(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": 12,
            "max_position_embeddings": 64,
            "rope_theta": 1e4,
            "num_hidden_layers": 4,
        },
        11,
        group=8,
        rank=4,
        top_k=3,
    )
    sel = randomize(DFlash2DraftModel(DraftConfig.from_dict(cfg)), 7).candidate_selector
    mx.random.seed(8)
    hidden, logits = mx.random.normal((1, 1, 3, 32)), mx.random.normal((1, 1, 3, 12)) * 3
    order = np.argsort(-np.array(logits[0, 0]), axis=-1)
    labels = np.array([order[0, 1], order[1, 5], order[2, 0]])  # 2nd, not in top-3, 1st
    preds = np.array([4, labels[0], labels[1]])
    w = mx.array(position_weights(4))
    loss, acc = selector_loss(
        sel,
        hidden,
        logits,
        mx.array(preds[None, None]),
        mx.array(labels[None, None]),
        mx.ones((1, 1)),
        w,
    )
    g, lg = np.array(sel.hidden_projection(hidden)[0, 0]), np.array(logits[0, 0])
    PC = np.array(sel.predecessor_codebook.weight)
    SC = np.array(sel.successor_codebook.weight)
    want, wsum = 0.0, 0.0
    for t in (0, 2):
        top = order[t, :3]
        s = np.array([lg[t, c] + (PC[preds[t]] * g[t] * SC[c]).sum() for c in top])
        ce = np.log(np.exp(s - s.max()).sum()) + s.max() - s[list(top).index(labels[t])]
        want, wsum = want + float(w[t]) * ce, wsum + float(w[t])
    assert abs(loss.item() - want / wsum) < 1e-4
    assert acc[1].item() == 0


@pytest.mark.slow
def test_train_dflash2_command(tiny_dirs, prompts_file, tmp_path):  # noqa: F811
    losses, summary = _train(
        tiny_dirs,
        prompts_file,
        tmp_path / "out",
        tmp_path / "c",
        arch="dflash2",
        steps=30,
        eval_prompts=prompts_file,
        eval_limit=2,
        eval_max_tokens=12,
    )
    assert np.mean(losses[-5:]) < losses[0] - 0.5
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["conv_kernel_size"] == 2
    saved = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in saved  # the real checkpoints' key names
    assert "layers.0.mlp_conv.base_kernel" in saved
    pair = load(tiny_dirs[0], tmp_path / "out")
    assert pair.kind == "DFlash 2"
    assert not mx.array_equal(saved["candidate_selector.successor_codebook"], 0).item()
    assert all(e["identical"] == e["prompts"] for e in summary["eval"])
