"""Dispatch between the DFlash 2 Metal kernels and the MLX reference ops."""

from __future__ import annotations

import dflash_mac.metal_kernels as mk
import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.metal_kernels import kernels, reference

HAVE_METAL = mk._metal_available()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mk.ENV_VAR, raising=False)


def sel_args(B: int = 2, P: int = 4, k: int = 8, R: int = 16, V: int = 30) -> list[mx.array]:
    ks = mx.random.split(mx.random.key(3), 6)
    return [
        mx.random.normal((B, P, k), key=ks[0]),
        mx.random.randint(0, V, (B, P, k), key=ks[1]).astype(mx.int32),
        mx.random.normal((B, P, R), key=ks[2]),
        mx.random.normal((V, R), key=ks[3]),
        mx.random.normal((V, R), key=ks[4]),
        mx.random.randint(0, V, (B,), key=ks[5]).astype(mx.int32),
    ]


@pytest.mark.skipif(HAVE_METAL, reason="checks the non-Metal default")
def test_reference_without_metal() -> None:
    assert mk.kernels_in_use() == "reference"
    assert mk._metal_kernel(kernels.conv_spec()) is None  # factories: None without Metal


@pytest.mark.skipif(not HAVE_METAL, reason="needs Metal")
def test_metal_on_gpu_default_device() -> None:
    with mx.stream(mx.gpu):
        assert mk.kernels_in_use() == "metal"
    with mx.stream(mx.cpu):
        assert mk.kernels_in_use() == "reference"
    assert mk._metal_kernel(kernels.conv_spec()) is mk._metal_kernel(kernels.conv_spec())


def test_env_forces_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mk.ENV_VAR, "reference")
    assert mk.kernels_in_use() == "reference"
    monkeypatch.setenv(mk.ENV_VAR, " Reference ")
    assert mk.kernels_in_use() == "reference"


def test_env_rejects_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mk.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="DFLASH_MAC_KERNELS='cuda' is not valid"):
        mk.kernels_in_use()


@pytest.mark.skipif(HAVE_METAL, reason="checks the error without Metal")
def test_forcing_metal_without_metal_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mk.ENV_VAR, "metal")
    msg = "DFLASH_MAC_KERNELS=metal forces the Metal kernels, but Metal is not available"
    with pytest.raises(ValueError, match=msg):
        mk.kernels_in_use()
    x = mx.zeros((1, 2, 32))
    with pytest.raises(ValueError, match=msg):
        mk.dynamic_conv(x, mx.zeros((2, 32)), mx.zeros((1, 2, 2, 2)), 16)
    with pytest.raises(ValueError, match=msg):
        mk.selector_walk(*sel_args())


def test_public_api_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mk.ENV_VAR, "reference")
    x = mx.random.normal((2, 5, 48))
    base, dyn = mx.random.normal((2, 48)), mx.random.normal((2, 5, 2, 3))
    assert mx.array_equal(
        mk.dynamic_conv(x, base, dyn, 16), reference.dynamic_conv(x, base, dyn, 16)
    )
    args = sel_args()
    path, index, q = mk.selector_walk(*args)
    rpath, rindex, _ = reference.selector_walk(*args)
    assert q is None and mx.array_equal(path, rpath) and mx.array_equal(index, rindex)
    assert path.dtype == mx.int32 and index.dtype == mx.int32
    path, index, q = mk.selector_walk(*args, temperature=0.8)  # uniforms drawn internally
    assert q.shape == (2, 4, 8) and q.dtype == mx.float32
    np.testing.assert_allclose(np.array(q.sum(-1)), 1.0, rtol=1e-5)
    cand = np.array(args[1])
    assert (
        np.take_along_axis(cand, np.array(index)[..., None], -1)[..., 0] == np.array(path)
    ).all()


def test_conv_semantics_small() -> None:
    """Two taps, zeros before the block start, group coefficients over contiguous channels."""
    x = mx.array([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]])  # B=1, L=2, H=4
    base = mx.array([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    dyn = mx.array([[[[1.0, 2.0], [0.0, 10.0]], [[0.0, 0.0], [1.0, 0.0]]]])  # [1, 2, 2, 2]
    out = mk.dynamic_conv(x, base, dyn, 2)
    want = [[2.0, 4.0, 9.0, 12.0], [5.0 + 0.5 + 1.0, 6.0 + 1.0 + 2.0, 7.0 + 1.5, 8.0 + 2.0]]
    assert np.array(out)[0].tolist() == want


def test_argument_errors() -> None:
    x = mx.zeros((1, 2, 32))
    with pytest.raises(ValueError, match="must divide the hidden size"):
        mk.dynamic_conv(x, mx.zeros((2, 32)), mx.zeros((1, 2, 2, 2)), 5)
    with pytest.raises(ValueError, match="shapes do not match"):
        mk.dynamic_conv(x, mx.zeros((2, 32)), mx.zeros((1, 2, 2, 3)), 16)
    args = sel_args()
    with pytest.raises(ValueError, match="uniforms must be"):
        mk.selector_walk(*args, temperature=1.0, uniforms=mx.zeros((2, 3)))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        mk.selector_walk(*args, temperature=-1.0)
    with pytest.raises(ValueError, match="rank"):
        mk.selector_walk(args[0], args[1], mx.zeros((2, 4, 7)), *args[3:])


@pytest.mark.skipif(HAVE_METAL, reason="checks the non-Metal default")
def test_compiled_reference_equals_the_reference_ops() -> None:
    """Without Metal the dispatch runs the reference ops under mx.compile: bit-identical
    results for every block width, greedy and sampled, and one compiled walk serves every
    temperature (the temperature is an input, not a constant baked in at the first call)."""
    for L in (1, 2, 5, 8):
        x = mx.random.normal((1, L, 48), key=mx.random.key(L))
        base = mx.random.normal((2, 48), key=mx.random.key(10 + L))
        dyn = mx.random.normal((1, L, 2, 3), key=mx.random.key(20 + L))
        got, want = mk.dynamic_conv(x, base, dyn, 16), reference.dynamic_conv(x, base, dyn, 16)
        assert mx.array_equal(got, want)
    args = sel_args(B=1, P=7, k=16)
    path, index, q = mk.selector_walk(*args)
    rpath, rindex, _ = reference.selector_walk(*args)
    assert q is None and mx.array_equal(path, rpath) and mx.array_equal(index, rindex)
    u = mx.random.uniform(shape=(1, 7), key=mx.random.key(5))
    qs = []
    for temp in (0.5, 1.0, 0.5):
        got = mk.selector_walk(*args, temperature=temp, uniforms=u)
        want = reference.selector_walk(*args, temperature=temp, uniforms=u)
        assert all(mx.array_equal(a, b) for a, b in zip(got, want))
        qs.append(got[2])
    assert not mx.allclose(qs[0], qs[1]) and mx.array_equal(qs[0], qs[2])
