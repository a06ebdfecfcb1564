"""Self-tests of the Metal CPU emulator: thread attributes, SIMD ops, barriers, types."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from . import emulate

pytestmark = pytest.mark.skipif(
    not emulate.have_compiler(), reason="g++ not found: the Metal CPU emulation needs it"
)

ATTRS_SRC = """
uint i = thread_position_in_grid.x;
int v = inp[i];
ids[i * 4 + 0] = int(thread_index_in_threadgroup);
ids[i * 4 + 1] = int(simdgroup_index_in_threadgroup * 32 + thread_index_in_simdgroup);
ids[i * 4 + 2] = int(threads_per_threadgroup.x);
ids[i * 4 + 3] = int(threadgroup_position_in_grid.x);
threadgroup int shared[64];
shared[thread_index_in_threadgroup] = v;
threadgroup_barrier(mem_flags::mem_threadgroup);
int n = int(threads_per_threadgroup.x);
simd[i * 5 + 0] = simd_sum(v);
simd[i * 5 + 1] = simd_max(v);
simd[i * 5 + 2] = simd_shuffle_xor(v, 1);
simd[i * 5 + 3] = simd_broadcast(v, 0);
simd[i * 5 + 4] = shared[n - 1 - int(thread_index_in_threadgroup)];
"""


def test_attributes_simd_ops_and_barrier() -> None:
    n, tg = 100, 40  # non-uniform threadgroups (40, 40, 20); partial simdgroups
    inp = mx.array(np.random.default_rng(0).integers(-1000, 1000, n).astype(np.int32))
    k = emulate.metal_kernel(
        "attrs", ["inp"], ["ids", "simd"], ATTRS_SRC, schedules=("forward", "reverse", "shuffle")
    )
    ids, simd = k(
        inputs=[inp],
        grid=(n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n, 4), (n, 5)],
        output_dtypes=[mx.int32, mx.int32],
    )
    ids, simd, v = np.array(ids), np.array(simd), np.array(inp)
    for i in range(n):
        g, t = divmod(i, tg)
        size = min(tg, n - g * tg)
        s0 = g * tg + (t // 32) * 32
        lanes = v[s0 : min(s0 + 32, g * tg + size)]
        assert ids[i].tolist() == [t, t, size, g]
        assert simd[i, 0] == lanes.sum() and simd[i, 1] == lanes.max()
        if s0 + ((t % 32) ^ 1) < g * tg + size:  # the partner lane exists
            assert simd[i, 2] == v[s0 + ((t % 32) ^ 1)]
        assert simd[i, 3] == lanes[0]
        assert simd[i, 4] == v[g * tg + size - 1 - t]


HALF_SRC = """
uint i = thread_position_in_grid.x;
h[i] = static_cast<float16_t>(inp[i]);
b[i] = static_cast<bfloat16_t>(inp[i]);
back[i] = float(static_cast<float16_t>(inp[i])) + float(static_cast<bfloat16_t>(inp[i]));
"""


def test_half_and_bfloat_rounding() -> None:
    rng = np.random.default_rng(1)
    special = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.0,
        65520.0,
        1e-8,
        2.0**-25,
        3 * 2.0**-26,
        2.0**-24,
        6.1e-5,
        1 + 2.0**-11,
        1 + 3 * 2.0**-11,
        1 + 2.0**-8,
        3e38,
        np.inf,
    ]
    vals = np.concatenate(
        [special, -np.array(special), rng.standard_normal(500) * 10.0 ** rng.integers(-9, 6, 500)]
    )
    x = mx.array(vals.astype(np.float32))
    k = emulate.metal_kernel("halves", ["inp"], ["h", "b", "back"], HALF_SRC)
    h, b, back = k(
        inputs=[x],
        grid=(x.size, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[x.shape] * 3,
        output_dtypes=[mx.float16, mx.bfloat16, mx.float32],
    )
    np.testing.assert_array_equal(
        np.array(h.view(mx.uint16)), np.array(x.astype(mx.float16).view(mx.uint16))
    )
    np.testing.assert_array_equal(
        np.array(b.view(mx.uint16)), np.array(x.astype(mx.bfloat16).view(mx.uint16))
    )
    want = x.astype(mx.float16).astype(mx.float32) + x.astype(mx.bfloat16).astype(mx.float32)
    np.testing.assert_array_equal(np.array(back), np.array(want))


def test_exited_lanes_leave_simd_ops_but_not_barriers() -> None:
    src = """
    uint i = thread_position_in_grid.x;
    if (thread_index_in_simdgroup >= 16) { return; }
    out[i] = simd_sum(inp[i]);
    """
    k = emulate.metal_kernel("partial", ["inp"], ["out"], src)
    (out,) = k(
        inputs=[mx.ones((32,))],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(32,)],
        output_dtypes=[mx.float32],
    )
    assert np.array(out)[:16].tolist() == [16.0] * 16
    bad = emulate.metal_kernel(
        "early_exit",
        ["inp"],
        ["out"],
        src.replace(
            "out[i] = simd_sum(inp[i]);", "threadgroup_barrier(mem_flags::mem_threadgroup);"
        ),
    )
    with pytest.raises(emulate.EmulationError, match="exited"):
        bad(
            inputs=[mx.ones((32,))],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
        )


def test_threadgroup_memory_starts_poisoned_and_limits() -> None:
    src = """
    threadgroup float tile[8];
    out[thread_position_in_grid.x] = tile[thread_index_in_threadgroup];
    """
    k = emulate.metal_kernel("poison", ["inp"], ["out"], src)
    (out,) = k(
        inputs=[mx.ones((8,))],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8,)],
        output_dtypes=[mx.float32],
    )
    assert np.isnan(np.array(out)).all()
    big = emulate.metal_kernel("big", ["inp"], ["out"], src.replace("[8]", "[10000]"))
    with pytest.raises(emulate.EmulationError, match="32 KiB"):
        big(
            inputs=[mx.ones((8,))],
            grid=(8, 1, 1),
            threadgroup=(8, 1, 1),
            output_shapes=[(8,)],
            output_dtypes=[mx.float32],
        )
    with pytest.raises(emulate.EmulationError, match="1024"):
        k(
            inputs=[mx.ones((8,))],
            grid=(2048, 1, 1),
            threadgroup=(2048, 1, 1),
            output_shapes=[(8,)],
            output_dtypes=[mx.float32],
        )


def _mlx_generated(kernel: object, inputs: list, **launch: object) -> str:
    """The source MLX itself generates, printed while exporting (no Metal needed)."""
    import contextlib
    import io
    import os
    import tempfile

    def fn(*ins: mx.array) -> list:
        return kernel(inputs=list(ins), verbose=True, **launch)

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as cap:
        saved = os.dup(1)
        try:
            os.dup2(cap.fileno(), 1)
            with contextlib.redirect_stdout(io.StringIO()):
                mx.export_function(os.path.join(tmp, "k.mlxfn"), fn, *inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        cap.seek(0)
        out = cap.read()
    return out.split("```\n", 1)[1].rsplit("\n```", 1)[0]


def test_generated_source_matches_mlx() -> None:
    from dflash_mac.metal_kernels import kernels

    toy = kernels.KernelSpec(
        "toy",
        ("a", "s", "c"),
        ("o", "p"),
        "o[0] = a[a_ndim - 1] + s + c[c_shape[0] - 1] + float(a_strides[0]);\n"
        "p[thread_position_in_grid.x] = threads_per_simdgroup;",
        header="// header\n",
    )
    cases = [
        (
            kernels.conv_spec(),
            [mx.zeros((2, 3, 40)), mx.zeros((2, 40)), mx.zeros((2, 3, 2, 5))],
            [("T", mx.float32)],
            [mx.float32],
        ),
        (
            kernels.conv_spec(),
            [mx.zeros((2, 3, 40), mx.bfloat16)] * 3,
            [("T", mx.bfloat16)],
            [mx.bfloat16],
        ),
        (
            kernels.selector_spec(False),
            [
                mx.zeros((9, 2, 16)),
                mx.zeros((9, 2, 16), mx.int32),
                mx.zeros((9, 2, 64)),
                mx.zeros((5, 64), mx.float16),
                mx.zeros((5, 64), mx.float16),
                mx.zeros((9,), mx.int32),
            ],
            [("TOPK", 16), ("RANK", 64), ("NSG", 16)],
            [mx.int32, mx.int32],
        ),
        (
            toy,
            [mx.zeros((3, 4)), mx.array(1.0), mx.zeros((2,), mx.int32)],
            [],
            [mx.float32, mx.uint32],
        ),
    ]
    for spec, inputs, template, dtypes in cases:
        launch = dict(
            template=template,
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(2,)] * len(dtypes),
            output_dtypes=dtypes,
        )
        if not template:
            del launch["template"]
        try:
            want = _mlx_generated(spec.build(mx.fast.metal_kernel), inputs, **launch)
        except Exception as e:  # pragma: no cover - depends on the MLX build
            pytest.skip(f"MLX cannot show its generated source here: {e}")
        got = emulate.mlx_kernel_source(
            spec.name,
            spec.input_names,
            spec.output_names,
            spec.source,
            spec.header,
            inputs,
            dtypes,
            template,
        )[1]
        assert got == want, spec.name
