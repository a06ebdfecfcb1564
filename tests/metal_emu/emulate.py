"""CPU emulation of MLX custom Metal kernels (`mx.fast.metal_kernel`) with g++.

`metal_kernel(...)` is a drop-in for `mx.fast.metal_kernel`: it generates the kernel source
exactly as MLX does (signature from input/output names, dtypes, shape/stride/ndim arguments
and thread attributes found in the body, template parameters and instantiation), compiles
it against `metal_shim.h` and `emu_runtime.cpp`, and runs the grid on fibers (one per Metal
thread; barriers and SIMD-group ops synchronise like on a GPU). Each launch runs under
several thread schedules and must give identical bytes; otherwise `EmulationRaceError`.
Binaries are cached by source hash in `$DFLASH_MAC_EMU_CACHE` (default: a temp dir).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .codegen import TYPES, mlx_kernel_source, translation_unit

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-pthread", "-O1", "-Wall", "-Wno-attributes", "-Wno-unknown-pragmas"]
SCHEDULES = {"forward": 0, "reverse": 1, "shuffle": 2}
_LOCKS: dict[str, threading.Lock] = {}


class EmulationError(RuntimeError):
    """The emulated kernel failed (crash, deadlock, divergent barrier, bad launch)."""


class EmulationCompileError(EmulationError):
    """The kernel source does not compile against the Metal shim."""


class EmulationRaceError(EmulationError):
    """Outputs differ between thread schedules: a missing barrier or a data race."""


def have_compiler() -> bool:
    return shutil.which(CXX) is not None


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"dflash-mac-metal-emu-{os.getuid()}"
    path = Path(os.environ.get("DFLASH_MAC_EMU_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run_compiler(args: list[str], what: str) -> None:
    res = subprocess.run([CXX, *CXXFLAGS, f"-I{HERE}", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise EmulationCompileError(f"{what}:\n{res.stderr[-6000:]}")


def _cached(name: str, key_text: str, build: Any) -> Path:
    key = hashlib.sha256("\0".join([key_text, CXX, *CXXFLAGS]).encode()).hexdigest()[:24]
    out = cache_dir() / f"{name}-{key}"
    with _LOCKS.setdefault(out.name, threading.Lock()):
        if not out.exists():
            tmp = out.with_name(f"{out.name}.{os.getpid()}-{threading.get_ident()}.tmp")
            build(tmp)
            os.replace(tmp, out)
    return out


def _runtime_object() -> Path:
    deps = "\0".join((HERE / f).read_text() for f in ("emu_abi.h", "emu_runtime.cpp"))
    return _cached(
        "runtime",
        deps,
        lambda tmp: _run_compiler(
            ["-c", str(HERE / "emu_runtime.cpp"), "-o", str(tmp)], "emu_runtime.cpp failed"
        ),
    )


def _compile(tu: str) -> Path:
    """Compile (cached by hash of everything that goes in) and return the binary path."""
    runtime = _runtime_object()
    deps = "\0".join((HERE / f).read_text() for f in ("metal_shim.h", "emu_abi.h"))

    def build(tmp: Path) -> None:
        src = tmp.with_suffix(".cpp")
        src.write_text(tu)
        _run_compiler(
            [str(src), str(runtime), "-o", str(tmp)],
            f"kernel does not compile against the Metal shim ({src})",
        )
        src.unlink()

    return _cached("kernel", "\0".join([tu, deps, runtime.name]), build)


def _raw(a: mx.array) -> np.ndarray:
    a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.ascontiguousarray(np.array(a))


class EmulatedKernel:
    """Same call interface as the object `mx.fast.metal_kernel` returns."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        schedules: Sequence[str] = ("forward", "reverse"),
        seed: int = 0,
    ) -> None:
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        if atomic_outputs or not ensure_row_contiguous:
            raise NotImplementedError(
                "the emulator supports ensure_row_contiguous=True and atomic_outputs=False"
            )
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.schedules, self.seed = list(schedules), seed

    def build(
        self,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] = (),
    ) -> Path:
        """Compile this kernel for these input/output dtypes and template arguments."""
        kname, text = mlx_kernel_source(
            self.name,
            self.input_names,
            self.output_names,
            self.source,
            self.header,
            inputs,
            output_dtypes,
            template,
        )
        tu = translation_unit(
            kname, text, self.input_names, inputs, output_dtypes, self.source, template
        )
        return _compile(tu)

    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[Any],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: Any = None,
    ) -> list[mx.array]:
        inputs = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size "
                f"{len(self.input_names)} but got size {len(inputs)}."
            )
        template = list(template or [])
        if verbose:
            print(
                mlx_kernel_source(
                    self.name,
                    self.input_names,
                    self.output_names,
                    self.source,
                    self.header,
                    inputs,
                    output_dtypes,
                    template,
                )[1]
            )
        binary = self.build(inputs, output_dtypes, template)
        tg = tuple(min(t, g) for t, g in zip(threadgroup, grid))  # as MLX's dispatch
        if tg[0] * tg[1] * tg[2] > 1024:
            raise EmulationError(
                f"Thread group size ({tg[0] * tg[1] * tg[2]}) is greater "
                "than the maximum allowed threads per threadgroup (1024)."
            )
        bufs = [_raw(a) for a in inputs]
        for shape, dtype in zip(output_shapes, output_dtypes):
            np_t = TYPES[dtype][1]
            if init_value is None:  # poison: MLX leaves outputs uninitialised
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_t).itemsize
                bufs.append(np.frombuffer(b"\xff" * nbytes, np_t).reshape(tuple(shape)))
            else:
                bufs.append(_raw(mx.full(tuple(shape), init_value, dtype)))
        blob = [b"DFEMU01\0", struct.pack("<6i", *grid, *tg)]
        blob.append(
            struct.pack(
                f"<i{len(self.schedules)}i",
                len(self.schedules),
                *[SCHEDULES[s] for s in self.schedules],
            )
        )
        blob.append(struct.pack("<Iii", self.seed, len(bufs), len(inputs)))
        for b in bufs:
            strides = [s // b.itemsize for s in b.strides]
            blob.append(struct.pack(f"<i{b.ndim}i{b.ndim}qq", b.ndim, *b.shape, *strides, b.nbytes))
            blob.append(b.tobytes())
        with tempfile.TemporaryDirectory(prefix="metal-emu-") as tmp:
            launch, result = Path(tmp) / "launch.bin", Path(tmp) / "out.bin"
            launch.write_bytes(b"".join(blob))
            res = subprocess.run(
                [str(binary), str(launch), str(result)], capture_output=True, text=True, timeout=300
            )
            if res.returncode != 0:
                raise EmulationError(
                    f"emulated kernel {self.name!r} failed "
                    f"(exit {res.returncode}): {res.stderr.strip()}"
                )
            data = result.read_bytes()
        return self._outputs(data, bufs[len(inputs) :], output_dtypes)

    def _outputs(
        self, data: bytes, templates: list[np.ndarray], dtypes: Sequence[Any]
    ) -> list[mx.array]:
        per_run = sum(t.nbytes for t in templates)
        runs = [data[i * per_run : (i + 1) * per_run] for i in range(len(self.schedules))]
        for s, run in zip(self.schedules[1:], runs[1:]):
            if run != runs[0]:
                off = 0
                for name, t in zip(self.output_names, templates):
                    a = np.frombuffer(runs[0][off : off + t.nbytes], t.dtype)
                    b = np.frombuffer(run[off : off + t.nbytes], t.dtype)
                    bad = np.flatnonzero(~_same(a, b))
                    if len(bad):
                        raise EmulationRaceError(
                            f"kernel {self.name!r}: output {name!r} differs between the "
                            f"{self.schedules[0]} and {s} thread schedules (first at flat "
                            f"index {int(bad[0])}): a missing barrier or a data race"
                        )
                    off += t.nbytes
        outs, off = [], 0
        for t, d in zip(templates, dtypes):
            arr = np.frombuffer(runs[0][off : off + t.nbytes], t.dtype).reshape(t.shape)
            off += t.nbytes
            out = mx.array(arr.copy())
            outs.append(out.view(d) if d == mx.bfloat16 else out)
        return outs


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise bit equality."""
    width = a.itemsize
    ua = np.frombuffer(a.tobytes(), f"u{width}") if width in (1, 2, 4, 8) else a
    ub = np.frombuffer(b.tobytes(), f"u{width}") if width in (1, 2, 4, 8) else b
    return ua == ub


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: Any = None,
    **kwargs: Any,
) -> EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel` that runs on the CPU emulator (IEEE math whatever
    `compile_options`; extra keywords: `schedules`, `seed`)."""
    return EmulatedKernel(
        name,
        input_names,
        output_names,
        source,
        header,
        ensure_row_contiguous,
        atomic_outputs,
        **kwargs,
    )
