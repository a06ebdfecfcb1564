"""Rolling the target back after a partial acceptance (SPEC §6 step 5)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache


class RollbackError(RuntimeError):
    """The target's cache cannot be rolled back; the message is one sentence for the user."""


def check_rollback_support(cache: list[Any]) -> None:
    """Fail early for caches the runtime cannot roll back yet."""
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise RollbackError(
            f"this target uses non-trimmable caches ({', '.join(kinds)}), which DFlash "
            "cannot roll back yet."
        )


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
