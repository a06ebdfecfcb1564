"""What the doctor looks at on this machine, gathered once: platform, MLX versions, Metal,
kernels, BLAS, memory, the Hugging Face cache."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_mac.host import cpu_name


@dataclass
class Facts:
    """What the checks look at, gathered once (tests build their own)."""

    system: str
    machine: str
    chip: str
    macos: str
    mlx: str
    mlx_lm: str
    metal: bool
    kernels: str
    kernels_error: str
    blas: str
    memory_bytes: int
    budget_bytes: int
    hf_cache: Path
    offline: bool


def _device_info() -> dict:
    import mlx.core as mx

    for get in (getattr(mx, "device_info", None), getattr(mx.metal, "device_info", None)):
        try:
            if get is not None:
                return dict(get())
        except Exception:
            continue
    return {}


def _chip(info: dict) -> str:
    if name := info.get("device_name"):
        return str(name)
    return cpu_name()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _kernels() -> tuple[str, str]:
    from dflash_mac.metal_kernels import kernels_in_use

    try:
        return kernels_in_use(), ""
    except ValueError as e:  # e.g. an invalid DFLASH_MAC_KERNELS
        return "error", str(e)


def gather_facts() -> Facts:
    """Look at this machine once."""
    import mlx.core as mx

    from dflash_mac.host import blas_in_use

    from .models import hf_cache_dir

    try:
        from importlib.metadata import version

        mlx_lm = version("mlx-lm")
    except Exception:
        mlx_lm = "missing"
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        metal = False
    info = _device_info()
    memory = int(info.get("memory_size") or _physical_memory())
    budget = int(info.get("max_recommended_working_set_size") or 0.75 * memory)
    kernels, kernels_error = _kernels()
    return Facts(
        system=sys.platform,
        machine=platform.machine(),
        chip=_chip(info),
        macos=platform.mac_ver()[0],
        mlx=mx.__version__,
        mlx_lm=mlx_lm,
        metal=metal,
        kernels=kernels,
        kernels_error=kernels_error,
        blas=blas_in_use(),
        memory_bytes=memory,
        budget_bytes=budget,
        hf_cache=hf_cache_dir(),
        offline=os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"),
    )
