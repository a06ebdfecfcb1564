"""Rolling the target back after a partial acceptance (docs/design.md §6 step 5)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from mlx import nn

from ..errors import RollbackError
from .kvwindow import WindowKVCache


def trim_caches(cache: list[Any], n: int) -> None:
    """Drop the last `n` positions from every cache; every cache must trim exactly `n`."""
    if n <= 0:
        return
    for c in cache:
        trimmed = c.trim(n)
        if trimmed != n:
            raise RollbackError(
                f"{type(c).__name__} trimmed {trimmed} of {n} rejected positions; "
                "the target cache would no longer match the committed tokens."
            )


class TargetRollback:
    """Rolls one target cache back to the committed tokens after each verify.

    Trimmable caches (attention, a `kvwindow.WindowKVCache` too) are trimmed; the GatedDeltaNet
    caches of hybrid targets are restored by replaying the recurrence over the accepted steps
    (dflash_mac/target/hybrid.py). Use: `with rb.hooks(): ... rb.before_verify();
    target(block, cache); rb.rollback(rejected, acc)`. No host sync: everything stays lazy on the
    caller's stream."""

    def __init__(self, model: nn.Module, cache: list[Any], strategy: str = "replay"):
        self.cache = cache
        self.windows = [c for c in cache if isinstance(c, WindowKVCache)]
        fixed = [i for i, c in enumerate(cache) if not c.is_trimmable()]
        self.trimmable = [c for i, c in enumerate(cache) if i not in fixed]
        self.gdn = None
        if fixed:  # a hybrid target: linear-attention layers hold state caches
            from .hybrid import GDNRollback, linear_layers

            layers = linear_layers(model, cache)
            assert [i for i, _ in layers] == fixed, "every state cache needs a captured layer"
            self.gdn = GDNRollback(layers, cache, strategy)

    @property
    def hybrid(self) -> bool:
        return self.gdn is not None

    def hooks(self):
        """Context manager: per-instance capture hooks for one request (removed on exit)."""
        return self.gdn if self.gdn is not None else nullcontext()

    def before_verify(self) -> None:
        for c in self.windows:  # a rotating window masks each verified position as plain decoding
            c.stepwise = True
        if self.gdn is not None:
            self.gdn.arm()

    def rollback(self, n_rejected: int, acc: int) -> None:
        """After a verify pass of `acc + 1 + n_rejected` positions keep the first `acc + 1`."""
        if self.gdn is not None:
            captured = self.gdn.captured()
            assert captured == len(self.gdn.records), (
                f"only {captured} of {len(self.gdn.records)} linear-attention layers were "
                "captured during verify"
            )
            self.gdn.keep(acc + 1)
        trim_caches(self.trimmable, n_rejected)

    def trim(self, n: int) -> None:
        """Drop the last `n` cached positions (hybrids: only those of the last verify)."""
        if n <= 0:
            return
        if self.gdn is not None:
            window = self.gdn.window()
            if window is None or n > window:
                raise RollbackError(
                    f"this hybrid target's linear-attention state cannot be cut back {n} "
                    "tokens; the prompt must be prefilled again."
                )
            self.gdn.keep(window - n)
        trim_caches(self.trimmable, n)
