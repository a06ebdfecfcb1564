"""DFlash 1 block-diffusion drafter (docs/design.md §4), bound to the target's embedding and
LM head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu
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
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


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


def head_rows(lm_head: Callable, ids: mx.array) -> Callable[[mx.array], mx.array]:
    """`lm_head` restricted to the vocabulary rows `ids`: ``x -> x @ W[ids].T`` (a Linear, an
    Embedding's `as_linear`, or their quantized forms; the rows are gathered once)."""
    owner = getattr(lm_head, "__self__", lm_head)  # embed.as_linear -> the embedding
    if not hasattr(owner, "weight"):
        raise ValueError("a draft vocabulary needs an LM head with a weight matrix.")
    w = owner["weight"][ids]
    bias = owner.get("bias") if isinstance(owner, nn.Module) else None
    if "scales" in owner:
        scales, biases = owner["scales"][ids], owner.get("biases")
        biases = None if biases is None else biases[ids]
        group, bits, mode = owner.group_size, owner.bits, getattr(owner, "mode", "affine")
        mx.eval(w, scales, *([] if biases is None else [biases]))

        def quantized(x: mx.array) -> mx.array:
            return mx.quantized_matmul(
                x, w, scales, biases, transpose=True, group_size=group, bits=bits, mode=mode
            )

        return quantized
    bias = None if bias is None else bias[ids]
    mx.eval(w, *([] if bias is None else [bias]))
    return (lambda x: x @ w.T) if bias is None else (lambda x: x @ w.T + bias)


class TargetHead:
    """The target's embedding and LM head (not parameters of the drafter)."""

    def __init__(self, embed: Callable, lm_head: Callable, logit_scale=1.0, softcap=None):
        self.embed, self.lm_head = embed, lm_head
        self.logit_scale, self.softcap = logit_scale, softcap

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits from final-normed hidden states, the logit scale and softcap applied."""
        out = self.lm_head(hidden)
        if self.logit_scale != 1.0:
            out = out * self.logit_scale
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def restricted(self, ids: mx.array) -> TargetHead:
        """The same head over the vocabulary rows `ids` only: logits ``[..., len(ids)]``."""
        return TargetHead(self.embed, head_rows(self.lm_head, ids), self.logit_scale, self.softcap)


class ContextCache:
    """The drafter's context K/V of one layer, bounded: it keeps the first `sink` positions and
    the last `window` ones (None: everything). `offset` is the absolute position reached, so
    RoPE and masks see true positions after older rows are dropped."""

    def __init__(self, sink: int = 0, window: int | None = None):
        self.sink, self.window = sink, window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        if self.window is not None and self.rows > self.sink + self.window:
            s, w = self.sink, self.window
            self.keys = mx.concatenate([self.keys[:, :, :s], self.keys[:, :, -w:]], axis=2)
            self.values = mx.concatenate([self.values[:, :, :s], self.values[:, :, -w:]], axis=2)
        return self.keys, self.values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def positions(self) -> mx.array | None:
        """Absolute positions of the kept rows (None when nothing was dropped)."""
        if self.rows == self.offset:
            return None
        sink = min(self.sink, self.rows)
        tail = self.rows - sink
        return mx.concatenate([mx.arange(sink), mx.arange(self.offset - tail, self.offset)])

    def trim(self, n: int) -> int:
        """Drop the last `n` positions (at most the rows after the sink that are kept)."""
        dropped = self.rows < self.offset  # then only rows after the sink can go
        n = min(n, self.rows - (min(self.sink, self.rows) if dropped else 0))
        if n > 0:
            self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]
            self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def independent_expansion(logits: mx.array, k: int) -> Callable:
    """`expand(t, parents [M])` for a draft tree (dflash_mac/drafting/tree.py) from per-position
    logits `[P, V]`: position t's top k tokens by log q, whatever the parent, as (tokens [M, k],
    log q [M, k])."""
    logits = logits.astype(mx.float32)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    k = min(k, logq.shape[-1])
    cand = mx.argpartition(-logq, kth=k - 1, axis=-1)[:, :k]  # [P, k]
    vals = mx.take_along_axis(logq, cand, axis=-1)

    def expand(t: int, parents: mx.array) -> tuple[mx.array, mx.array]:
        shape = (parents.shape[0], k)
        return mx.broadcast_to(cand[t], shape), mx.broadcast_to(vals[t], shape)

    return expand


def block_mask(
    n_ctx: int,
    start: int,
    L: int,
    causal: bool,
    window: int | None,
    ctx_pos: mx.array | None = None,
) -> mx.array | None:
    """Boolean [L, n_ctx + L] mask for block queries at start..start+L-1 (None = all visible).
    `ctx_pos`: absolute positions of the context rows (default: the n_ctx before `start`)."""
    if not causal and window is None:
        return None
    if ctx_pos is None:
        ctx_pos = mx.arange(start - n_ctx, start)
    q_pos = mx.arange(start, start + L)[:, None]
    k_pos = mx.concatenate([ctx_pos, mx.arange(start, start + L)])[None]
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
        self.draft_head: TargetHead | None = None  # the head over `draft_vocab`'s rows
        if cfg.draft_vocab_size:
            # target ids the drafter drafts over (the checkpoint's tensor replaces these);
            # frozen: a lookup table, not a weight
            self.draft_vocab = mx.arange(cfg.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)

    # -- binding and cache ------------------------------------------------------------
    def bind(self, head: TargetHead) -> None:
        """Share the target's embedding / LM head; inherit its logit scale and softcap."""
        cfg = self.config
        if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping:
            head = TargetHead(
                head.embed, head.lm_head, cfg.output_multiplier, cfg.final_logit_softcapping
            )
        self.head = head
        vocab = self.get("draft_vocab")
        self.draft_head = None if vocab is None else head.restricted(vocab)

    def set_draft_vocab(self, ids: mx.array) -> None:
        """Draft over these target ids from now on (FR-Spec: a trained drafter's head cut to
        the rows of a frequency-ranked subset); re-binds the head's rows when one is bound."""
        k = int(ids.shape[0])
        if ids.ndim != 1 or not 1 <= k <= self.config.vocab_size:
            raise ValueError(f"a draft vocabulary is 1 to {self.config.vocab_size} ids.")
        cfg = self.config
        cfg.draft_vocab_size = k
        if "dflash_config" in cfg.raw:  # what a saved config.json says
            cfg.raw = dict(
                cfg.raw, dflash_config=dict(cfg.raw["dflash_config"], draft_vocab_size=k)
            )
        self.draft_vocab = ids.astype(mx.int32)
        self.freeze(keys=["draft_vocab"], recurse=False)
        if self.head is not None:
            self.bind(self.head)

    # Bound of the context cache when the drafter has full-attention layers (instance
    # attributes override; context_window None = unbounded). Sliding-window drafters keep
    # their largest window instead (docs/architecture.md).
    context_sink = 64
    context_window: int | None = 1024

    def context_bound(self) -> tuple[int, int | None]:
        """(sink, window) of the context cache."""
        windows = self.config.layer_window
        if windows and all(w is not None for w in windows):
            return 0, max(windows)
        return self.context_sink, self.context_window

    def make_cache(self) -> list[ContextCache]:
        """Context-only K/V per layer, bounded (`context_bound`); block K/V are never stored."""
        sink, window = self.context_bound()
        return [ContextCache(sink, window) for _ in self.layers]

    # -- forward ---------------------------------------------------------------------
    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))  # [B, n, H]

    def extend_context(self, features: mx.array, cache: list[ContextCache]) -> None:
        """Append committed target features (absolute positions continue the cache)."""
        ctx = self.project_context(features)
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(ctx, c.offset)
            c.update_and_fetch(k, v)

    def hidden(self, block_ids: mx.array, cache: list[ContextCache]) -> mx.array:
        """Final-normed hidden states of the block, [B, bs, H]."""
        B, L = block_ids.shape
        start = cache[0].offset
        h = self.head.embed(block_ids) * self.config.input_embedding_scale
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            ctx_k, ctx_v = c.keys_and_values()
            pos = c.positions() if isinstance(c, ContextCache) else None
            n_ctx = start if pos is None else pos.shape[0]
            mask = block_mask(
                n_ctx, start, L, self.config.layer_causal[i], self.config.layer_window[i], pos
            )
            h = layer(h, ctx_k, ctx_v, start, mask)
        return self.norm(h)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary ``[..., K]`` (the whole vocabulary without one)."""
        return (self.draft_head or self.head).logits(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits over the target's vocabulary ``[..., V]``; with a draft vocabulary only its
        rows are computed and every other id is -inf (q is 0 there: verification's residual
        keeps the output exact)."""
        if self.draft_head is None:
            return self.head.logits(hidden)
        return self.full_vocab(self.draft_head.logits(hidden))

    def full_vocab(self, sub: mx.array) -> mx.array:
        """Draft-vocabulary logits ``[..., K]`` laid onto the target's ids ``[..., V]``."""
        full = mx.full((*sub.shape[:-1], self.config.vocab_size), -mx.inf, dtype=sub.dtype)
        ids = mx.broadcast_to(self.draft_vocab, sub.shape)
        return mx.put_along_axis(full, ids, sub, axis=-1)

    def __call__(self, block_ids: mx.array, cache: list[ContextCache]) -> mx.array:
        """Logits for block positions 1..bs-1 (the anchor proposes nothing): [B, bs-1, V]."""
        return self.logits(self.hidden(block_ids, cache)[:, 1:])

    def expansion(self, block_ids: mx.array, cache: list[ContextCache], k: int) -> Callable:
        """A draft tree's candidates from one pass over `block_ids [bs]`
        (`independent_expansion`: positions are drafted independently)."""
        return independent_expansion(self(block_ids[None], cache)[0], k)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights
