"""A lossy acceptance rule for the chi-square tests' negative controls."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def accepting_every_draft(real: Callable) -> Callable:
    """`real`'s signature (drafts, q, p, key) -> (accepted, bonus), accepting every draft
    (no rejection) and drawing the bonus as `real` does: a rule the tests must reject."""

    def accept_all(drafts, q, p, key):
        return mx.array(drafts.shape[0]), real(drafts, q, p, key)[1]

    return accept_all
