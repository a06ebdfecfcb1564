"""DFlash 2 kernels: custom Metal kernels with exact MLX reference fallbacks.

Public API (the one place callers use):

- `dynamic_conv(x, base, dyn, group_size)`: grouped dynamic causal conv.
- `selector_walk(unary, cand, g, pred_codebook, succ_codebook, anchor, temperature=None,
  uniforms=None)`: the candidate-selector walk over one block.
- `kernels_in_use()`: "metal" or "reference".

Dispatch: the Metal kernels run when the default device is the GPU and Metal is available,
the reference ops otherwise. `DFLASH_MAC_KERNELS=reference|metal` forces one. The reference
ops run under `mx.compile` (one compiled function per group size, greedy or sampled walk):
the same ops and results, fused where MLX can, so a walk is not bs - 1 rounds of small-op
dispatch (on a 2-core CPU the drafter pass got ~12 % cheaper).
"""

from __future__ import annotations

import os
from functools import cache, partial
from typing import Any

import mlx.core as mx

from . import reference
from .kernels import KernelSpec, dynamic_conv_metal, selector_walk_metal

__all__ = ["dynamic_conv", "selector_walk", "kernels_in_use", "ENV_VAR"]

ENV_VAR = "DFLASH_MAC_KERNELS"
_CHOICES = ("auto", "metal", "reference")


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def _use_metal() -> bool:
    choice = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not valid; use one of: {', '.join(_CHOICES)}.")
    if choice == "reference":
        return False
    if choice == "metal":
        if not _metal_available():
            raise ValueError(
                f"{ENV_VAR}=metal forces the Metal kernels, but Metal is not available on "
                "this machine; unset it or set it to 'reference'."
            )
        return True
    return mx.default_device() == mx.gpu and _metal_available()


def kernels_in_use() -> str:
    """ "metal" or "reference": what `dynamic_conv` / `selector_walk` run right now."""
    return "metal" if _use_metal() else "reference"


@cache
def _metal_kernel(spec: KernelSpec) -> Any | None:
    """The `mx.fast.metal_kernel` for `spec`, built once; None without Metal."""
    if not _metal_available():
        return None
    return spec.build(mx.fast.metal_kernel)


def _make(spec: KernelSpec) -> Any:
    kernel = _metal_kernel(spec)
    if kernel is None:
        raise ValueError("Metal is not available; the DFlash 2 Metal kernels cannot run.")
    return kernel


@cache
def _compiled_conv(group_size: int) -> Any:
    """`reference.dynamic_conv` compiled for one group size."""
    return mx.compile(partial(reference.dynamic_conv, group_size=group_size))


def _walk_greedy(*args: mx.array) -> tuple[mx.array, mx.array]:
    path, index, _ = reference.selector_walk(*args)
    return path, index


_compiled_walk_greedy = mx.compile(_walk_greedy)
_compiled_walk_sample = mx.compile(reference.selector_walk)  # temperature as a scalar array


def dynamic_conv(x: mx.array, base: mx.array, dyn: mx.array, group_size: int) -> mx.array:
    """Grouped dynamic causal conv: ``x [B, L, H]``, ``base [K, H]``, ``dyn [B, L, K, G]``
    with ``G = H // group_size`` -> ``[B, L, H]`` in ``x.dtype`` (see reference.py)."""
    if x.ndim != 3 or base.ndim != 2 or dyn.ndim != 4:
        raise ValueError(
            "dynamic_conv expects x [B, L, H], base [K, H], dyn [B, L, K, G]; got "
            f"{tuple(x.shape)}, {tuple(base.shape)}, {tuple(dyn.shape)}."
        )
    B, L, H = x.shape
    K = base.shape[0]
    if group_size <= 0 or H % group_size:
        raise ValueError(f"group_size {group_size} must divide the hidden size {H}.")
    if base.shape[1] != H or tuple(dyn.shape) != (B, L, K, H // group_size):
        raise ValueError(
            f"dynamic_conv shapes do not match: x {tuple(x.shape)}, base {tuple(base.shape)}"
            f" (want [{K}, {H}]), dyn {tuple(dyn.shape)} (want [{B}, {L}, {K}, "
            f"{H // group_size}])."
        )
    if x.size == 0:
        return reference.dynamic_conv(x, base, dyn, group_size)
    if not _use_metal():
        return _compiled_conv(group_size)(x, base, dyn)
    return dynamic_conv_metal(x, base, dyn, group_size, _make)


def selector_walk(
    unary: mx.array,
    cand: mx.array,
    g: mx.array,
    pred_codebook: mx.array,
    succ_codebook: mx.array,
    anchor: mx.array,
    temperature: float | None = None,
    uniforms: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Candidate-selector walk over one block (whole walk in one kernel launch).

    Args: ``unary [B, P, k]``, ``cand [B, P, k]`` token ids, ``g [B, P, R]``, codebooks
    ``[V, R]``, ``anchor [B]``; ``temperature`` None/0 = greedy; ``uniforms [B, P]`` in
    [0, 1) for sampling (drawn with ``mx.random.uniform`` when omitted).

    Returns: ``(path [B, P] int32, index [B, P] int32, q [B, P, k] float32 or None)``.
    """
    if unary.ndim != 3 or tuple(cand.shape) != tuple(unary.shape):
        raise ValueError(
            f"selector_walk expects unary and cand [B, P, k]; got {tuple(unary.shape)} and "
            f"{tuple(cand.shape)}."
        )
    B, P, k = unary.shape
    R = pred_codebook.shape[-1] if pred_codebook.ndim == 2 else -1
    if g.ndim != 3 or tuple(g.shape[:2]) != (B, P) or g.shape[2] != R:
        raise ValueError(
            f"selector_walk: g {tuple(g.shape)} must be [{B}, {P}, rank] with the codebooks'"
            f" rank (pred_codebook {tuple(pred_codebook.shape)})."
        )
    if succ_codebook.ndim != 2 or succ_codebook.shape[1] != R:
        raise ValueError(
            f"selector_walk: succ_codebook {tuple(succ_codebook.shape)} must be [V, {R}]."
        )
    if anchor.size != B:
        raise ValueError(f"selector_walk: anchor needs one token per row ({B}).")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    sample = bool(temperature)
    if sample:
        if uniforms is None:
            uniforms = mx.random.uniform(shape=(B, P))
        elif tuple(uniforms.shape) != (B, P):
            raise ValueError(f"uniforms must be [{B}, {P}], got {tuple(uniforms.shape)}.")
    else:
        uniforms = None
    if B * P == 0:
        return reference.selector_walk(
            unary, cand, g, pred_codebook, succ_codebook, anchor, temperature, uniforms
        )
    if not _use_metal():
        args = (unary, cand, g, pred_codebook, succ_codebook, anchor)
        if uniforms is None:
            return (*_compiled_walk_greedy(*args), None)
        return _compiled_walk_sample(*args, mx.array(temperature, mx.float32), uniforms)
    return selector_walk_metal(
        unary, cand, g, pred_codebook, succ_codebook, anchor, temperature, uniforms, _make
    )
