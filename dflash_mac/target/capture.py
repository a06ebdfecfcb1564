"""Target adapter: per-instance capture of decoder-layer outputs.

Capture hooks the selected layer INSTANCES (hooks.py: a per-instance `__class__` swap whose
`__call__` records the output); the original class is untouched, parameter paths are unchanged
(quantize / save still work) and leaving the context restores the instances exactly.

The same hook can queue each layer's output as soon as it is built (`queue=True`): where MLX
throttles `mx.async_eval` (the CPU backend blocks it until all but a few dozen ops of the graph
have run), a forward pass queued whole leaves the device idle while Python builds the next one
and while the host does its bookkeeping. Queued per layer, the device starts on layer 1 while
Python builds layer 2. `queues_layers()` says where that is done.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx import nn

from . import hooks
from .structure import decoder_layers


class _Sink:
    """The capture hook of one layer: its output of the current forward pass, shared by every
    capture entered on the layer (interleaved streams)."""

    __slots__ = ("out", "queuers")

    def __init__(self) -> None:
        self.out: mx.array | None = None
        self.queuers = 0  # live captures that queue the output as it is built

    def __call__(self, layer: nn.Module, call: Callable, *args, **kwargs):
        out = call(*args, **kwargs)
        self.out = out[0] if isinstance(out, tuple) else out
        if self.queuers:
            mx.async_eval(self.out)
        return out


def queues_layers() -> bool:
    """True where decoding queues each target layer as it is built: MLX's CPU backend, whose
    scheduler makes `async_eval` wait for all but a few dozen ops. On Metal `async_eval` returns
    at once, so one queue per pass already overlaps the host with the device."""
    return mx.default_device() == mx.cpu


class FeatureCapture:
    """Context manager capturing the outputs of `layer_ids` on this model instance only."""

    def __init__(
        self,
        model: nn.Module | None,
        layer_ids: list[int],
        layers: dict | None = None,
        queue: bool = False,
        features: Callable[[], mx.array] | None = None,
    ):
        """Capture `layer_ids` of `model`, or of the given {layer id: module}; with `queue`,
        hook every decoder layer and queue its output as it is built (module docstring). Given
        `features` (a pipeline-parallel target gathers its own: `pair.Mirror.features`), hook
        nothing, queue nothing, and `features()` returns what it returns."""
        self.layer_ids = list(layer_ids)
        self._own = features
        self._active = False
        self.queue = queue and features is None
        self._sinks: dict[int, _Sink] = {}
        if features is not None:
            self._layers = {}
            return
        if layers is None:
            found = decoder_layers(model)
            bad = [i for i in layer_ids if not 0 <= i < len(found)]
            if bad:
                raise ValueError(
                    f"target layer ids {bad} are out of range for {len(found)} layers."
                )
            wanted = range(len(found)) if self.queue else set(layer_ids)
            layers = {i: found[i] for i in wanted}
        self._layers = layers

    def __enter__(self) -> FeatureCapture:
        """Hook the layers; captures on the same instance (interleaved streams) share one hook,
        read right after their own forward pass."""
        for i, layer in self._layers.items():
            sink = hooks.install(layer, hooks.find(layer, _Sink) or _Sink())
            sink.queuers += self.queue
            self._sinks[i] = sink
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Release the hooks; the last capture out restores the instances (idempotent)."""
        if not self._active:
            return
        self._active = False
        for i, layer in self._layers.items():
            sink = self._sinks.pop(i)
            sink.queuers -= self.queue
            hooks.remove(layer, sink)

    def features(self) -> mx.array:
        """Concatenated features of the last forward pass, `[B, L, n_tgt * H]`."""
        if self._own is not None:
            return self._own()
        return mx.concatenate([self._sinks[i].out for i in self.layer_ids], axis=-1)

    def output(self, i: int) -> mx.array:
        """The last forward pass's output of captured layer `i`."""
        return self._sinks[i].out


def layer_queue(model: nn.Module) -> FeatureCapture:
    """Queue `model`'s layers as they are built where the engine does (`queues_layers`),
    capturing nothing: plain decoding as the bench's baseline runs it (no hook elsewhere)."""
    return FeatureCapture(model, [], queue=queues_layers())
