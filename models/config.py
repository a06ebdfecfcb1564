"""Drafter configuration: both z-lab schema generations (docs/design.md §2)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DFLASH1 = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"

_REQUIRED_TOP = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "vocab_size",
)


class ConfigError(ValueError):
    """A drafter config that cannot be used; the message is one sentence for the user."""


@dataclass
class DraftConfig:
    """Everything the drafter needs from `config.json`, normalised across schemas."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    layer_causal: list[bool] = field(default_factory=list)
    sliding_window: int | None = None
    layer_window: list[int | None] = field(default_factory=list)
    # DFlash 2 only
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # rows of the target's head the drafter drafts over (a `draft_vocab` tensor of target ids
    # in the weights, most frequent first); None: the whole vocabulary
    draft_vocab_size: int | None = None
    quantization: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DraftConfig:
        """Parse a z-lab drafter config; errors name the file and the field."""

        def need(d: dict, key: str, where: str = "") -> Any:
            if key not in d or d[key] is None:
                raise ConfigError(f"{source} is missing the required field '{where}{key}'.")
            return d[key]

        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in (DFLASH1, DFLASH2)), None)
        if arch is None:
            raise ConfigError(
                f"{source} is not a DFlash drafter: 'architectures' must contain "
                f"{DFLASH1} or {DFLASH2} (found {archs or 'nothing'})."
            )
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict):
            raise ConfigError(f"{source} is missing the required field 'dflash_config'.")
        top = {k: need(cfg, k) for k in _REQUIRED_TOP}
        heads = int(top["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(top["hidden_size"]) // heads

        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)

        n_layers = int(top["num_hidden_layers"])
        causal, windows = _attention_layout(cfg, n_layers, source)
        block_size = dcfg.get("block_size", cfg.get("block_size", 16))
        return cls(
            architecture=arch,
            head_dim=int(head_dim),
            target_layer_ids=[int(i) for i in need(dcfg, "target_layer_ids", "dflash_config.")],
            mask_token_id=int(need(dcfg, "mask_token_id", "dflash_config.")),
            block_size=int(block_size),
            num_target_layers=cfg.get("num_target_layers"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            input_embedding_scale=float(dcfg.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dcfg.get("output_multiplier", 1.0)),
            final_logit_softcapping=dcfg.get("final_logit_softcapping"),
            layer_causal=causal,
            sliding_window=cfg.get("sliding_window"),
            layer_window=windows,
            conv_kernel_size=int(dcfg.get("conv_kernel_size", 2)),
            conv_group_size=int(dcfg.get("conv_group_size", 16)),
            selector_rank=int(dcfg.get("selector_rank", 256)),
            selector_top_k=int(dcfg.get("selector_top_k", 16)),
            draft_vocab_size=_draft_vocab_size(dcfg, int(top["vocab_size"]), source),
            quantization=cfg.get("quantization"),
            raw=cfg,
            **{k: (int(v) if k != "rms_norm_eps" else float(v)) for k, v in top.items()},
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DraftConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist; a drafter folder needs a config.json.")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).")
        return cls.from_dict(cfg, source=str(path))


def _draft_vocab_size(dcfg: dict, vocab: int, source: str) -> int | None:
    """`dflash_config.draft_vocab_size`, checked against the vocabulary (None when absent)."""
    k = dcfg.get("draft_vocab_size")
    if k is None:
        return None
    if not isinstance(k, int) or not 1 <= k <= vocab:
        raise ConfigError(
            f"{source} has dflash_config.draft_vocab_size {k!r}; it must be an integer "
            f"between 1 and the vocabulary size {vocab}."
        )
    return k


def _attention_layout(cfg: dict, n_layers: int, source: str) -> tuple[list[bool], list[int | None]]:
    """Per-layer (causal, window): explicit `is_causal` wins; sliding layers are causal."""
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if layer_types is not None and len(layer_types) != n_layers:
        raise ConfigError(
            f"{source} has {len(layer_types)} 'layer_types' for {n_layers} hidden layers."
        )
    types = layer_types or ["full_attention"] * n_layers
    is_causal = cfg.get("is_causal")
    causal, windows = [], []
    for t in types:
        sliding = t == "sliding_attention"
        causal.append(bool(is_causal) if is_causal is not None else sliding)
        windows.append(int(window) if sliding and window else None)
    return causal, windows


def training_note(draft_dir: str | Path) -> str | None:
    """What a drafter was trained for, from its config's ``dflash_training`` field (written by
    `dflash-mac train`; loaders ignore it), e.g. ``loss mix (KL at T 0.7, 1.0), data T 0, 0.7``.
    None when the field is absent."""
    try:
        meta = json.loads((Path(draft_dir) / "config.json").read_text()).get("dflash_training")
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "loss" not in meta:
        return None
    note = f"loss {meta['loss']}"
    if meta.get("kl_temperatures"):
        temps = ", ".join(f"{t:g}" for t in meta["kl_temperatures"])
        note += f" (KL at T {temps})"
    if meta.get("data_temperatures"):
        note += ", data T " + ", ".join(f"{t:g}" for t in meta["data_temperatures"])
    return note
