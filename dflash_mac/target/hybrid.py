"""GatedDeltaNet rollback for hybrid targets (qwen3_5, qwen3_next and their MoE variants).

A linear-attention layer keeps `ArraysCache([conv state, recurrent state])`, which cannot be
trimmed. While a verify pass runs, a per-instance hook (hooks.py) runs the layer's own
computation and keeps the conv input and the exact recurrence inputs (q, k, v, a, b, the state
before verify, the mask). After a partial acceptance of `n` positions the conv state is
`conv_input[:, n : n + K - 1]` and the recurrent state is the recurrence replayed over those `n`
steps from the saved state (docs/design.md §6 step 5). ArraysCache entries are replaced, never
written in place, so holding the old entry is a free snapshot (docs/design.md §11).

The alternative strategy `"rerun"` (kept for comparison, docs/rollback.md) restores the
snapshot and runs the layer's original forward again on the accepted inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.generate import generation_stream
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from ..errors import RollbackError
from . import hooks
from .structure import decoder_layers

STRATEGIES = ("replay", "rerun")
HAS_FAST_GDN = hasattr(mx.fast, "gated_delta_update")


@dataclass(eq=False)
class GDNRecord:
    """What one linear-attention layer saw during the last verify pass."""

    cache: Any
    strategy: str = "replay"
    armed: bool = False
    fresh: bool = False  # recorded since the last `arm`
    conv0: mx.array | None = None  # cache entries before verify (snapshots)
    state0: mx.array | None = None
    conv_input: mx.array | None = None
    q: mx.array | None = None
    k: mx.array | None = None
    v: mx.array | None = None
    a: mx.array | None = None
    b: mx.array | None = None
    mask: mx.array | None = None
    inputs: mx.array | None = None  # layer input ("rerun")
    length: int = 0  # positions of the recorded pass
    kept: int | None = None  # positions of it the cache now holds
    after: mx.array | None = None  # the cache's recurrent entry after the last restore

    def take(self, cache: Any, inputs: mx.array, mask: mx.array | None) -> None:
        self.conv0, self.state0 = cache[0], cache[1]
        self.inputs, self.mask, self.length = inputs, mask, inputs.shape[1]
        self.armed, self.fresh = False, True


def _project_qwen3_5(self: nn.Module, inputs: mx.array):
    B, S, _ = inputs.shape
    qkv = self.in_proj_qkv(inputs)
    z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
    return qkv, z, self.in_proj_b(inputs), self.in_proj_a(inputs)


def _project_qwen3_next(self: nn.Module, inputs: mx.array):
    B, S, _ = inputs.shape
    q, k, v, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
    )
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], -1)
    return qkv, z, b, a


def _forward(self: nn.Module, project: Callable, inputs: mx.array, mask, cache, rec: GDNRecord):
    """mlx-lm's GatedDeltaNet forward (qwen3_5.py / qwen3_next.py), keeping what replay needs."""
    B, S, _ = inputs.shape
    group = getattr(self, "sharding_group", None)
    if group is not None:
        inputs = sum_gradients(group)(inputs)
    qkv, z, b, a = project(self, inputs)
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    n_keep = self.conv_kernel_size - 1
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(self.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
            [self.num_k_heads, self.num_k_heads, self.num_v_heads],
            [self.head_k_dim, self.head_k_dim, self.head_v_dim],
        )
    ]
    state = cache[1]
    q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
    rec.conv_input, rec.q, rec.k, rec.v, rec.a, rec.b = conv_input, q, k, v, a, b
    out, state = gated_delta_update(
        q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=not self.training
    )
    cache[1] = state
    cache.advance(S)
    out = self.norm(out, z)
    out = self.out_proj(out.reshape(B, S, -1))
    if group is not None:
        out = mx.distributed.all_sum(out, group=group)
    return out


def _projections() -> dict[type, Callable]:
    """Supported layer classes (those this mlx-lm has) and their input projections."""
    import importlib

    out = {}
    for module, cls, project in (
        ("qwen3_5", "GatedDeltaNet", _project_qwen3_5),
        ("qwen3_next", "Qwen3NextGatedDeltaNet", _project_qwen3_next),
    ):
        try:
            out[getattr(importlib.import_module(f"mlx_lm.models.{module}"), cls)] = project
        except (ImportError, AttributeError):
            pass
    return out


SUPPORTED: dict[type, Callable] = _projections()


class _Recorder:
    """The hook on one GatedDeltaNet instance: records verify passes (the record of the request
    owning the cache, shared by requests with other caches); other calls run the original."""

    def __init__(self, project: Callable) -> None:
        self.project = project
        self.records: dict[int, GDNRecord] = {}  # id(cache) -> its request's record

    def __call__(self, module: nn.Module, call: Callable, inputs, mask=None, cache=None):
        rec = self.records.get(id(cache))
        if rec is None or not rec.armed:
            return call(inputs, mask, cache)
        rec.take(cache, inputs, mask)
        if rec.strategy == "rerun":
            return call(inputs, mask, cache)
        return _forward(module, self.project, inputs, mask, cache, rec)


def linear_layers(model: nn.Module, cache: list[Any]) -> list[tuple[int, nn.Module]]:
    """(cache index, GatedDeltaNet module) for every non-trimmable cache of `model`."""

    out = []
    for i, c in enumerate(cache):
        if c.is_trimmable():
            continue
        layers = decoder_layers(model)
        mods = []
        if len(layers) == len(cache):
            mods = [m for m in layers[i].modules() if hooks.original_class(m) in SUPPORTED]
        if len(mods) != 1:
            raise RollbackError(
                f"this target keeps a non-trimmable {type(c).__name__} in layer {i} that DFlash "
                "cannot roll back (supported: GatedDeltaNet layers of qwen3_5 / qwen3_next)."
            )
        out.append((i, mods[0]))
    return out


def replay(module: nn.Module, rec: GDNRecord, n: int) -> tuple[mx.array | None, mx.array | None]:
    """Conv and recurrent state after the first `n` positions of the recorded pass."""
    if n == 0:
        return rec.conv0, rec.state0
    K1 = rec.conv_input.shape[1] - rec.length
    conv = mx.contiguous(rec.conv_input[:, n : n + K1])
    q, k, v, a, b = (t[:, :n] for t in (rec.q, rec.k, rec.v, rec.a, rec.b))
    mask = None if rec.mask is None else rec.mask[:, :n]
    state = rec.state0
    if state is None:
        B, Hv, Dv, Dk = q.shape[0], v.shape[2], v.shape[3], q.shape[3]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if HAS_FAST_GDN:
        g = compute_g(module.A_log, a, module.dt_bias)
        _, state = mx.fast.gated_delta_update(q, k, v, g, mx.sigmoid(b), state, mask)
    else:
        _, state = gated_delta_update(
            q, k, v, a, b, module.A_log, module.dt_bias, state, mask, use_kernel=not module.training
        )
    return conv, state


def rerun(module: nn.Module, cls: type, rec: GDNRecord, n: int) -> None:
    """Restore the snapshot and run the original layer again on the first `n` inputs."""
    cache = rec.cache
    cache[0], cache[1] = rec.conv0, rec.state0
    if n:
        mask = None if rec.mask is None else rec.mask[:, :n]
        cls.__call__(module, rec.inputs[:, :n], mask, cache)  # only the cache is kept


class GDNRollback:
    """Captures the linear-attention layers of one target cache and restores them."""

    def __init__(
        self, layers: list[tuple[int, nn.Module]], cache: list[Any], strategy: str = "replay"
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"rollback strategy must be one of {STRATEGIES} (got {strategy}).")
        self.modules = [m for _, m in layers]
        self.records = [GDNRecord(cache[i], strategy) for i, _ in layers]
        self.strategy = strategy
        self._hooks: list[_Recorder] = []  # one per module while active
        self.active = False

    def __enter__(self) -> GDNRollback:
        """Hook the layer instances (shared by requests with other caches on the same model)."""
        self._hooks = []
        for m, rec in zip(self.modules, self.records):
            hook = hooks.find(m, _Recorder) or _Recorder(SUPPORTED[hooks.original_class(m)])
            hooks.install(m, hook).records[id(rec.cache)] = rec
            self._hooks.append(hook)
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Unhook; the last request using an instance restores its class (idempotent)."""
        if not self.active:
            return
        for m, rec, hook in zip(self.modules, self.records, self._hooks):
            rec.armed = False
            hook.records.pop(id(rec.cache), None)
            hooks.remove(m, hook)
        self.active = False

    def arm(self) -> None:
        """Record the next forward pass of every layer on its own cache."""
        for rec in self.records:
            rec.armed, rec.fresh = True, False

    def captured(self) -> int:
        return sum(rec.fresh for rec in self.records)

    def keep(self, n: int) -> None:
        """Make every layer's cache hold the first `n` positions of the recorded pass."""
        with mx.stream(generation_stream):
            for m, rec in zip(self.modules, self.records):
                if n != rec.length:
                    if rec.strategy == "rerun":
                        rerun(m, hooks.original_class(m), rec, n)
                    else:
                        rec.cache[0], rec.cache[1] = replay(m, rec, n)
                rec.kept, rec.after = n, rec.cache[1]

    def window(self) -> int | None:
        """Positions of the last recorded pass that can still be dropped (None: none are)."""
        if not self.records:
            return None
        kept = {rec.kept for rec in self.records}
        if len(kept) != 1 or None in kept:
            return None
        if any(rec.cache[1] is not rec.after for rec in self.records):
            return None  # the caches moved on since (another forward pass)
        return kept.pop()


def armed(model: nn.Module, cache: list[Any]) -> bool:
    """True when the next forward of `model` on `cache` will be recorded for rollback (a
    verify pass): what a distributed leader tells the ranks that mirror its cache."""
    ids = {id(c) for c in cache if not c.is_trimmable()}
    if not ids:
        return False
    for layer in decoder_layers(model):
        for m in layer.modules():
            hook = hooks.find(m, _Recorder)
            if hook is not None and hook.records:
                return any(r.armed for k, r in hook.records.items() if k in ids)
    return False
