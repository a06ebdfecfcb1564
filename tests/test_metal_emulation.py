"""DFlash 2 Metal kernels vs the MLX reference.

Runs the exact `.metal` sources on the CPU emulator (tests/metal_emu, needs g++) and, on a
Mac with Metal, on the GPU through `mx.fast.metal_kernel`. Also checks that the emulator
rejects broken kernels.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_mac.metal_kernels as mk  # noqa: E402
from dflash_mac.metal_kernels import kernels, reference  # noqa: E402
from metal_emu import emulate  # noqa: E402

HAVE_GXX = emulate.have_compiler()
HAVE_METAL = mk._metal_available()
needs_gxx = pytest.mark.skipif(
    not HAVE_GXX, reason="g++ not found: the Metal CPU emulation needs a C++17 compiler"
)

# (B, L, H, group_size, K, dtype)
CONV_CASES = [
    (1, 5, 64, 16, 2, mx.float32),
    (3, 16, 200, 8, 2, mx.float32),
    (2, 7, 300, 12, 2, mx.float32),
    (2, 6, 96, 32, 3, mx.float32),
    (2, 1, 48, 16, 2, mx.float32),
    (2, 5, 200, 8, 2, mx.float16),
    (2, 16, 72, 8, 2, mx.bfloat16),
]
# (B, P, top_k, rank, vocab, codebook dtype)
SEL_CASES = [
    (1, 4, 16, 256, 500, mx.float32),
    (3, 15, 16, 256, 1000, mx.bfloat16),
    (2, 6, 5, 40, 50, mx.float16),
    (2, 3, 37, 33, 60, mx.float32),
    (1, 7, 128, 32, 4096, mx.float32),  # the bundled DFlash 2 at block 8 (128 candidates)
]
TEMPS = [None, 0.7]


def conv_inputs(case: tuple, seed: int = 0) -> tuple[mx.array, mx.array, mx.array, int]:
    B, L, H, gs, K, dt = case
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((B, L, H), key=k1).astype(dt)
    base = mx.random.normal((K, H), key=k2)
    dyn = mx.random.normal((B, L, K, H // gs), key=k3).astype(dt)
    return x, base, dyn, gs


def sel_inputs(case: tuple, seed: int = 0) -> dict[str, Any]:
    B, P, k, R, V, dt = case
    ks = mx.random.split(mx.random.key(seed), 7)
    return dict(
        unary=2.0 * mx.random.normal((B, P, k), key=ks[0]),
        cand=mx.random.randint(0, V, (B, P, k), key=ks[1]).astype(mx.int32),
        g=mx.random.normal((B, P, R), key=ks[2]),
        pred_codebook=(0.1 * mx.random.normal((V, R), key=ks[3])).astype(dt),
        succ_codebook=(0.1 * mx.random.normal((V, R), key=ks[4])).astype(dt),
        anchor=mx.random.randint(0, V, (B,), key=ks[5]).astype(mx.int32),
        uniforms=mx.random.uniform(shape=(B, P), key=ks[6]),
    )


def emu_make(spec: kernels.KernelSpec) -> Any:
    return spec.build(emulate.metal_kernel)


def metal_make(spec: kernels.KernelSpec) -> Any:
    return mk._make(spec)


def run_conv(make: Callable, case: tuple) -> tuple[mx.array, mx.array]:
    x, base, dyn, gs = conv_inputs(case)
    return kernels.dynamic_conv_metal(x, base, dyn, gs, make), reference.dynamic_conv(
        x, base, dyn, gs
    )


def run_sel(make: Callable, case: tuple, temp: Any) -> tuple[tuple, tuple]:
    a = sel_inputs(case)
    u = a.pop("uniforms") if temp else None
    a.pop("uniforms", None)
    args = (*a.values(), temp, u)
    return kernels.selector_walk_metal(*args, make), reference.selector_walk(*args)


@pytest.fixture(scope="session")
def warm_emulator() -> None:
    """Compile every kernel variant once per session, in parallel (binaries are cached)."""
    if not HAVE_GXX:
        pytest.skip("g++ not found: the Metal CPU emulation needs a C++17 compiler")
    jobs = [lambda c=c: run_conv(emu_make, c) for c in CONV_CASES]
    jobs += [lambda c=c, t=t: run_sel(emu_make, c, t) for c in SEL_CASES for t in TEMPS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda f: f(), jobs))


@pytest.fixture(params=["emulator", "metal"])
def make(request: pytest.FixtureRequest) -> Callable:
    if request.param == "metal":
        if not HAVE_METAL:
            pytest.skip("Metal is not available: real-kernel parity runs on Apple silicon only")
        return metal_make
    request.getfixturevalue("warm_emulator")
    return emu_make


def bits(a: mx.array) -> np.ndarray:
    view = {4: mx.uint32, 2: mx.uint16}[a.dtype.size]
    return np.array(a.view(view))


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_dynamic_conv_parity(make: Callable, case: tuple) -> None:
    out, ref = run_conv(make, case)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    dt = case[-1]
    if dt == mx.float32:
        np.testing.assert_array_equal(bits(out), bits(ref))
        return
    # fp32 accumulation of the same ops, rounded once: exact vs the upcast reference...
    x, base, dyn, gs = conv_inputs(case)
    f32 = reference.dynamic_conv(
        x.astype(mx.float32), base.astype(dt).astype(mx.float32), dyn.astype(mx.float32), gs
    ).astype(dt)
    np.testing.assert_array_equal(bits(out), bits(f32))
    # ...and close to the reference computed in the low-precision dtype.
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    scale = mx.abs(ref.astype(mx.float32)).max().item()
    assert err <= (1e-3 if dt == mx.float16 else 1e-2) * scale


@pytest.mark.parametrize("temp", TEMPS, ids=["greedy", "sample"])
@pytest.mark.parametrize("case", SEL_CASES, ids=str)
def test_selector_walk_parity(make: Callable, case: tuple, temp: Any) -> None:
    (path, index, q), (rpath, rindex, rq) = run_sel(make, case, temp)
    np.testing.assert_array_equal(np.array(index), np.array(rindex))
    np.testing.assert_array_equal(np.array(path), np.array(rpath))
    assert path.dtype == mx.int32 and index.dtype == mx.int32
    if temp is None:
        assert q is None and rq is None
    else:
        np.testing.assert_allclose(np.array(q), np.array(rq), rtol=1e-6, atol=1e-6)


def test_selector_ties_and_clipping(make: Callable) -> None:
    case = SEL_CASES[0]
    a = sel_inputs(case)
    B, P, k = a["unary"].shape
    a["unary"] = mx.zeros((B, P, k))
    a["pred_codebook"] = mx.zeros_like(a["pred_codebook"])  # all scores tie
    u = mx.array([[0.0, 0.5, 0.9999999, 1.0]])
    a.pop("uniforms")
    path, index, _ = kernels.selector_walk_metal(*a.values(), None, None, make)
    assert np.array(index).tolist() == [[0] * P]  # greedy ties: lowest index
    assert np.array(path).tolist() == np.array(a["cand"][:, :, 0]).tolist()
    _, index, q = kernels.selector_walk_metal(*a.values(), 1.0, u, make)
    _, rindex, rq = reference.selector_walk(*a.values(), 1.0, u)
    np.testing.assert_array_equal(np.array(index), np.array(rindex))
    assert np.array(index)[0, -1] == k - 1  # u = 1 is clipped to the last candidate
    np.testing.assert_allclose(np.array(q), 1.0 / k, rtol=1e-6)


@needs_gxx
def test_public_api_metal_path(monkeypatch: pytest.MonkeyPatch, warm_emulator: None) -> None:
    """The dispatching public functions, routed to the emulated kernels."""
    monkeypatch.setattr(mk, "_use_metal", lambda: True)
    monkeypatch.setattr(mk, "_make", emu_make)
    x, base, dyn, gs = conv_inputs(CONV_CASES[0])
    want = reference.dynamic_conv(x, base, dyn, gs)
    assert mx.array_equal(mk.dynamic_conv(x, base, dyn, gs), want)
    a = sel_inputs(SEL_CASES[0])
    u = a.pop("uniforms")
    got = mk.selector_walk(*a.values(), temperature=0.7, uniforms=u)
    want = reference.selector_walk(*a.values(), 0.7, u)
    assert mx.array_equal(got[1], want[1])


# ---- the emulator rejects broken kernels ------------------------------------------------


def broken(edit: Callable[[str], str], schedules: tuple = ("forward", "reverse")) -> Callable:
    def make(spec: kernels.KernelSpec) -> Any:
        new = edit(spec.source)
        assert new != spec.source, "the edit no longer applies to the kernel source"
        spec = dataclasses.replace(spec, source=new)
        return spec.build(lambda **kw: emulate.metal_kernel(**kw, schedules=schedules))

    return make


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@needs_gxx
def test_missing_barrier_is_a_race() -> None:
    make = broken(lambda s: s.replace(BARRIER, "", 1))
    with pytest.raises(emulate.EmulationRaceError, match="missing barrier or a data race"):
        run_sel(make, SEL_CASES[0], None)
    # a single schedule cannot prove a race, but the result is wrong
    (_, index, _), (_, rindex, _) = run_sel(
        broken(lambda s: s.replace(BARRIER, "", 1), ("forward",)), SEL_CASES[0], None
    )
    assert not mx.array_equal(index, rindex)


@needs_gxx
def test_missing_simdgroup_barrier_is_a_race() -> None:
    make = broken(lambda s: s.replace("simdgroup_barrier(mem_flags::mem_threadgroup);", ""))
    with pytest.raises(emulate.EmulationRaceError):
        run_sel(make, SEL_CASES[1], 0.7)


@needs_gxx
def test_off_by_one_is_a_mismatch() -> None:
    make = broken(lambda s: s.replace("t < P;", "t < P - 1;"))
    (path, index, _), (rpath, rindex, _) = run_sel(make, SEL_CASES[0], None)
    assert not mx.array_equal(index, rindex)
    out, ref = run_conv(
        broken(lambda s: s.replace("(int(t) >= tap)", "(int(t) > tap)")), CONV_CASES[0]
    )
    assert not mx.array_equal(out, ref)


@needs_gxx
def test_out_of_bounds_read_is_caught() -> None:
    make = broken(lambda s: s.replace("h / gs]", "(h + 1) / gs]"))
    with pytest.raises(emulate.EmulationError, match="out-of-bounds"):
        run_conv(make, CONV_CASES[0])


@needs_gxx
def test_divergent_barrier_is_caught() -> None:
    make = broken(lambda s: s.replace("if (sg == 0) {", "if (sg == 0) {\n" + BARRIER, 1))
    with pytest.raises(emulate.EmulationError, match="divergent threadgroup_barrier"):
        run_sel(make, SEL_CASES[0], None)


@needs_gxx
@pytest.mark.parametrize(
    "edit",
    [
        ("acc = simd_sum(acc);", "acc = simd_prefix_exclusive_sum(acc);"),
        ("exp(scores[j] / temp - m)", "metal::precise::exp(scores[j] / temp - m)"),
        ("float pg[NR];", "float4 unused = float4(0.0f);\n  float pg[NR];"),
    ],
    ids=["simd_prefix_exclusive_sum", "precise_exp", "float4"],
)
def test_unsupported_builtin_fails_to_compile(edit: tuple[str, str]) -> None:
    make = broken(lambda s: s.replace(*edit))
    with pytest.raises(emulate.EmulationCompileError):
        run_sel(make, SEL_CASES[0], 0.7)
