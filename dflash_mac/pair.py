"""What the engine needs from a loaded pair (`loading.loader.LoadedPair` is the real one; tests
build their own): a target, a bound drafter, a tokenizer, a few derived facts, and the mirror of
a target sharded over several ranks (distribution plugs in from above: the engine imports
nothing of dflash_mac/distributed/)."""

from __future__ import annotations

from collections.abc import Callable
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


class Mirror(Protocol):
    """The other ranks of a distributed target, as the decode cycle sees them (rank 0's
    `distributed.leader.Leader`); every forward of the target is mirrored by its own hook."""

    # The drafter's features of the last forward where the ranks gather them (pipeline
    # parallel); None: capture the target's layers as usual (FeatureCapture's `features=`).
    features: Callable[[], mx.array] | None

    def facts(self) -> dict:
        """The distributed facts for the stats (ranks, parallel mode, collectives)."""
        ...

    def idle(self) -> None:
        """A request ended, however it ended: nothing is in flight any more."""
        ...

    def settle(self, cache: list) -> None:
        """After a request: every rank's copy of `cache` at the same length."""
        ...


class Pair(Protocol):
    """A target and its drafter, ready to decode."""

    target: nn.Module
    drafter: Drafter
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    model_id: str
    draft_id: str
    block_size: int
    target_config: dict
    mirror: Mirror | None  # a target sharded over several ranks; None in one process

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
