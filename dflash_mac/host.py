"""Machine facts: BLAS in use (and OpenBLAS preloading on Linux), device, kernels."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


OPENBLAS_ENV = "DFLASH_MAC_OPENBLAS"  # an OpenBLAS outside the system's folders (conda, a build)


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS shared library on Linux, if any: the file
    `DFLASH_MAC_OPENBLAS` names where it is set (None if it is no file), else the system's."""
    if sys.platform != "linux":
        return None
    if given := os.environ.get(OPENBLAS_ENV):
        return given if Path(given).is_file() else None
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


OPENBLAS_INSTALL = "sudo apt-get install libopenblas0-pthread"  # Debian / Ubuntu


def slow_blas_note() -> str | None:
    """One line for a Linux machine without OpenBLAS (MLX's CPU wheel then runs its reference
    BLAS: decoding about half as fast, and `auto` rarely finds drafting worth it); None where
    OpenBLAS is there, on macOS, or when DFLASH_MAC_BLAS=reference asks for the reference."""
    if sys.platform != "linux" or find_openblas() or os.environ.get("DFLASH_MAC_BLAS"):
        return None
    slow = "MLX runs on its slow reference BLAS here (about half the decode speed; drafting "
    if given := os.environ.get(OPENBLAS_ENV):
        return f"{OPENBLAS_ENV} names {given}, which is no file: {slow}rarely pays)."
    return f"{slow}rarely pays): install OpenBLAS with `{OPENBLAS_INSTALL}`."


def blas_in_use() -> str:
    """Which BLAS this process runs MLX's CPU matmuls on."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if "libopenblas" in maps:
        return "OpenBLAS"
    return "reference BLAS (MLX wheel)"


def blas_threads() -> int:
    """OpenBLAS threads dflash-mac asks for: one per core (see the re-exec's comment)."""
    return max(1, os.cpu_count() or 1)


def maybe_reexec_with_openblas(argv: list[str]) -> None:
    """On Linux, restart the CLI with OpenBLAS preloaded (MLX's CPU wheel's own BLAS is far
    slower: docs/bench.md, "Pipelined cycle").

    Skipped when OpenBLAS is absent, already loaded, or DFLASH_MAC_BLAS=reference."""
    lib = find_openblas()
    if not lib or os.environ.get("DFLASH_MAC_BLAS") == "reference":
        return
    if lib in os.environ.get("LD_PRELOAD", "") or os.environ.get("_DFLASH_MAC_REEXEC"):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env["_DFLASH_MAC_REEXEC"] = "1"
    # One thread per core decodes faster than leaving one to the host (docs/bench.md, "Pipelined
    # cycle"); a count set in OPENBLAS_NUM_THREADS is kept.
    env.setdefault("OPENBLAS_NUM_THREADS", str(blas_threads()))
    script = sys.argv[0]
    if script.endswith("__main__.py") or not Path(script).is_file():
        os.execve(sys.executable, [sys.executable, "-m", "dflash_mac", *argv], env)
    os.execve(sys.executable, [sys.executable, script, *argv], env)


HOME_ENV = "DFLASH_MAC_HOME"


def data_dir() -> Path:
    """dflash-mac's data directory (created on first use): $DFLASH_MAC_HOME, else the platform's
    user data dir (~/Library/Application Support/dflash-mac, XDG on Linux)."""
    if env := os.environ.get(HOME_ENV):
        path = Path(env).expanduser()
    else:
        from platformdirs import user_data_dir

        path = Path(user_data_dir("dflash-mac", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same folder (made if needed), so
    a process reading it never sees half a file and two writers never share a temporary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cpu_name() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    return "gpu" if dev == mx.gpu else "cpu"


def machine_key() -> str:
    """What a cost curve was measured on: the device, the CPU and, on the CPU, the BLAS. The
    reference BLAS times a block-8 verify at ~9 plain steps where OpenBLAS takes ~1.7, so a curve
    from one priced every draft and copy out under the other (a first run before
    libopenblas0-pthread was installed)."""
    device = device_name()
    key = f"{device}-{cpu_name()}"
    return key if device == "gpu" else f"{key}-{blas_in_use()}"


def machine_summary() -> dict:
    import mlx.core as mx

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:
        mlx_lm_version = "?"
    return {
        "machine": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "device": device_name(),
        "blas": blas_in_use(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "cpu_count": os.cpu_count(),
    }
