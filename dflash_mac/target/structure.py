"""Where things are in an mlx-lm target: its decoder layers, its text model, its embedding and
LM head. A leaf: loading, capture and rollback all read the target through it."""

from __future__ import annotations

from mlx import nn

from ..models.dflash import TargetHead


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The target's decoder layers (on qwen3_5 `model.layers` is a fresh list of the same
    module objects, which is all we need)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if not layers:
        raise ValueError("the target model exposes no decoder layers (`model.layers`).")
    return list(layers)


def text_model(model: nn.Module) -> nn.Module:
    """The language-model part of a (possibly multimodal) mlx-lm model."""
    return getattr(model, "language_model", model)


def target_head(model: nn.Module) -> TargetHead:
    """The target's token embedding and LM head, with its logit scale / softcap if any."""
    tm = text_model(model)
    inner = tm.model
    embed = inner.embed_tokens
    args = getattr(tm, "args", None)
    lm_head = getattr(tm, "lm_head", None)
    if lm_head is None or getattr(args, "tie_word_embeddings", False):
        lm_head = embed.as_linear
    scale = getattr(args, "logits_scaling", None) or 1.0
    softcap = getattr(args, "final_logit_softcapping", None)
    return TargetHead(embed, lm_head, 1.0 / scale if scale != 1.0 else 1.0, softcap)
