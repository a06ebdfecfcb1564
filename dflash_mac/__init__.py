"""dflash-mac: DFlash / DFlash 2 speculative decoding on MLX.

The Python API (`load`, `generate`, `stream_generate`) is imported on first use, so that the
CLI's help and its commands that do no math never import MLX."""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "generate", "load", "stream_generate"]


class _Package(types.ModuleType):
    """`dflash_mac.generate` is the function even once the submodule of the same name is
    imported (the import system would otherwise replace the attribute with the module)."""

    @property
    def generate(self) -> Any:
        return import_module(".generate", __name__).generate

    @generate.setter
    def generate(self, value: Any) -> None:  # the submodule being registered: keep the function
        pass

    @property
    def stream_generate(self) -> Any:
        return import_module(".generate", __name__).stream_generate

    @property
    def load(self) -> Any:
        return import_module(".loading", __name__).load


sys.modules[__name__].__class__ = _Package
