"""DFlash 1 block-diffusion drafter (docs/design.md §4), bound to the target's embedding and
LM head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .config import DraftConfig


class DraftAttention(nn.Module):
    """Block queries attend to [context K/V | block K/V] built with the SAME k/v projections."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def keys_values(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        """K/V rows for `x` at absolute positions starting at `offset`."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v  # [B, Hkv, L, hd] each

    def __call__(
        self,
        x: mx.array,
        ctx_k: mx.array,
        ctx_v: mx.array,
        offset: Any,
        mask: mx.array | None = None,
    ) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)
        k, v = self.keys_values(x, offset)
        keys = mx.concatenate([ctx_k, k], axis=2)  # [B, Hkv, n_ctx + L, hd]
        values = mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, h, ctx_k, ctx_v, offset, mask=None) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), ctx_k, ctx_v, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetHead:
    """The target's embedding and LM head (not parameters of the drafter)."""

    def __init__(self, embed: Callable, lm_head: Callable, logit_scale=1.0, softcap=None):
        self.embed, self.lm_head = embed, lm_head
        self.logit_scale, self.softcap = logit_scale, softcap


def block_mask(n_ctx: int, start: int, L: int, causal: bool, window: int | None) -> mx.array | None:
    """Boolean [L, n_ctx + L] mask for block queries at start..start+L-1 (None = all visible)."""
    if not causal and window is None:
        return None
    q_pos = mx.arange(start, start + L)[:, None]
    k_pos = mx.concatenate([mx.arange(start - n_ctx, start), mx.arange(start, start + L)])[None]
    mask = mx.ones((L, n_ctx + L), dtype=mx.bool_)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


class DFlashDraftModel(nn.Module):
    """Block-diffusion drafter: one pass fills `[anchor, MASK...]` from target features."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.head: TargetHead | None = None

    # -- binding and cache ------------------------------------------------------------
    def bind(self, head: TargetHead) -> None:
        """Share the target's embedding / LM head; inherit its logit scale and softcap."""
        cfg = self.config
        if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping:
            head = TargetHead(
                head.embed, head.lm_head, cfg.output_multiplier, cfg.final_logit_softcapping
            )
        self.head = head

    def make_cache(self) -> list[KVCache]:
        """Context-only K/V per layer; block K/V are never stored."""
        return [KVCache() for _ in self.layers]

    # -- forward ---------------------------------------------------------------------
    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))  # [B, n, H]

    def extend_context(self, features: mx.array, cache: list[KVCache]) -> None:
        """Append committed target features (absolute positions continue the cache)."""
        ctx = self.project_context(features)
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(ctx, c.offset)
            c.update_and_fetch(k, v)

    def hidden(self, block_ids: mx.array, cache: list[KVCache]) -> mx.array:
        """Final-normed hidden states of the block, [B, bs, H]."""
        B, L = block_ids.shape
        start = cache[0].offset
        h = self.head.embed(block_ids) * self.config.input_embedding_scale
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            ctx_k, ctx_v = c.keys_and_values()
            mask = block_mask(
                start, start, L, self.config.layer_causal[i], self.config.layer_window[i]
            )
            h = layer(h, ctx_k, ctx_v, start, mask)
        return self.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        head = self.head
        out = head.lm_head(hidden)
        if head.logit_scale != 1.0:
            out = out * head.logit_scale
        if head.softcap:
            out = mx.tanh(out / head.softcap) * head.softcap
        return out

    def __call__(self, block_ids: mx.array, cache: list[KVCache]) -> mx.array:
        """Logits for block positions 1..bs-1 (the anchor proposes nothing): [B, bs-1, V]."""
        return self.logits(self.hidden(block_ids, cache)[:, 1:])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights
