"""Target adapter: per-instance capture of decoder-layer outputs, embedding and LM head.

Capture swaps the `__class__` of the selected layer INSTANCES to a cached subclass whose
`__call__` records the output; the original class is untouched, parameter paths are unchanged
(quantize / save still work) and leaving the context restores the instances exactly.

The same hook can queue each layer's output as soon as it is built (`queue=True`): where MLX
throttles `mx.async_eval` (the CPU backend blocks it until all but a few dozen ops of the graph
have run), a forward pass queued whole leaves the device idle while Python builds the next one
and while the host does its bookkeeping. Queued per layer, the device starts on layer 1 while
Python builds layer 2. `queues_layers()` says where that is done.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .models.dflash import TargetHead

_CAPTURING: dict[type, type] = {}


class _Sink:
    """Holds captured outputs of one layer for the current forward pass."""

    __slots__ = ("out", "orig", "users", "queuers")

    def __init__(self, orig: type) -> None:
        self.out: mx.array | None = None
        self.orig, self.users = orig, 0  # class to restore; live captures sharing the hook
        self.queuers = 0  # live captures that queue the output as it is built


def _capturing_class(cls: type) -> type:
    if cls not in _CAPTURING:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            sink = self._dflash_sink
            sink.out = out[0] if isinstance(out, tuple) else out
            if sink.queuers:
                mx.async_eval(sink.out)
            return out

        _CAPTURING[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _CAPTURING[cls]


def queues_layers() -> bool:
    """True where decoding queues each target layer as it is built: MLX's CPU backend, whose
    scheduler makes `async_eval` wait for all but a few dozen ops. On Metal `async_eval` returns
    at once, so one queue per pass already overlaps the host with the device."""
    return mx.default_device() == mx.cpu


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The target's decoder layers (on qwen3_5 `model.layers` is a fresh list of the same
    module objects, which is all we need)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if not layers:
        raise ValueError("the target model exposes no decoder layers (`model.layers`).")
    return list(layers)


def text_model(model: nn.Module) -> nn.Module:
    """The language-model part of a (possibly multimodal) mlx-lm model."""
    return getattr(model, "language_model", model)


def target_head(model: nn.Module) -> TargetHead:
    """The target's token embedding and LM head, with its logit scale / softcap if any."""
    tm = text_model(model)
    inner = tm.model
    embed = inner.embed_tokens
    args = getattr(tm, "args", None)
    lm_head = getattr(tm, "lm_head", None)
    if lm_head is None or getattr(args, "tie_word_embeddings", False):
        lm_head = embed.as_linear
    scale = getattr(args, "logits_scaling", None) or 1.0
    softcap = getattr(args, "final_logit_softcapping", None)
    return TargetHead(embed, lm_head, 1.0 / scale if scale != 1.0 else 1.0, softcap)


class FeatureCapture:
    """Context manager capturing the outputs of `layer_ids` on this model instance only."""

    def __init__(
        self,
        model: nn.Module | None,
        layer_ids: list[int],
        layers: dict | None = None,
        queue: bool = False,
    ):
        """Capture `layer_ids` of `model`, or of the given {layer id: module}; with `queue`,
        hook every decoder layer and queue its output as it is built (module docstring). A
        model that gathers its own features (a pipeline-parallel target:
        dflash_mac/distributed/stages.py) carries `_dflash_features`, which `features()` then
        returns; it is not queued."""
        self.layer_ids = list(layer_ids)
        self._own = getattr(model, "_dflash_features", None)
        self._active = False
        self.queue = queue and self._own is None
        if self._own is not None:
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
        for layer in self._layers.values():
            if not hasattr(layer, "_dflash_sink"):
                object.__setattr__(layer, "_dflash_sink", _Sink(type(layer)))
                layer.__class__ = _capturing_class(type(layer))
            layer._dflash_sink.users += 1
            layer._dflash_sink.queuers += self.queue
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Release the hooks; the last capture out restores the instances (idempotent)."""
        if not self._active:
            return
        self._active = False
        for layer in self._layers.values():
            sink = layer._dflash_sink
            sink.users -= 1
            sink.queuers -= self.queue
            if sink.users == 0:
                layer.__class__ = sink.orig
                object.__delattr__(layer, "_dflash_sink")

    def features(self) -> mx.array:
        """Concatenated features of the last forward pass, `[B, L, n_tgt * H]`."""
        if self._own is not None:
            return self._own()
        outs = [self._layers[i]._dflash_sink.out for i in self.layer_ids]
        return mx.concatenate(outs, axis=-1)

    def output(self, i: int) -> mx.array:
        """The last forward pass's output of captured layer `i`."""
        return self._layers[i]._dflash_sink.out


def layer_queue(model: nn.Module) -> FeatureCapture:
    """Queue `model`'s layers as they are built where the engine does (`queues_layers`),
    capturing nothing: plain decoding as the bench's baseline runs it (no hook elsewhere)."""
    return FeatureCapture(model, [], queue=queues_layers())


def is_hooked(model: nn.Module) -> bool:
    """True if any decoder layer of `model` (or a module in it) still carries a DFlash hook:
    feature capture here, GatedDeltaNet rollback in hybrid.py."""
    return any(
        hasattr(m, "_dflash_sink") or hasattr(m, "_dflash_gdn")
        for layer in decoder_layers(model)
        for _, m in layer.named_modules()
    )
