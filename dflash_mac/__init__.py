"""dflash-mac: DFlash / DFlash 2 speculative decoding on MLX.

The Python API (`load`, `generate`, `stream_generate`) is imported on first use through a
module-level `__getattr__`, so that the CLI's help and its commands that do no math never
import MLX. `import dflash_mac.<module>` always gives the module."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "generate", "load", "stream_generate"]

_LAZY = {"generate": ".api", "stream_generate": ".api", "load": ".loading.loader"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
