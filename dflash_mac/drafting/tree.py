"""Tree drafting (DDTree, docs/design.md §6): verify a best-first tree of the drafter's
candidates in one target pass instead of one chain.

- `grow` builds the tree on the device from one drafter pass: the B most likely nodes by summed
  log q (a node's score is its path's), found depth by depth with a beam of width B (a node among
  the B best overall is among the B best of its depth, and its ancestors score higher, so the
  result is the best-first tree and closed under ancestors).
- `verify_view` runs the target over [anchor | nodes] with each node at position start + depth
  and an ancestor-only attention mask (a causal mask would let a node see its cousins: not the
  target's distribution, and not lossless).
- `walk` accepts: x is the target's own token at each node (its argmax, or a draw from p); the
  walk descends while a child holds x and ends with x as the bonus token. Each committed token
  is therefore the target's own choice given the committed prefix, whatever the tree: lossless
  greedy and sampled (it accepts with probability Σ_children p(c) at a node).
- `keep_path` moves the accepted path's cache rows to the front of the verified span, so the
  trim that follows leaves the cache of a plain decode of that path.
- `graft` adds a copied continuation (drafting/copies.py) as one more branch, verified in the same
  pass: it goes on below the deepest node that spells its first tokens. The copy's nodes that
  repeat those stay in the verify but never match, so siblings still hold distinct tokens.

Trees need a target whose every cache is a plain `KVCache` and whose attention applies RoPE as
`rope(x, offset=cache.offset)` (Llama, Qwen2/3, Mistral ...): `supports`. Hybrid targets keep
chains (a recurrent state cannot take a tree mask)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache

from ..target import hooks

EPS = 1e-6  # a child scores strictly below its parent, so ties cannot break ancestor closure

# expand(t, parent tokens [M]) -> (candidate tokens [M, k], their log q [M, k]) at position t
Expand = Callable[[int, mx.array], tuple[mx.array, mx.array]]


@dataclass
class DraftTree:
    """A draft tree, root first and parents before children (lazy arrays)."""

    tokens: mx.array  # [1 + B] int32: the anchor (root), then the nodes
    parents: mx.array  # [1 + B] int32 (the root is its own parent)
    depth: mx.array  # [1 + B] int32 (root 0)
    ancestors: mx.array  # [1 + B, 1 + B] bool: [i, j] iff j is i or an ancestor of i
    top: mx.array  # [1 + B] bool: the node is its parent's likeliest child (the chain's draft)
    budget: int  # B
    max_depth: int  # P: the drafter's block positions (or a grafted copy's length, if longer)
    live: mx.array | None = None  # [1 + B + C] bool: nodes the walk may descend to (None: all)
    copied: int = 0  # C: the last C nodes are a grafted copy (`graft`)

    @property
    def width(self) -> int:
        return self.budget + self.copied + 1


def grow(anchor: mx.array, expand: Expand, max_depth: int, budget: int) -> DraftTree:
    """The best-first tree of `budget` nodes under `expand` (see the module docstring)."""
    par_tok, par_score = anchor.reshape(1).astype(mx.int32), mx.zeros((1,), mx.float32)
    par_id = mx.array([-1], mx.int32)  # union ids of the parents (-1: the root)
    toks, scores, parents, depths, tops, start = [], [], [], [], [], 0
    for t in range(max_depth):
        cand, logq = expand(t, par_tok)  # [M, k]
        k = cand.shape[-1]
        s = (par_score[:, None] + logq.astype(mx.float32) - EPS).reshape(-1)  # [M * k]
        m = min(budget, s.shape[0])
        top = mx.argpartition(-s, kth=m - 1)[:m] if m < s.shape[0] else mx.arange(m)
        best = mx.arange(k)[None, :] == mx.argmax(logq, axis=-1)[:, None]  # [M, k]
        tops.append(best.reshape(-1)[top])
        par_tok, par_score = cand.reshape(-1)[top].astype(mx.int32), s[top]
        par_id = par_id[top // k]
        toks.append(par_tok), scores.append(par_score), parents.append(par_id)
        depths.append(mx.full((m,), t + 1, mx.int32))
        par_id, start = mx.arange(start, start + m, dtype=mx.int32), start + m
    union = mx.concatenate(scores)  # [S], depth by depth
    n = min(budget, union.shape[0])
    keep = mx.sort(mx.argpartition(-union, kth=n - 1)[:n])  # parents before children
    remap = mx.zeros((union.shape[0] + 1,), mx.int32).at[keep + 1].add(mx.arange(1, n + 1))
    parent = remap[mx.concatenate(parents)[keep] + 1]  # tree index of each node's parent
    tokens = mx.concatenate([anchor.reshape(1).astype(mx.int32), mx.concatenate(toks)[keep]])
    parent = mx.concatenate([mx.zeros((1,), mx.int32), parent])
    depth = mx.concatenate([mx.zeros((1,), mx.int32), mx.concatenate(depths)[keep]])
    top = mx.concatenate([mx.ones((1,), mx.bool_), mx.concatenate(tops)[keep]])
    return DraftTree(tokens, parent, depth, ancestors(parent, max_depth), top, n, max_depth)


def ancestors(parents: mx.array, max_depth: int) -> mx.array:
    """[N, N] bool from parent indices [N] (parents before children, the root its own)."""
    eye = mx.eye(parents.shape[0], dtype=mx.bool_)
    anc = eye
    for _ in range(max_depth):  # ancestors of i: i and those of its parent
        anc = eye | anc[parents]
    return anc


def graft(tree: DraftTree, copy: mx.array) -> DraftTree:
    """`tree` with the copied continuation `copy [C]` as one more branch (module docstring):
    copy node k (depth k) hangs below the deepest tree node m that spells copy[:depth(m)], or
    below copy node k-1; copy nodes at depths ≤ depth(m) repeat tree nodes and never match."""
    c, w = copy.shape[0], tree.width
    copy = copy.astype(mx.int32)
    d = tree.depth
    spells = (tree.tokens == copy[mx.clip(d - 1, 0, c - 1)]) & (d <= c)
    spells = spells | (mx.arange(w) == 0)
    on = (tree.ancestors & ~spells[None, :]).sum(axis=-1) == 0  # every ancestor spells it
    m = mx.argmax(mx.where(on, d, -1))  # siblings differ: the spelled nodes form one chain
    k = mx.arange(1, c + 1, dtype=mx.int32)  # the copy nodes' depths
    below = mx.where(k > d[m] + 1, w + k - 2, m.astype(mx.int32))  # copy node k-1, or m
    parent = mx.where(k > d[m], below, 0)  # the repeats hang off the root, dead
    parents = mx.concatenate([tree.parents, parent])
    live = tree.live if tree.live is not None else mx.ones((w,), mx.bool_)
    depth = max(tree.max_depth, c)
    return DraftTree(
        mx.concatenate([tree.tokens, copy]),
        parents,
        mx.concatenate([d, k]),
        ancestors(parents, depth),
        mx.concatenate([tree.top, mx.zeros((c,), mx.bool_)]),
        tree.budget,
        depth,
        mx.concatenate([live, k > d[m]]),
        tree.copied + c,
    )


def walk(tree: DraftTree, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Accept along the tree given `x [1 + B]`, the target's token at each node: (accepted
    depth, bonus token, path [P]: the accepted nodes' indices by depth, valid up to the
    accepted depth). Siblings hold distinct tokens, so at most one child of a node matches.
    `chain_depth(tree, acc, path)` says what the chain of likeliest children accepted."""
    ok = (tree.tokens == x[tree.parents]) | (mx.arange(tree.width) == 0)
    if tree.live is not None:
        ok = ok & tree.live
    on_path = (tree.ancestors & ~ok[None, :]).sum(axis=-1) == 0  # every ancestor matched
    last = mx.argmax(mx.where(on_path, tree.depth, -1))  # the deepest: the path is a chain
    levels = mx.arange(1, tree.max_depth + 1)[:, None]  # [P, 1]
    path = mx.argmax(tree.ancestors[last][None, :] & (tree.depth[None, :] == levels), axis=-1)
    return tree.depth[last], x[last], path.astype(mx.int32)


def chain_depth(tree: DraftTree, acc: mx.array, path: mx.array) -> mx.array:
    """How many of the accepted nodes lead the path as likeliest children: what the chain of
    the same drafter pass would have accepted (greedy), for `auto`'s chain estimate."""
    on = tree.top[path] & (mx.arange(path.shape[0]) < acc)
    return mx.cumprod(on.astype(mx.int32)).sum()


def chain_reach(tree: DraftTree) -> mx.array:
    """How deep the chain of likeliest children goes in the tree (a small budget cuts it
    short): the positions past it were never drafted, so the chain's estimate learns nothing
    of them."""
    chain = (tree.ancestors & ~tree.top[None, :]).sum(axis=-1) == 0  # all its ancestors top
    return mx.max(mx.where(chain, tree.depth, 0))


def attention_mask(tree: DraftTree, start: int) -> mx.array:
    """[1 + B, start + 1 + B] bool: every node sees the cached prefix and its ancestors."""
    prefix = mx.ones((tree.width, start), mx.bool_)
    return mx.concatenate([prefix, tree.ancestors], axis=1)


class TreeView:
    """A target cache seen by a tree verify: RoPE offsets by node (start + depth) and the
    ancestor-only mask; everything else is the wrapped cache's (it stores the nodes' rows)."""

    def __init__(self, cache: KVCache, positions: mx.array, mask: mx.array):
        self.cache, self.positions, self.mask = cache, positions, mask

    @property
    def offset(self) -> mx.array:
        return self.positions

    def make_mask(self, *args: Any, **kwargs: Any) -> mx.array:
        return self.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.cache.update_and_fetch(keys, values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def rope_by_token(obj: nn.Module, call: Callable, x: mx.array, offset: Any = 0) -> mx.array:
    """A RoPE hook: offsets `[L]` (one position per token, batch 1) rotate each token at its
    own position, by running the rotation with the tokens as the batch (per-batch offsets);
    exactly `call` for a chain of consecutive positions."""
    by_token = isinstance(offset, mx.array) and offset.ndim == 1 and x.shape[0] == 1
    if by_token and offset.shape[0] == x.shape[-2]:  # not per-row offsets of a batch
        return call(x.swapaxes(0, 2), offset=offset).swapaxes(0, 2)  # [L, H, 1, D]
    return call(x, offset=offset)


_ROPES: dict[int, tuple[weakref.ref, list[nn.Module]]] = {}  # id(model): (model, its RoPEs)


def ropes(model: nn.Module) -> list[nn.Module]:
    """The RoPE modules of a target's attention layers, found once per model: walking every
    module costs a few ms per request (3 walks a request, more than a tiny model's cycles)."""
    key = id(model)
    if (hit := _ROPES.get(key)) is not None and hit[0]() is model:
        return hit[1]
    found: dict[int, nn.Module] = {}
    for _, m in model.named_modules():
        rope = m.get("rope") if isinstance(m, dict) else getattr(m, "rope", None)
        if isinstance(rope, nn.Module):
            found[id(rope)] = rope
    _ROPES[key] = (weakref.ref(model, lambda _: _ROPES.pop(key, None)), list(found.values()))
    return _ROPES[key][1]


def supports(model: nn.Module, cache: list) -> bool:
    """Whether this target can verify trees (see the module docstring)."""
    return bool(cache) and all(type(c) is KVCache for c in cache) and bool(ropes(model))


@contextmanager
def by_token_positions(rope_modules: list[nn.Module]) -> Iterator[None]:
    """RoPE by token on these modules (`ropes`) for one verify (hooks removed after)."""
    with ExitStack() as stack:
        for rope in rope_modules:
            stack.enter_context(hooks.hooked(rope, rope_by_token))
        yield


def verify_logits(
    model: nn.Module,
    tree: DraftTree,
    cache: list[KVCache],
    rope_modules: list[nn.Module] | None = None,
) -> mx.array:
    """The target's logits at every tree node [1 + B, V] (lazy); the cache grows by 1 + B.
    `rope_modules`: the model's `ropes`, found once by a caller that verifies many trees."""
    start = cache[0].offset
    views = [TreeView(c, start + tree.depth, attention_mask(tree, start)) for c in cache]
    with by_token_positions(ropes(model) if rope_modules is None else rope_modules):
        return model(tree.tokens[None], cache=views)[0]


def keep_path(cache: list[KVCache], start: int, path: mx.array, kept: int) -> None:
    """Move the rows of the root and the first `kept - 1` path nodes (verified from `start`)
    to start .. start + kept - 1; the caller then trims the rest."""
    if kept <= 1:
        return  # the root already sits at `start`
    rows = start + mx.concatenate([mx.zeros((1,), mx.int32), path[: kept - 1]])
    for c in cache:
        c.keys[..., start : start + kept, :] = c.keys[..., rows, :]
        c.values[..., start : start + kept, :] = c.values[..., rows, :]
