"""What the engine needs from a loaded pair (`loading.LoadedPair` is the real one; tests build
their own): a target, a bound drafter, a tokenizer and a few derived facts."""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache

from .models.config import DraftConfig


class Drafter(Protocol):
    """A DFlash / DFlash 2 drafter bound to its target's embedding and LM head."""

    config: DraftConfig

    def make_cache(self) -> list[KVCache]: ...

    def extend_context(self, features: mx.array, cache: list[KVCache]) -> None: ...

    def __call__(self, block_ids: mx.array, cache: list[KVCache]) -> mx.array: ...


class Pair(Protocol):
    """A target and its drafter, ready to decode."""

    target: nn.Module
    drafter: Drafter
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    model_id: str
    draft_id: str
    block_size: int
    target_config: dict

    @property
    def layer_ids(self) -> list[int]: ...

    @property
    def eos_ids(self) -> set[int]: ...

    @property
    def kind(self) -> str: ...

    @property
    def quantized(self) -> bool: ...

    @property
    def context_length(self) -> int: ...
