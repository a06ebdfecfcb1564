"""dflash-mac: DFlash / DFlash 2 speculative decoding on MLX."""

__version__ = "0.1.0"

from .generate import generate, stream_generate
from .loading import load

__all__ = ["__version__", "generate", "load", "stream_generate"]
