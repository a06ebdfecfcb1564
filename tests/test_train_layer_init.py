"""`--layer-init target`: a new drafter's layers start as the target's last decoder layers."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from dflash_mac.target.structure import decoder_layers, text_model
from dflash_mac.train import TrainError, TrainingArgs
from dflash_mac.train.args import TrainSettings
from dflash_mac.train.config import LAYER_WEIGHTS, build_drafter, drafter_config
from dflash_mac.train.config import target_text_config as read_config


def _weight(layer, name):
    for part in name.split("."):
        layer = getattr(layer, part, None)
    return None if layer is None else np.array(layer.weight)


def _drafter(tiny_dirs, tiny_pair, layer_init, layers=2, **kw):
    s = TrainSettings(
        block_size=6, num_layers=layers, target_layer_ids=[1], mask_token_id=259, **kw
    )
    cfg = drafter_config(read_config(tiny_dirs[0]), s)
    mx.random.seed(0)
    return build_drafter(cfg, tiny_pair.target, layer_init)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_target_init_copies_the_last_layers(tiny_dirs, tiny_pair, arch):
    drafter = _drafter(tiny_dirs, tiny_pair, "target", arch=arch)
    random = _drafter(tiny_dirs, tiny_pair, "random", arch=arch)
    source = decoder_layers(text_model(tiny_pair.target))[-2:]
    copied = 0
    for mine, other, theirs in zip(drafter.layers, random.layers, source):
        for name in LAYER_WEIGHTS:
            t = _weight(theirs, name)
            if t is None or _weight(mine, name) is None:
                continue
            assert np.array_equal(_weight(mine, name), t), name
            # the control: MLX's initialisation does not happen to equal the target
            if "norm" not in name:
                assert not np.allclose(_weight(other, name), t), name
            copied += 1
    assert copied >= 2 * 9  # q, k, v, o, gate, up, down and both layer norms, per layer


def test_target_init_refuses_a_shape_it_cannot_copy(tiny_dirs, tiny_pair):
    with pytest.raises(TrainError, match="--intermediate-size"):
        _drafter(tiny_dirs, tiny_pair, "target", intermediate_size=24)
    with pytest.raises(TrainError, match="--layer-init"):
        TrainingArgs(tiny_dirs[0], "p.jsonl", "out", layer_init="middle").check()


def test_a_quantized_target_layer_is_dequantized(tiny_dirs, tiny_pair):
    from dflash_mac.train.config import dense_weight

    lin = nn.Linear(64, 32, bias=False)
    q = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=8)
    w = np.array(dense_weight(q))
    assert w.shape == (32, 64) and np.abs(w - np.array(lin.weight)).max() < 0.02


def test_train_records_the_layer_init(tiny_dirs, prompts_jsonl, tmp_path):
    from dflash_mac.train import train_drafter

    args = TrainingArgs(
        tiny_dirs[0],
        prompts_jsonl,
        tmp_path / "out",
        block_size=6,
        num_layers=1,
        arch="dflash",
        loss="ce",
        steps=2,
        batch_size=2,
        anchors=8,
        max_new_tokens=12,
        cache_dir=tmp_path / "c",
        layer_init="target",
    )
    train_drafter(args)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dflash_training"]["layer_init"] == "target"


@pytest.fixture
def prompts_jsonl(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["def add(a, b):", "import os"]))
    return p
