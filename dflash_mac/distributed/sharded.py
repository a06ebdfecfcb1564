"""Load a pair across the ranks of an MLX distributed job: the target sharded with mlx-lm's own
`model.shard(group)` (tensor parallel) or `model.model.pipeline(group)` (pipeline parallel), the
drafter on rank 0 only. Rank 0 gets a `LoadedPair` whose target leads and whose `mirror` is the
leader (leader.py); the other ranks get a `Worker` to run (worker.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from ..errors import LoadError
from ..loading.loader import (
    LoadedPair,
    PairSpec,
    cast_floats,
    default_dtype,
    load_drafter,
    load_target,
    materialize,
)
from ..target.structure import decoder_layers, target_head
from .group import PARALLEL_MODES, mark_ready, parallel_mode
from .leader import Leader, register
from .stages import StageCapture
from .worker import Worker


def has_tensor(model: nn.Module) -> bool:
    return hasattr(model, "shard")


def has_pipeline(model: nn.Module) -> bool:
    inner = getattr(getattr(model, "language_model", model), "model", None)
    return hasattr(inner, "pipeline")


def choose_mode(model: nn.Module, requested: str | None, name: str) -> str:
    """The parallel mode: the requested one if the model class has it, else what it has."""
    able = {"tensor": has_tensor(model), "pipeline": has_pipeline(model)}
    kind = type(model).__module__.rsplit(".", 1)[-1]
    if requested is not None:
        if not able[requested]:
            other = [m for m in PARALLEL_MODES if able[m]]
            hint = f"; use --parallel {other[0]}" if other else ""
            raise LoadError(
                f"target '{name}' ({kind}) cannot be split with --parallel {requested}{hint}."
            )
        return requested
    for mode in PARALLEL_MODES:
        if able[mode]:
            return mode
    raise LoadError(f"target '{name}' ({kind}) does not shard: mlx-lm has no split for it.")


def check_divisible(spec: PairSpec, ranks: int) -> None:
    """Tensor parallel splits heads and the MLP across ranks; refuse sizes that do not divide
    (mlx-lm would fail later with a shape error)."""
    t = spec.text_config
    sizes = {
        what: t.get(key)
        for key, what in (
            ("num_attention_heads", "attention heads"),
            ("num_key_value_heads", "key/value heads"),
            ("intermediate_size", "MLP width"),
        )
        if isinstance(t.get(key), int)
    }
    for what, value in sizes.items():
        if value % ranks:
            fits = [n for n in range(2, 9) if all(v % n == 0 for v in sizes.values())]
            hint = f"-n {' or -n '.join(map(str, fits))}" if fits else "another model"
            raise LoadError(
                f"target '{spec.label}' does not shard over {ranks} ranks ({value} {what} "
                f"are not divisible by {ranks}); use {hint}, or --parallel pipeline where "
                "the model has it."
            )


def shard_target(spec: PairSpec, group: mx.distributed.Group, requested: str | None, dtype):
    """The target's shard on this rank (lazy until evaluated), its full head, the mode and the
    load's warnings (a GGUF's dequantized types)."""
    model, tokenizer, warnings = load_target(spec, dtype, lazy=True)
    mode = choose_mode(model, requested, spec.label)
    spec.check_layers(decoder_layers(model))
    head = target_head(model)  # before sharding: a sharded LM head would need every rank
    if mode == "tensor":
        check_divisible(spec, group.size())
        model.shard(group)
    else:
        getattr(model, "language_model", model).model.pipeline(group)
    if dtype is not None:
        cast_floats(model, dtype)
    mx.eval(model.parameters())
    return model, tokenizer, head, mode, warnings


@dataclass
class Ranked:
    """What this rank got: the leader's pair, or a worker to run."""

    rank: int
    pair: LoadedPair | None = None
    worker: Worker | None = None


def load(
    group: mx.distributed.Group,
    model: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    *,
    dtype: mx.Dtype | None | str = "auto",
    block_size: int | None = None,
) -> Ranked:
    """Load this rank's part of the pair; every rank calls it with the same arguments."""
    spec = PairSpec.resolve(model, draft)
    dtype = default_dtype() if dtype == "auto" else dtype
    target, tokenizer, head, mode, warnings = shard_target(spec, group, parallel_mode(), dtype)
    rank = group.rank()
    hidden = spec.text_config["hidden_size"]
    stages = None
    if mode == "pipeline":
        stages = StageCapture(target, spec.draft_config.target_layer_ids, group, hidden)
    failure: Exception | None = None
    pair = lead = None
    if rank == 0:
        try:
            lead = Leader(group, target, mode, stages)  # the pair's mirror; hooks once all loaded
            drafter = load_drafter(spec.draft_path, spec.draft_config, dtype)
            full_head = [head.lm_head] if isinstance(head.lm_head, nn.Module) else []
            for m in full_head:  # a head mlx-lm sharded is no longer in the model: cast it too
                if dtype is not None:
                    cast_floats(m, dtype)
            drafter.bind(head)
            materialize(drafter, head.embed, *full_head)
            pair = spec.pair(target, drafter, tokenizer, block_size, mirror=lead)
            pair.warnings = spec.notes + warnings
        except Exception as e:  # told to the workers below, then raised here
            failure = e
    materialize(target)
    ok = mx.distributed.all_sum(mx.array([int(failure is not None)]), group=group)
    if ok.item():
        if failure is not None:
            raise failure
        raise LoadError("rank 0 could not load the drafter; see its message.")
    if rank != 0:
        mark_ready(rank)
        return Ranked(rank, worker=Worker(group, target, hidden, stages))
    lead.attach()
    register(lead)
    lead.probe(pair.block_size, hidden)
    mark_ready(rank)
    return Ranked(0, pair=pair)
