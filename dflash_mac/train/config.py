"""The target's configuration and the drafter built for it: layers, mask token, config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from dflash_mac.loading import gguf
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from dflash_mac.target.structure import decoder_layers, target_head, text_model

from .args import TrainError, TrainingArgs, TrainSettings
from .dflash2_loss import dflash2_config

MASK_TOKEN = "<|mask|>"


def target_text_config(target_dir: Path) -> dict:
    """The target's text config: its config.json, or a GGUF file's metadata as one."""
    if gguf.is_gguf(target_dir):
        return gguf.read_config(Path(target_dir))
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def default_layer_ids(n_layers: int, count: int | None = None) -> list[int]:
    """Uniform between layer 1 and L-3 (z-lab: [1, 9, 17, 25, 33] of 36)."""
    lo, hi = 1, max(1, n_layers - 3)
    count = count or (5 if n_layers >= 12 else 3)
    count = max(1, min(count, hi - lo + 1))
    if count == 1:
        return [lo]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def resolve_mask_id(tokenizer: Any, mask_token_id: int | None) -> int:
    """The tokenizer's `<|mask|>` id if it has one, else the explicit id, else an error."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if MASK_TOKEN in vocab:
        return int(vocab[MASK_TOKEN])
    if mask_token_id is not None:
        return int(mask_token_id)
    raise TrainError(
        f"the target tokenizer has no '{MASK_TOKEN}' token; pass --mask-token-id "
        "(a token id the target never needs to produce in a draft block)."
    )


def train_settings(args: TrainingArgs, tcfg: dict, tokenizer: Any) -> TrainSettings:
    """The run's settings for this target: feature layers checked, mask id resolved."""
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = (
        list(args.target_layer_ids) if args.target_layer_ids else default_layer_ids(n_layers)
    )
    if bad := [i for i in layer_ids if not 0 <= i < n_layers]:
        raise TrainError(f"target layer ids {bad} are outside the target's {n_layers} layers.")
    return TrainSettings(
        block_size=args.block_size,
        num_layers=args.num_layers,
        target_layer_ids=layer_ids,
        mask_token_id=resolve_mask_id(tokenizer, args.mask_token_id),
        arch=args.arch,
        lr=args.lr,
        batch_size=args.batch_size,
        anchors=args.anchors,
        max_length=args.max_length,
        seed=args.seed,
        intermediate_size=args.intermediate_size,
        sliding_window=args.sliding_window,
        loss=args.loss_spec.describe(),
        draft_vocab=args.draft_vocab,
        layer_init=args.layer_init,
    )


def drafter_config(tcfg: dict, s: TrainSettings) -> dict:
    """z-lab DFlash 1 config.json for a drafter of this target (newer schema + top-level
    `block_size` / `rope_theta` for older readers)."""
    heads = tcfg["num_attention_heads"]
    rope = tcfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", tcfg.get("rope_theta", 1_000_000.0))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": s.intermediate_size or tcfg["intermediate_size"],
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": tcfg.get("num_key_value_heads", heads),
        "head_dim": tcfg.get("head_dim") or tcfg["hidden_size"] // heads,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "vocab_size": tcfg["vocab_size"],
        "max_position_embeddings": tcfg.get("max_position_embeddings", 32768),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": rope.get("rope_type", "default")},
        "num_target_layers": tcfg["num_hidden_layers"],
        "block_size": s.block_size,
        "tie_word_embeddings": False,
        "dtype": "float16",
        "dflash_config": {
            "block_size": s.block_size,
            "mask_token_id": s.mask_token_id,
            "target_layer_ids": list(s.target_layer_ids),
        },
    }
    if tcfg.get("rope_scaling"):
        cfg["rope_scaling"] = tcfg["rope_scaling"]
    # what the drafter was trained for; loaders ignore it, `models` / `doctor` show it
    cfg["dflash_training"] = dict(s.loss)
    if s.layer_init != "random":
        cfg["dflash_training"]["layer_init"] = s.layer_init
    if s.draft_vocab:
        cfg["dflash_config"]["draft_vocab_size"] = min(s.draft_vocab, tcfg["vocab_size"])
    if s.sliding_window:  # windowed drafter attention, bidirectional inside the block
        cfg.update(
            layer_types=["sliding_attention"] * s.num_layers,
            sliding_window=s.sliding_window,
            is_causal=False,
        )
    return dflash2_config(cfg) if s.arch == "dflash2" else cfg


def build_drafter(config: dict, target: nn.Module, layer_init: str = "random") -> DFlashDraftModel:
    """A new drafter bound to the target's head; `layer_init="target"` starts its decoder layers
    as copies of the target's last ones (`copy_target_layers`)."""
    from dflash_mac.loading.loader import (
        build_drafter as build_class,  # DFlash 1 or 2 by `architectures`
    )

    drafter = build_class(DraftConfig.from_dict(config))
    tm = text_model(target)
    final_norm = getattr(getattr(tm, "model", None), "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight = mx.array(final_norm.weight)  # the LM head expects its scale
    if layer_init == "target":
        copy_target_layers(drafter, target)
    drafter.bind(target_head(target))
    return drafter


# a drafter layer's weights and where the target's decoder layer keeps the same matrix
LAYER_WEIGHTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def dense_weight(module: nn.Module) -> mx.array:
    """A linear or norm module's weight as a dense float matrix (quantized ones dequantized)."""
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(
            module.weight, module.scales, module.biases, module.group_size, module.bits
        )
    return module.weight


def copy_target_layers(drafter: DFlashDraftModel, target: nn.Module) -> None:
    """Drafter layer i starts as target layer L - n + i (the layers nearest the LM head, which
    already turn a hidden state into the next token); weights the target lacks (Llama has no
    q/k norms) keep their initialisation. Shapes must match: `TrainError` otherwise."""
    source = decoder_layers(text_model(target))[-len(drafter.layers) :]
    for mine, theirs in zip(drafter.layers, source):
        for name in LAYER_WEIGHTS:
            dst, src = mine, theirs
            for part in name.split("."):
                dst, src = getattr(dst, part, None), getattr(src, part, None)
            if dst is None or src is None:
                continue
            w = dense_weight(src)
            if w.shape != dst.weight.shape:
                raise TrainError(
                    f"--layer-init target: the target's {name} is {tuple(w.shape)} but the "
                    f"drafter's is {tuple(dst.weight.shape)} (drop --intermediate-size)."
                )
            dst.weight = mx.array(w, dtype=dst.weight.dtype)
