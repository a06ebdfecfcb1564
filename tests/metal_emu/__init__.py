"""CPU emulation harness for the MLX custom Metal kernels (see docs/kernels.md)."""
