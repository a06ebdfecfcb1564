"""Real-size model shapes with random weights for `bench --cost-curve --shape NAME`: what block
sizes pay on this machine for a model you have not downloaded. Timing needs shapes, not
trained weights; no tokenizer, no download."""

from __future__ import annotations

from dataclasses import dataclass

from .inputs import BenchError


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_layers: int = 5  # z-lab's b16 drafters for these targets have 5 layers
    block_size: int = 16


SHAPES = {
    "qwen3-4b": Shape(2560, 36, 9728, 32, 8, 128, 151936),
    "qwen3-8b": Shape(4096, 36, 12288, 32, 8, 128, 151936),
    "tiny": Shape(64, 4, 128, 4, 2, 16, 320, draft_layers=1, block_size=8),  # for tests
}
DTYPES = ("bf16", "4bit")


def check_shape(name: str) -> None:
    if name not in SHAPES:
        raise BenchError(f"--shape must be one of {', '.join(SHAPES)} (got {name!r}).")


def random_pair(name: str, dtype: str = "bf16"):
    """A LoadedPair of shape `name` with random weights (bf16, or 4-bit with group 64)."""
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.models import qwen3

    from dflash_mac.loading.loader import LoadedPair, materialize
    from dflash_mac.loading.random_pair import draft_config, target_config
    from dflash_mac.models.config import DraftConfig
    from dflash_mac.models.dflash import DFlashDraftModel
    from dflash_mac.target.structure import target_head

    check_shape(name)
    if dtype not in DTYPES:
        raise BenchError(f"--shape-dtype must be one of {', '.join(DTYPES)} (got {dtype!r}).")
    s = SHAPES[name]
    tcfg = target_config(
        s.vocab,
        s.hidden,
        s.layers,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        tie_word_embeddings=False,
    )
    step = max(1, (s.layers - 2) // (s.draft_layers - 1)) if s.draft_layers > 1 else 1
    layer_ids = [min(1 + i * step, s.layers - 1) for i in range(s.draft_layers)]
    dcfg = draft_config(tcfg, s.vocab - 1, s.draft_layers, s.block_size, sorted(set(layer_ids)))
    target = qwen3.Model(qwen3.ModelArgs.from_dict(tcfg))
    drafter = DFlashDraftModel(DraftConfig.from_dict(dcfg))
    for model in (target, drafter):  # cast while still lazy: no fp32 copy of the whole model
        model.set_dtype(mx.bfloat16)
    if dtype == "4bit":
        nn.quantize(target, group_size=64, bits=4)
        tcfg["quantization"] = {"group_size": 64, "bits": 4}
    drafter.bind(target_head(target))
    materialize(target, drafter)
    return LoadedPair(
        target, drafter, None, f"shape/{name}-{dtype}", f"shape/{name}-dflash", s.block_size, tcfg
    )
