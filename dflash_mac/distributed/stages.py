"""Pipeline parallel: the drafter's target layers live on different stages (ranks).

mlx-lm's `pipeline(group)` gives rank 0 the LAST layers and the highest rank the first ones.
Each rank captures the selected layers it holds, puts zeros where the others' go, and one
`all_sum` gives every rank the full features (adding zeros is exact). That all_sum is tied
after the forward's own collectives and before its logits are used (`mx.depends` both ways), so
every rank that evaluates the logits runs it at the same place in the order. Rank 0's decode
cycle reads them through its pair's mirror (`Leader.features`), not from its own layers."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from ..target.capture import FeatureCapture
from ..target.structure import text_model


class StageCapture:
    """Per-instance capture of the local selected layers of one pipeline stage, for the life
    of the process (entered once)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], group, hidden: int):
        inner = text_model(model).model
        start, end = inner.start_idx, inner.end_idx
        self.layer_ids, self.group, self.hidden = list(layer_ids), group, hidden
        local = {i: inner.layers[i] for i in set(layer_ids) if start <= i < end}
        self.capture = FeatureCapture(None, self.layer_ids, layers=local).__enter__()
        self.local = set(local)
        self.gathered: mx.array | None = None  # the full features of the last forward
        self.dtype = inner.embed_tokens(mx.array([[0]])).dtype  # the hidden states' dtype

    def gather(self, logits: mx.array) -> mx.array:
        """Full features of the forward that gave `logits`; returns logits tied to them."""
        B, n = logits.shape[:2]
        parts = []
        for i in self.layer_ids:
            if i in self.local:
                parts.append(self.capture.output(i))
            else:
                parts.append(mx.zeros((B, n, self.hidden), dtype=self.dtype))
        local = mx.depends(mx.concatenate(parts, axis=-1), logits)
        self.gathered = mx.distributed.all_sum(local, group=self.group)
        return mx.depends(logits, self.gathered)

    def features(self) -> mx.array:
        """The full features of the last forward (what rank 0's FeatureCapture returns)."""
        return self.gathered
