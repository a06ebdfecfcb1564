"""Drafter config parsing: both schema generations, the attention rule, required fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dflash_mac.models.config import ConfigError, DraftConfig

REF = Path(__file__).resolve().parent / "data" / "reference"
QWEN3_FIELDS = {
    "hidden_size": 2560,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}


def old_schema() -> dict:
    """DFlash 1 field layout: block_size and rope_theta at top level."""
    cfg = json.loads((REF / "dflash1-qwen3-4b-b16-config.json").read_text())
    cfg.pop("_note", None)
    return {**cfg, **QWEN3_FIELDS, "rope_theta": 1000000.0}


def new_schema() -> dict:
    return {
        **QWEN3_FIELDS,
        "architectures": ["DFlashDraftModel"],
        "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"},
        "dflash_config": {"block_size": 10, "mask_token_id": 7, "target_layer_ids": [1, 2]},
    }


def test_old_schema():
    c = DraftConfig.from_dict(old_schema())
    assert c.block_size == 16
    assert c.rope_theta == 1e6
    assert c.target_layer_ids == [1, 9, 17, 25, 33]
    assert c.mask_token_id == 151669
    assert c.num_target_layers == 36
    assert c.layer_causal == [False] and c.layer_window == [None]
    assert not c.is_dflash2


def test_new_schema_nested_fields():
    c = DraftConfig.from_dict(new_schema())
    assert c.block_size == 10
    assert c.rope_theta == 5e6
    assert c.rope_scaling is None
    assert c.input_embedding_scale == 1.0 and c.output_multiplier == 1.0
    assert c.final_logit_softcapping is None


def test_block_size_defaults_to_16():
    cfg = new_schema()
    del cfg["dflash_config"]["block_size"]
    assert DraftConfig.from_dict(cfg).block_size == 16


def test_rope_scaling_from_rope_parameters():
    cfg = new_schema()
    cfg["rope_parameters"] = {
        "rope_theta": 1e6,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    c = DraftConfig.from_dict(cfg)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 4.0


def test_dflash2_reference_config():
    cfg = json.loads((REF / "dflash2-muse-config.json").read_text())
    c = DraftConfig.from_dict(cfg)
    assert c.is_dflash2
    assert c.block_size == 16 and c.mask_token_id == 201818
    assert c.target_layer_ids == [1, 13, 25, 37, 49]
    assert c.output_multiplier == pytest.approx(0.19611613513818404)
    assert c.final_logit_softcapping == 20.0
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    # sliding layers would be causal, but the explicit is_causal: false wins
    assert c.layer_causal == [False] * 5
    assert c.layer_window == [2048] * 5
    assert c.rope_theta == 500000.0


@pytest.mark.parametrize(
    "is_causal,expected", [(None, [True, False]), (True, [True, True]), (False, [False, False])]
)
def test_causal_rule(is_causal, expected):
    cfg = {
        **new_schema(),
        "num_hidden_layers": 2,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    c = DraftConfig.from_dict(cfg)
    assert c.layer_causal == expected
    assert c.layer_window == [64, None]


@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
    ],
)
def test_missing_top_level_field(field):
    cfg = new_schema()
    del cfg[field]
    with pytest.raises(ConfigError) as e:
        DraftConfig.from_dict(cfg, source="d/config.json")
    assert str(e.value) == f"d/config.json is missing the required field '{field}'."


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id"])
def test_missing_dflash_field(field):
    cfg = new_schema()
    del cfg["dflash_config"][field]
    with pytest.raises(ConfigError) as e:
        DraftConfig.from_dict(cfg, source="d/config.json")
    assert str(e.value) == f"d/config.json is missing the required field 'dflash_config.{field}'."


def test_missing_dflash_config_and_architecture():
    cfg = new_schema()
    del cfg["dflash_config"]
    with pytest.raises(ConfigError, match="'dflash_config'"):
        DraftConfig.from_dict(cfg)
    cfg = new_schema()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match="not a DFlash drafter"):
        DraftConfig.from_dict(cfg)


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DraftConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DraftConfig.from_file(tmp_path / "config.json")
