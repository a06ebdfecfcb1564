"""Batched DFlash cycles over rows with ragged caches (docs/design.md §6, issue #36).

Each row of a batch is a request's own `DecodeState`: its target `KVCache`s and drafter
context hold exactly its committed tokens, so ragged acceptance is a per-row trim and a row
joins or leaves without touching the others. A batched forward stacks the rows' blocks
`[B, bs]`: every weight matmul (projections, MLP, LM head) runs once for the batch, and only
RoPE, the cache update and the attention run per row, on the row's own cache, with exactly the
shapes of that row decoding alone. With a row-invariant BLAS a row's logits are then bitwise
those of the row alone (the greedy tests check that); no padding, no masks of rejected slots.

Attention targets whose layers are mlx-lm's Llama / Qwen2 / Qwen3 / Mistral attention are
batched (`batch_reason`); hybrids, rotating windows, sharded targets and drafters without a
batched proposal decode one request at a time."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from ..engine.decode import DecodeState
from ..engine.verify import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    acceptance_odds,
    logprob_rows,
    probabilities,
    sample,
    sample_logits,
    scatter_candidates,
)
from ..models.penalties import PenaltyContext, draft_sequential
from ..pair import Pair
from ..target import hooks
from ..target.structure import decoder_layers

ATTENTION_KINDS = ("llama", "qwen2", "qwen3", "mistral")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads")


class RowCaches:
    """One layer's caches of the rows of a batch: the `cache` argument of a ragged forward.
    `lengths`: the rows' token counts when they are packed into one sequence `[1, sum]`
    (rows of different lengths); None: stacked `[B, L]`."""

    def __init__(self, rows: list[KVCache], lengths: list[int] | None = None):
        self.rows = rows
        self.lengths = lengths

    def make_mask(self, *args, **kwargs) -> None:
        return None  # each row makes its own (RaggedAttention)


class RaggedAttention:
    """Hook on one attention instance: given `RowCaches`, the q/k/v/o projections run on the
    whole batch and RoPE, the cache update and the attention per row, with the row's own cache
    and the mask it would get alone; any other cache runs the original call."""

    def __call__(self, attn, call, x: mx.array, mask=None, cache=None) -> mx.array:
        if not isinstance(cache, RowCaches):
            return call(x, mask, cache=cache)
        if cache.lengths is not None:
            return self.packed(attn, x, cache)
        B, L, _ = x.shape
        q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1)
        k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        offsets = mx.array([c.offset for c in cache.rows])  # [B]: RoPE per row, in one op
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offsets)  # [B, H, L, hd]
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=offsets)
        outs = []
        for i, c in enumerate(cache.rows):
            row_mask = create_attention_mask(x[i : i + 1], c)  # before the update, as alone
            ki, vi = c.update_and_fetch(k[i : i + 1], v[i : i + 1])
            qi = q[i : i + 1]
            outs.append(
                scaled_dot_product_attention(qi, ki, vi, cache=c, scale=attn.scale, mask=row_mask)
            )
        out = mx.concatenate(outs).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return attn.o_proj(out)

    def packed(self, attn, x: mx.array, cache: RowCaches) -> mx.array:
        """Rows of different lengths packed into `x [1, sum L, D]`: the projections once, then
        each row's span with its own RoPE offset, cache and mask, as that row alone."""
        _, T, _ = x.shape
        q = attn.q_proj(x).reshape(1, T, attn.n_heads, -1)
        k = attn.k_proj(x).reshape(1, T, attn.n_kv_heads, -1)
        v = attn.v_proj(x).reshape(1, T, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [1, H, T, hd]
        outs, start = [], 0
        for c, n in zip(cache.rows, cache.lengths):
            span = slice(start, start + n)
            row_mask = create_attention_mask(x[:, span], c)  # before the update, as alone
            qi = attn.rope(q[:, :, span], offset=c.offset)
            ki, vi = c.update_and_fetch(attn.rope(k[:, :, span], offset=c.offset), v[:, :, span])
            outs.append(
                scaled_dot_product_attention(qi, ki, vi, cache=c, scale=attn.scale, mask=row_mask)
            )
            start += n
        out = mx.concatenate(outs, axis=2).transpose(0, 2, 1, 3).reshape(1, T, -1)
        return attn.o_proj(out)


def batch_reason(pair: Pair, state: DecodeState | None = None) -> str | None:
    """Why this pair cannot decode in batches (None: it can)."""
    kind = pair.target_config.get("model_type", "")
    if kind not in ATTENTION_KINDS:
        return f"the target ({kind or 'unknown'}) is not a plain attention model"
    if pair.mirror is not None:
        return "the target is sharded over several ranks"
    drafter = pair.drafter
    if hasattr(drafter, "propose") and not hasattr(drafter, "candidate_selector"):
        return "the drafter has its own proposal"
    for layer in decoder_layers(pair.target):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ATTENTION_PARTS):
            return "the target's attention layers are not Llama-style"
        if getattr(layer, "use_sliding", False):
            return "the target has sliding-window layers"
    if state is not None and any(type(c) is not KVCache for c in state.target_cache):
        return "the target cache is not a plain KV cache (rotating window or hybrid)"
    return None


def ragged_hooks(pair: Pair) -> ExitStack:
    """Context manager: `RaggedAttention` on every attention instance of the target."""
    stack = ExitStack()
    hook = RaggedAttention()
    for layer in decoder_layers(pair.target):
        stack.enter_context(hooks.hooked(layer.self_attn, hook))
    return stack


def forward_rows(
    pair: Pair, tokens: mx.array | list[mx.array], states: list[DecodeState]
) -> mx.array | list[mx.array]:
    """The target on `tokens [B, L]`, row i continuing `states[i]`'s cache: logits
    [B, L, V], lazily (inside `ragged_hooks`). `tokens` may be a list of rows of different
    lengths [L_i]: they run packed in one pass, and the logits come back per row, [L_i, V]."""
    lengths = None
    if isinstance(tokens, list):
        lengths = [int(t.shape[0]) for t in tokens]
        if len(set(lengths)) == 1:  # one length: stacked, as an array of rows
            tokens, lengths = mx.stack(tokens), None
        else:
            tokens = mx.concatenate(tokens)[None]
    layers = zip(*(s.target_cache for s in states))
    logits = pair.target(tokens, cache=[RowCaches(list(layer), lengths) for layer in layers])
    return logits if lengths is None else split_rows(logits, lengths)


def split_rows(x: mx.array, lengths: list[int]) -> list[mx.array]:
    """Rows `[L_i, ...]` of `x`: stacked `[B, L, ...]`, or packed `[1, sum L, ...]`."""
    if x.shape[0] == len(lengths):
        return [x[i] for i in range(len(lengths))]
    return mx.split(x[0], list(accumulate(lengths[:-1])))


@dataclass
class RowDraft:
    """A row's proposal: drafts [bs-1] and q [bs-1, V] (None when greedy)."""

    drafts: mx.array
    q: mx.array | None


def propose_rows(
    pair: Pair,
    blocks: mx.array,  # [B, bs]: each row's anchor, then mask tokens
    caches: list[list],
    sps: list[SamplingParams],
    keys: list[mx.array],
    penalties: list[PenaltyContext | None] | None = None,
) -> list[RowDraft]:
    """Each row's drafts, as `drafts.propose` drafts them alone: the drafter's (small) layers
    per row on the row's context, the LM head once for the batch, the choice per row (with
    its penalties: one position at a time, each penalised given the drafts before it)."""
    d = pair.drafter
    B = blocks.shape[0]
    pens = penalties or [None] * B
    if not hasattr(d, "hidden"):  # a drafter with only a call (tests' oracle): per row
        lgs = [d(blocks[i : i + 1], caches[i])[0] for i in range(B)]
        return [
            RowDraft(*draft_sequential(lg, pen, sp, key))
            if pen is not None
            else RowDraft(mx.argmax(lg, axis=-1), None)
            for lg, pen, sp, key in zip(lgs, pens, sps, keys)
        ]
    hidden = mx.concatenate([d.hidden(blocks[i : i + 1], caches[i])[:, 1:] for i in range(B)])
    draft = d.draft_logits(hidden)  # [B, bs-1, K]: the head once for the batch
    logits = draft if d.get("draft_vocab") is None else d.full_vocab(draft)  # [B, bs-1, V]
    sel = getattr(d, "candidate_selector", None)
    out = []
    for i, (sp, key) in enumerate(zip(sps, keys)):
        h, lg = hidden[i : i + 1], logits[i : i + 1]
        if (pen := pens[i]) is not None:  # as DFlash2DraftModel.propose / drafts.propose
            if sel is None:
                out.append(RowDraft(*draft_sequential(lg[0], pen, sp, key)))
            else:
                out.append(RowDraft(*d.penalised_walk(h, lg, blocks[i, :1], sp, key, pen)))
            continue
        if sel is None:  # DFlash 1: the drafter's own distribution
            if sp.greedy:
                out.append(RowDraft(mx.argmax(lg[0], axis=-1), None))
            else:
                q = probabilities(lg[0], sp)
                out.append(RowDraft(sample(q, key=key), q))
            continue
        # DFlash 2: the selector walk, as DFlash2DraftModel.propose
        path, cand, q = d.draft_walk(h, blocks[i, :1], sp, key, draft[i : i + 1])
        q = None if q is None else scatter_candidates(cand[0], q[0], lg.shape[-1])
        out.append(RowDraft(path[0], q))
    return out


def accept_rows(
    logits: mx.array,  # [B, bs, V] the verify logits
    drafts: list[RowDraft] | None,  # None: a plain step (bs 1)
    sps: list[SamplingParams],
    keys: list[mx.array],
    sizes: list[int] | None = None,
    penalties: list[PenaltyContext | None] | None = None,
    logprobs: list[int | None] | None = None,
    masks: list[mx.array | None] | None = None,
) -> tuple[mx.array, list[mx.array | None], list[mx.array | None]]:
    """Each row's verdict as `drafts.Strategy.accept` gives it alone: `[B, 2]` (accepted
    drafts, bonus token), lazily, and a sampled row's acceptance odds (`acceptance_odds`,
    else None). Greedy: the longest agreeing prefix; sampled: rejection
    sampling with the residual, per row with its own settings, penalties and key. `sizes`:
    each row's own block size (≤ bs; None: bs): a row judges only its first size - 1 drafts,
    as a cycle of that size alone would (size 1: a plain step). With `logprobs` (the top k
    of a row, None: none) each such row also gets its `cycle.logprob_rows` over its size's
    positions (the committed drafts, then the bonus), else None. `masks`: a grammar's allowed
    tokens `[V]` for a row of size 1 (None: no grammar)."""
    rows, lps, odds = [], [], []
    for i, (sp, key) in enumerate(zip(sps, keys)):
        lg = logits[i]
        n = lg.shape[0] if sizes is None else sizes[i]
        if penalties and (pen := penalties[i]) is not None:  # p penalised as q was
            lg = pen.apply(lg, mx.zeros((0,), mx.int32) if drafts is None else drafts[i].drafts)
        if masks and (allowed := masks[i]) is not None:  # a grammar's row (size 1)
            lg = mx.where(allowed, lg[:1], -mx.inf)
        odds.append(None)
        if drafts is None or n == 1:
            tok = mx.argmax(lg[0]) if sp.greedy else sample_logits(lg[:1], sp, key)[0]
            acc = mx.array(0)
        elif sp.greedy:
            acc, tok = accept_greedy(drafts[i].drafts[: n - 1], lg[:n])
        else:
            p = probabilities(lg[:n], sp)
            d, q = drafts[i].drafts[: n - 1], drafts[i].q[: n - 1]
            acc, tok = accept_sampled(d, q, p, key)
            odds[-1] = acceptance_odds(d, q, p)
        rows.append(mx.stack([acc.astype(mx.int32), tok.reshape(()).astype(mx.int32)]))
        k = logprobs[i] if logprobs else None
        if k is not None:  # as `drafts.Strategy.verify`: drafts up to acc, then the bonus
            drafted = drafts[i].drafts[: n - 1] if drafts is not None and n > 1 else None
            bonus = tok.reshape(1).astype(mx.int32)
            row = bonus if drafted is None else mx.concatenate([drafted.astype(mx.int32), bonus])
            row = mx.where(mx.arange(row.shape[0]) < acc, row, bonus)
            lps.append(logprob_rows(lg[: row.shape[0]], row, k))
        else:
            lps.append(None)
    return mx.stack(rows), lps, odds
