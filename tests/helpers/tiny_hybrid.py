"""Tiny random hybrid (GatedDeltaNet + attention) targets with a matching DFlash drafter."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map

from helpers.tiny import draft_config, save_model, write_byte_tokenizer


def hybrid_text_config(
    vocab: int = 320,
    hidden: int = 64,
    layers: int = 6,
    interval: int = 3,
    model_type: str = "qwen3_5",
    **kw,
) -> dict:
    """The text config keys mlx-lm's qwen3_5 / qwen3_next need (linear attention included)."""
    cfg = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": hidden // 4,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": interval,
        "tie_word_embeddings": True,
    }
    if model_type == "qwen3_next":  # a small MoE, as the real qwen3_next
        cfg.update(
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
        )
    else:
        cfg["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        }
    cfg.update(kw)
    return cfg


def build_hybrid_target(tcfg: dict, weight_scale: float = 4.0):
    """A random mlx-lm hybrid model for `tcfg` (2-D weights scaled for varied text)."""
    from mlx_lm.utils import load_model  # noqa: F401  (imports the model registry)

    if tcfg["model_type"] == "qwen3_next":
        from mlx_lm.models import qwen3_next as arch
    else:
        from mlx_lm.models import qwen3_5 as arch
    model = arch.Model(arch.ModelArgs.from_dict(tcfg))
    model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def build_tiny_hybrid_pair(
    out: str | Path,
    seed: int = 0,
    target_layers: int = 6,
    model_type: str = "qwen3_5",
    draft_layers: int = 1,
    block_size: int = 16,
    weight_scale: float = 4.0,
    layer_ids: list[int] | None = None,
    **text_kw,
) -> tuple[Path, Path]:
    """Write a random qwen3_5 (or qwen3_next) target with tokenizer, and a random drafter.

    qwen3_5 is written the way the Hub ships it: `text_config` nested in the config."""
    from dflash_mac.models.config import DraftConfig
    from dflash_mac.models.dflash import DFlashDraftModel

    out = Path(out)
    tdir, ddir = out / "target", out / "draft"
    ids = write_byte_tokenizer(tdir)
    text = hybrid_text_config(layers=target_layers, model_type=model_type, **text_kw)
    text["eos_token_id"] = ids["<|im_end|>"]
    if model_type == "qwen3_5":
        tcfg = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": True,
            "eos_token_id": ids["<|im_end|>"],
            "text_config": text,
        }
    else:
        tcfg = dict(text, architectures=["Qwen3NextForCausalLM"])
    mx.random.seed(seed)
    target = build_hybrid_target(tcfg, weight_scale)
    save_model(target, tdir, tcfg)
    flat = dict(text, rope_theta=10000.0)
    n = target_layers
    dcfg = draft_config(
        flat,
        ids["<|mask|>"],
        layers=draft_layers,
        block_size=block_size,
        layer_ids=layer_ids or sorted({1, n // 2, n - 2}),
    )
    drafter = DFlashDraftModel(DraftConfig.from_dict(dcfg))
    save_model(drafter, ddir, dcfg)
    return tdir, ddir
