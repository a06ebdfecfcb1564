"""Metal kernel specs and launches for the DFlash 2 kernels.

A `KernelSpec` is what `mx.fast.metal_kernel` is built from (the `.metal` body files in
this folder plus a header); the `*_metal` functions prepare inputs, launch, and return
outputs. They take a `make` callable (spec -> kernel) so the same launch code runs the real
kernel (`mx.fast.metal_kernel`) or the CPU emulation in tests/metal_emu.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx

_DIR = Path(__file__).resolve().parent
CONV_THREADS = 256
SIMD_WIDTH = 32
MAX_SIMDGROUPS = 16


@dataclass(frozen=True)
class KernelSpec:
    """Arguments of `mx.fast.metal_kernel` (everything but the launch)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""

    def build(self, factory: Callable[..., Any]) -> Any:
        """Build a kernel with an `mx.fast.metal_kernel`-compatible factory."""
        return factory(
            name=self.name,
            input_names=list(self.input_names),
            output_names=list(self.output_names),
            source=self.source,
            header=self.header,
        )


MakeKernel = Callable[[KernelSpec], Any]


@cache
def read_source(name: str) -> str:
    """Text of `<name>.metal` in this package."""
    return (_DIR / f"{name}.metal").read_text()


@cache
def conv_spec() -> KernelSpec:
    return KernelSpec(
        name="dflash_dynamic_conv",
        input_names=("x", "base", "dyn"),
        output_names=("out",),
        source=read_source("dynamic_conv"),
    )


@cache
def selector_spec(sample: bool) -> KernelSpec:
    inputs = ("unary", "cand", "g", "pred_codebook", "succ_codebook", "anchor")
    outputs = ("path", "index")
    if sample:
        inputs += ("temperature", "uniforms")
        outputs += ("q",)
    return KernelSpec(
        name="dflash_selector_walk_" + ("sample" if sample else "greedy"),
        input_names=inputs,
        output_names=outputs,
        source=read_source("selector_walk"),
        header=f"#define DFLASH_SELECTOR_SAMPLE {int(sample)}\n",
    )


def dynamic_conv_metal(
    x: mx.array, base: mx.array, dyn: mx.array, group_size: int, make: MakeKernel
) -> mx.array:
    """Launch the dynamic conv kernel (shapes already validated)."""
    B, L, H = x.shape
    kernel = make(conv_spec())
    (out,) = kernel(
        inputs=[x, base.astype(x.dtype), dyn.astype(x.dtype)],
        template=[("T", x.dtype)],
        grid=(H, L, B),
        threadgroup=(min(H, CONV_THREADS), 1, 1),
        output_shapes=[(B, L, H)],
        output_dtypes=[x.dtype],
    )
    return out


def selector_simdgroups(top_k: int) -> int:
    """Simdgroups per threadgroup for the selector walk."""
    return max(1, min(top_k, MAX_SIMDGROUPS))


def _codebook(c: mx.array) -> mx.array:
    return c if c.dtype in (mx.float32, mx.float16, mx.bfloat16) else c.astype(mx.float32)


def selector_walk_metal(
    unary: mx.array,
    cand: mx.array,
    g: mx.array,
    pred_codebook: mx.array,
    succ_codebook: mx.array,
    anchor: mx.array,
    temperature: float | None,
    uniforms: mx.array | None,
    make: MakeKernel,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Launch the selector-walk kernel (shapes validated; uniforms given when sampling)."""
    B, P, k = unary.shape
    R = g.shape[-1]
    sample = bool(temperature)
    nsg = selector_simdgroups(k)
    inputs = [
        unary.astype(mx.float32),
        cand.astype(mx.int32),
        g.astype(mx.float32),
        _codebook(pred_codebook),
        _codebook(succ_codebook),
        anchor.astype(mx.int32).reshape(B),
    ]
    shapes = [(B, P), (B, P)]
    dtypes = [mx.int32, mx.int32]
    if sample:
        inputs += [mx.array(float(temperature), mx.float32), uniforms.astype(mx.float32)]
        shapes.append((B, P, k))
        dtypes.append(mx.float32)
    outs = make(selector_spec(sample))(
        inputs=inputs,
        template=[("TOPK", k), ("RANK", R), ("NSG", nsg)],
        grid=(SIMD_WIDTH * nsg, B, 1),
        threadgroup=(SIMD_WIDTH * nsg, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    return outs[0], outs[1], (outs[2] if sample else None)
