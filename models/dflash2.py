"""DFlash 2 drafter (docs/design.md §5): DFlash 1 plus dynamic causal convs and a candidate
selector.

The context handling, RoPE, attention, MLP and the target-head binding are DFlash 1's
(`dflash.py`); a layer wraps both sublayers in `GroupedDynamicCausalConv`s, and
`CandidateSelector` picks one token per block position among the backbone's top-k with a
low-rank bilinear predecessor/successor score (a sequential walk). Hot spots go through
`dflash_mac.metal_kernels` (Metal on the GPU, exact MLX reference ops elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from dflash_mac.metal_kernels import dynamic_conv, selector_walk
from mlx import nn
from mlx_lm.models.cache import KVCache

from .config import DraftConfig
from .dflash import DFlashDraftModel, DraftAttention, DraftMLP, block_mask
from .distribution import SamplingParams, probabilities, scatter_candidates
from .penalties import PenaltyContext

CODEBOOKS = ("predecessor_codebook", "successor_codebook")
NEG = -1e9  # unary score of candidates the request's filters exclude (finite for the kernels)


class GroupedDynamicCausalConv(nn.Module):
    """Two-sided grouped dynamic causal conv over the block axis (taps stay in the block).

    ``base_kernel [2 (side), K (tap), H]``; ``kernel_projection: H -> 2·K·G`` gives per-position
    group corrections, ``G = H / group_size``. `prepare` (side 0) convolves the sublayer input,
    `finish` (side 1) its output; both use coefficients computed from the normed input."""

    def __init__(self, hidden: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden size {hidden}.")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.base_kernel[:, 0, :] = 1.0  # identity: DFlash 2 starts equal to DFlash 1
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def coefficients(self, h: mx.array) -> mx.array:
        """``[B, L, 2, K, G]`` dynamic coefficients from the normed sublayer input."""
        B, L, _ = h.shape
        return self.kernel_projection(h).reshape(B, L, 2, self.kernel_size, self.groups)

    def prepare(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """(conv of the normed input with side 0, the coefficients for `finish`)."""
        dyn = self.coefficients(h)
        return dynamic_conv(h, self.base_kernel[0], dyn[:, :, 0], self.group_size), dyn

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        """Conv of the sublayer output with side 1 (coefficients from `prepare`)."""
        return dynamic_conv(y, self.base_kernel[1], dyn[:, :, 1], self.group_size)


class DFlash2Layer(nn.Module):
    """Qwen3-style layer with a conv around each sublayer; the residual is never convolved."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(H, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.attention_conv = GroupedDynamicCausalConv(H, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(H, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, h, ctx_k, ctx_v, offset, mask=None) -> mx.array:
        a_in, dyn_a = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(a_in, ctx_k, ctx_v, offset, mask), dyn_a)
        m_in, dyn_m = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m_in), dyn_m)


class CandidateSelector(nn.Module):
    """Low-rank bilinear neighbour scorer over the backbone's top-k candidates.

    ``s_t(a, b) = U_t(b) + <PC(a) ⊙ hidden_projection(h_t), SC(b)>`` for predecessor ``a`` and
    candidate ``b``; the walk starts at the anchor and follows the chosen tokens."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        R, V = cfg.selector_rank, cfg.vocab_size
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, R, bias=False)
        self.predecessor_codebook = nn.Embedding(V, R)
        self.successor_codebook = nn.Embedding(V, R)
        # identity initialisation (docs/design.md §10): the pair term starts at exactly 0
        self.predecessor_codebook.weight = mx.random.normal((V, R)) * 0.02
        self.successor_codebook.weight = mx.zeros((V, R))

    def candidates(
        self, logits: mx.array, vocab: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Top-k ``(unary [..., k], cand [..., k] int32)`` of ``logits [..., V]`` (unordered).
        With `vocab` the logits are over a draft vocabulary ``[..., K]`` and `cand` its target
        ids."""
        unary, idx = self.top(logits)
        return unary, idx if vocab is None else vocab[idx]

    def top(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The top-k of ``logits [..., n]``: ``(values, positions)``, unordered."""
        k = min(self.top_k, logits.shape[-1])
        idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k].astype(mx.int32)
        return mx.take_along_axis(logits, idx, axis=-1), idx

    def scores(self, unary: mx.array, cand: mx.array, g: mx.array, pred: mx.array) -> mx.array:
        """Teacher-forced scores ``[..., k]`` for given predecessors ``pred [...]``."""
        pg = self.predecessor_codebook(pred) * g  # [..., R]
        sc = self.successor_codebook(cand)  # [..., k, R]
        return unary + (sc * pg[..., None, :]).sum(axis=-1)

    def walk(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        temperature: float | None = None,
        uniforms: mx.array | None = None,
        keep: mx.array | None = None,
        vocab: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """The selector walk over ``hidden [B, P, H]``, ``logits [B, P, V]`` from ``anchor [B]``.

        ``keep [B, P, V]`` (optional) marks tokens the request's filters allow; candidates
        outside it are never chosen. With `vocab` (a draft vocabulary's target ids) logits and
        keep are over its rows ``[B, P, K]``. Returns ``(path [B, P], cand [B, P, k] target
        ids, q [B, P, k] | None)``."""
        unary, idx = self.top(logits)
        cand = idx if vocab is None else vocab[idx]
        if keep is not None:
            unary = mx.where(mx.take_along_axis(keep, idx, axis=-1), unary, NEG)
        g = self.hidden_projection(hidden)  # [B, P, R]
        path, _, q = selector_walk(
            unary,
            cand,
            g,
            self.predecessor_codebook.weight,
            self.successor_codebook.weight,
            anchor,
            temperature,
            uniforms,
        )
        return path, cand, q


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2 drafter: DFlash 1 with conv layers and a candidate selector."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.layers = [DFlash2Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(cfg)

    def propose(
        self,
        block: mx.array,
        cache: list[KVCache],
        sp: SamplingParams,
        key: mx.array,
        penalty: PenaltyContext | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Drafts for block positions 1..bs-1 by the selector walk: ``(drafts [bs-1], q)``.

        Greedy: the greedy walk, q None. Sampling: the walk at the request temperature; the
        request's top-k/top-p/min-p, applied to the drafter's own logits, drop candidates (as
        DFlash 1 filters q); q is the walk's distribution scattered onto the vocabulary
        ``[bs-1, V]`` (lossless for any q since drafts are drawn from it, docs/design.md §7).
        With penalties the walk goes one position at a time on penalised logits."""
        hidden = self.hidden(block[None], cache)[:, 1:]  # [1, P, H]
        anchor = block[:1]
        if penalty is not None:  # penalties read the whole vocabulary's logits
            return self.penalised_walk(hidden, self.logits(hidden), anchor, sp, key, penalty)
        path, cand, q = self.draft_walk(hidden, anchor, sp, key)
        if q is None:
            return path[0], None
        return path[0], scatter_candidates(cand[0], q[0], self.config.vocab_size)

    def draft_walk(
        self,
        hidden: mx.array,
        anchor: mx.array,
        sp: SamplingParams,
        key: mx.array,
        logits: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """The walk on the draft vocabulary's logits ``[1, P, K]`` (`logits`, when the caller
        has them; the request's filters applied there): ``(path [1, P], cand [1, P, k] target
        ids, q [1, P, k] | None when greedy)``."""
        logits = self.draft_logits(hidden) if logits is None else logits
        sel, vocab = self.candidate_selector, self.get("draft_vocab")
        if sp.greedy:
            return sel.walk(hidden, logits, anchor, vocab=vocab)
        keep = None
        if sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0:
            keep = probabilities(logits, sp) > 0  # ids outside the draft vocabulary have p 0
        u = mx.random.uniform(shape=(1, hidden.shape[1]), key=key)
        return sel.walk(hidden, logits, anchor, sp.temperature, u, keep, vocab)

    def expansion(self, block_ids: mx.array, cache: list[KVCache], k: int) -> Callable:
        """A draft tree's candidates from one pass: at position t the selector's candidates,
        scored given each parent token (the walk's scores at temperature 1, normalised over
        the candidates); `expand(t, parents [M])` -> (tokens [M, k'], log q [M, k']), k' the
        selector's top k (`k` is DFlash 1's)."""
        hidden = self.hidden(block_ids[None], cache)[:, 1:]  # [1, P, H]
        sel = self.candidate_selector
        unary, cand = sel.candidates(self.draft_logits(hidden), self.get("draft_vocab"))
        g = sel.hidden_projection(hidden)  # [1, P, R]

        def expand(t: int, parents: mx.array) -> tuple[mx.array, mx.array]:
            s = sel.scores(unary[0, t], cand[0, t], g[0, t], parents).astype(mx.float32)
            logq = s - mx.logsumexp(s, axis=-1, keepdims=True)  # [M, k']
            return mx.broadcast_to(cand[0, t], s.shape), logq

        return expand

    def penalised_walk(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        sp: SamplingParams,
        key: mx.array,
        penalty: PenaltyContext,
    ) -> tuple[mx.array, mx.array | None]:
        """The walk one position at a time: position t's candidates, unary scores and filters
        come from its logits penalised given the drafts before it (lazy, no host sync)."""
        sel = self.candidate_selector
        P, V = logits.shape[1], logits.shape[-1]
        u = mx.random.uniform(shape=(1, P), key=key)
        filters = sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0
        drafts, prev, qs = mx.zeros((0,), dtype=mx.int32), anchor, []
        for t in range(P):
            row = penalty.apply(logits[0, t : t + 1], drafts, first=t)[None]  # [1, 1, V]
            h = hidden[:, t : t + 1]
            if sp.greedy:
                path, _, _ = sel.walk(h, row, prev)
            else:
                keep = probabilities(row, sp) > 0 if filters else None
                path, cand, q = sel.walk(h, row, prev, sp.temperature, u[:, t : t + 1], keep)
                qs.append(scatter_candidates(cand[0], q[0], V))
            prev = path[0].astype(mx.int32)
            drafts = mx.concatenate([drafts, prev])
        return drafts, (mx.concatenate(qs) if qs else None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Codebooks are stored without `.weight`; map them onto the embedding tables."""
        out = dict(weights)
        for name in CODEBOOKS:
            key = f"candidate_selector.{name}"
            if key in out:
                out[f"{key}.weight"] = out.pop(key)
        return out

    def export_weights(self) -> dict[str, mx.array]:
        """Parameters under the checkpoint's names (codebooks without `.weight`)."""
        from mlx.utils import tree_flatten

        out = {}
        for k, v in tree_flatten(self.parameters()):
            base = k.removesuffix(".weight")
            out[base if base.split(".")[-1] in CODEBOOKS else k] = v
        return out


__all__ = ["DFlash2DraftModel", "GroupedDynamicCausalConv", "CandidateSelector", "block_mask"]
