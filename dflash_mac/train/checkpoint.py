"""Resumable checkpoints, fine-tuning starts, and the final z-lab drafter folder."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .args import TrainError


@dataclass
class LoopState:
    """Where a run stands; what a checkpoint's meta.json records besides the settings."""

    step: int  # optimizer steps done
    total: int  # steps of the whole run (shrinks once when a time budget fixes it)
    losses: list[float] = field(default_factory=list)  # loss of every step so far
    elapsed: float = 0.0  # training seconds of earlier processes (resumed runs)
    budget_fixed: bool = True  # False until a `minutes` budget has fixed `total`
    blocks: int = 0  # real (not padding) blocks trained on so far

    def meta(self, settings_key: dict, run_seconds: float) -> dict:
        return {
            "step": self.step,
            "total_steps": self.total,
            "settings": settings_key,
            "losses": self.losses,
            "blocks": self.blocks,
            "elapsed": self.elapsed + run_seconds,
        }


def save_checkpoint(ckpt: Path, drafter, opt, meta: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt / "weights.safetensors"), dict(tree_flatten(drafter.parameters())))
    mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    tmp = ckpt / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(ckpt / "meta.json")  # written last: a checkpoint with meta is complete


def load_checkpoint(ckpt: Path, drafter, opt) -> dict:
    meta = json.loads((ckpt / "meta.json").read_text())
    drafter.load_weights(str(ckpt / "weights.safetensors"))
    if drafter.head is not None:
        drafter.bind(drafter.head)  # the head's rows follow the saved draft vocabulary
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    return meta


def resume(ckpt: Path, drafter, opt, settings_key: dict) -> LoopState | None:
    """Weights, optimizer and position of the run saved in `ckpt`, if it has the same settings."""
    if not (ckpt / "meta.json").exists():
        return None
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta["settings"] != settings_key:
        raise TrainError(
            f"the checkpoint in {ckpt} was made with other settings; drop --resume to start over."
        )
    meta = load_checkpoint(ckpt, drafter, opt)
    return LoopState(
        step=meta["step"],
        total=meta["total_steps"],
        losses=meta["losses"],
        blocks=meta.get("blocks", 0),
        elapsed=meta["elapsed"],
        budget_fixed=True,
    )


def discard(ckpt: Path) -> None:
    """Remove a previous run's checkpoint (a fresh run must not resume it later)."""
    if ckpt.exists():
        shutil.rmtree(ckpt)


def export_weights(drafter) -> dict[str, mx.array]:
    """Parameters under the checkpoint's key names (DFlash 2 codebooks have no `.weight`)."""
    if hasattr(drafter, "export_weights"):
        return drafter.export_weights()
    return dict(tree_flatten(drafter.parameters()))


def load_init(drafter, folder: Path) -> str:
    """Load an existing drafter's weights (strict names and shapes) as the starting point."""
    from dflash_mac.loading.loader import load_weights

    weights = {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in load_weights(folder).items()
        if "embed_tokens" not in k and not k.startswith("lm_head")
    }
    if hasattr(drafter, "sanitize"):  # checkpoint names -> parameter names (DFlash 2 codebooks)
        weights = drafter.sanitize(weights)
    expected = dict(tree_flatten(drafter.parameters()))
    if "draft_vocab" in expected and "draft_vocab" not in weights:
        weights["draft_vocab"] = expected["draft_vocab"]  # a whole-vocabulary drafter: keep ours
    bad = sorted(set(expected) ^ set(weights)) + [
        k for k in weights if k in expected and weights[k].shape != expected[k].shape
    ]
    if bad:
        raise TrainError(
            f"--init-from {folder} does not match the drafter being trained "
            f"({bad[:3]}); use the same layers and target."
        )
    drafter.load_weights(list(weights.items()))
    if drafter.head is not None:
        drafter.bind(drafter.head)  # the head's rows follow the loaded draft vocabulary
    src = folder / "dflash_training.json"
    steps = json.loads(src.read_text()).get("steps") if src.exists() else None
    return f"{folder}" + (f", {steps} steps" if steps else "")


SAVE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}  # anything else: float32


def save_drafter(drafter, config: dict, out_dir: Path, dtype=mx.float16, extra: dict | None = None):
    """The z-lab drafter folder: config.json + model.safetensors (no embed / lm_head)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in export_weights(drafter).items()
    }
    config = dict(
        config, dtype={mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32")
    )
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        (out_dir / "dflash_training.json").write_text(json.dumps(extra, indent=1) + "\n")
