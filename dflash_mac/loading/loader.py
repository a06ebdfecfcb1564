"""Resolve, validate and load a target + drafter pair."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from ..errors import LoadError  # noqa: F401  (re-exported)
from ..models.config import ConfigError, DraftConfig
from ..pair import Mirror
from ..target.structure import decoder_layers, target_head
from . import gguf
from .registry import default_sources, load_registry, resolve_pair
from .sources import (  # noqa: F401  (re-exported: the names loading always had)
    BUNDLED_DRAFT,
    BUNDLED_TARGET,
    DOWNLOAD_PATTERNS,
    PACKAGE_MODELS,
    download,
    fetch_pypi,
    is_pypi,
    missing_folder,
    offline_message,
)


@dataclass
class LoadedPair:
    """A loaded target and its bound drafter (implements `pair.Pair`)."""

    target: nn.Module
    drafter: nn.Module
    tokenizer: Any
    model_id: str
    draft_id: str
    # the largest block it drafts by default; requests resolve theirs (sizing/choice.py)
    block_size: int
    target_config: dict
    generation_config: dict = field(default_factory=dict)  # the target's sampling defaults
    mirror: Mirror | None = None  # a target sharded over several ranks (distributed/leader.py)
    warnings: list[str] = field(default_factory=list)  # what loading changed, plain sentences

    @property
    def layer_ids(self) -> list[int]:
        return self.drafter.config.target_layer_ids

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def kind(self) -> str:
        return "DFlash 2" if self.drafter.config.is_dflash2 else "DFlash"

    @property
    def quantized(self) -> bool:
        return bool(self.target_config.get("quantization")) or bool(
            self.drafter.config.quantization
        )

    @property
    def context_length(self) -> int:
        cfg = self.target_config.get("text_config", self.target_config)
        return int(cfg.get("max_position_embeddings", 32768))


def resolve(name: str | os.PathLike) -> Path:
    """A local folder or .gguf file as is; a `pypi:` source from its cached wheel (sources.py);
    otherwise a Hub id through `huggingface_hub.snapshot_download`."""
    if is_pypi(str(name)):
        known = load_registry().find_target(str(name))  # the hint names the pair to pull
        return fetch_pypi(str(name), name=known.name if known else None)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() and not gguf.is_gguf(path):
            raise LoadError(f"{path} is a file; pass the model folder (or a .gguf file) instead.")
        return path
    missing_folder(name)
    return download(str(name))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadError(f"{path} is missing; the folder is not a complete model.")
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).")


def optional_json(path: Path) -> dict:
    """A JSON object file that may be absent or broken (then {})."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def validate_pair(tcfg: dict, dcfg: DraftConfig, target: str, draft: str) -> None:
    """Check hidden size, vocabulary and layer ids before any heavy weights are read."""
    t = tcfg.get("text_config", tcfg)
    n_layers, hidden, vocab = t.get("num_hidden_layers"), t.get("hidden_size"), t.get("vocab_size")
    problems = []
    if hidden != dcfg.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} vs {hidden}")
    if vocab != dcfg.vocab_size:
        problems.append(f"vocabulary {dcfg.vocab_size} vs {vocab}")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < (n_layers or 0)]
    if bad:
        problems.append(f"layer ids {bad} beyond the target's {n_layers} layers")
    if vocab and not 0 <= dcfg.mask_token_id < vocab:
        problems.append(f"mask token {dcfg.mask_token_id} outside the vocabulary")
    if problems:
        raise LoadError(
            f"drafter '{draft}' does not fit target '{target}' ({'; '.join(problems)}); "
            "use the drafter trained for this target."
        )


def load_weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder} holds no *.safetensors weights.")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError on corrupt files
            raise LoadError(f"{f} is not a readable safetensors file ({e}).")
    return weights


def build_drafter(cfg: DraftConfig) -> nn.Module:
    if cfg.is_dflash2:
        from ..models.dflash2 import DFlash2DraftModel

        return DFlash2DraftModel(cfg)
    from ..models.dflash import DFlashDraftModel

    return DFlashDraftModel(cfg)


def load_drafter(folder: Path, cfg: DraftConfig, dtype: mx.Dtype | None = None) -> nn.Module:
    """Build the drafter and load its weights strictly (stray embed/lm_head keys dropped)."""
    model = build_drafter(cfg)
    weights = {
        k: v
        for k, v in load_weights(folder).items()
        if "embed_tokens" not in k and not k.startswith("lm_head")
    }
    weights = model.sanitize(weights)
    if q := cfg.quantization:
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        what = (f"missing {missing[:3]}" if missing else "") + (
            f"{'; ' if missing else ''}unexpected {extra[:3]}" if extra else ""
        )
        raise LoadError(f"drafter weights in {folder} do not match its config ({what}).")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise LoadError(
                f"drafter tensor {k} in {folder} has shape {tuple(v.shape)}, "
                f"expected {tuple(expected[k].shape)}."
            )
    model.load_weights(list(weights.items()))
    if dtype is not None:
        cast_floats(model, dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters (not quantized integer weights) to `dtype`."""
    model.update(
        tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )


def module_arrays(module: nn.Module) -> list[mx.array]:
    """Every array a module tree holds: parameters and also private buffers (`_freqs` of a
    RoPE, cached constants) that `parameters()` leaves out."""
    found: list[mx.array] = []

    def collect(value: object) -> None:
        if isinstance(value, mx.array):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict) and not isinstance(value, nn.Module):
            for v in value.values():
                collect(v)

    for m in module.modules():
        for v in list(m.values()) + list(vars(m).values()):
            collect(v)
    return found


def materialize(*modules: nn.Module) -> None:
    """Evaluate every array of `modules` now. MLX arrays are bound to the stream of the thread
    that built them: a weight left lazy here would first be computed on the generation thread
    of `serve` (or the chat app) and fail there with "There is no Stream(cpu, 0) in current
    thread" (docs/architecture.md, threads)."""
    mx.eval([a for m in modules for a in module_arrays(m)])


def default_dtype() -> mx.Dtype | None:
    """fp32 on the CPU (fp16/bf16 matmuls are slow there); the stored dtype on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def load(
    model: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    *,
    dtype: mx.Dtype | None | str = "auto",
    block_size: int | None = None,
) -> LoadedPair:
    """Load a target (via mlx-lm) and its DFlash drafter; defaults to the default pair."""
    spec = PairSpec.resolve(model, draft)
    dtype = default_dtype() if dtype == "auto" else dtype
    target, tokenizer, warnings = load_target(spec, dtype)
    if dtype is not None:
        cast_floats(target, dtype)
        mx.eval(target.parameters())  # materialise here, not lazily on the first user's thread
    spec.check_layers(decoder_layers(target))
    drafter = load_drafter(spec.draft_path, spec.draft_config, dtype)
    drafter.bind(target_head(target))
    materialize(target, drafter)
    pair = spec.pair(target, drafter, tokenizer, block_size)
    pair.warnings = spec.notes + warnings
    return pair


def load_target(spec: PairSpec, dtype, lazy: bool = False) -> tuple[Any, Any, list[str]]:
    """(model, tokenizer, warnings) of the spec's target: a GGUF file through gguf.py (quantized
    weights dequantized to `dtype` when given), else mlx-lm; `lazy`: mlx-lm's weights not read
    yet (a rank of a distributed job reads only its shard). The single process and every rank
    of `launch` load targets here."""
    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import load_model, load_tokenizer

    if gguf.is_gguf(spec.target_path):
        target, tokenizer, spec.target_config, warnings = gguf.load(spec.target_path, dtype)
        return target, tokenizer, warnings
    try:
        if not lazy:
            target, tokenizer = mlx_load(str(spec.target_path))
            return target, tokenizer, []
        target, config = load_model(spec.target_path, lazy=True, strict=False)
        eos = config.get("eos_token_id", None)
        tokenizer = load_tokenizer(spec.target_path, {"trust_remote_code": True}, eos_token_ids=eos)
        return target, tokenizer, []
    except Exception as e:
        raise LoadError(f"could not load target '{spec.label}' with mlx-lm ({e}).")


@dataclass
class PairSpec:
    """A pair resolved to folders and validated from its configs, before any weights are read
    (shared by `load` and the sharded load of dflash_mac/distributed/)."""

    model: str
    draft: str
    target_path: Path
    draft_path: Path
    target_config: dict
    draft_config: DraftConfig
    notes: list[str] = field(default_factory=list)  # e.g. the default pair's offline fallback

    @classmethod
    def resolve(cls, model: str | os.PathLike | None, draft: str | os.PathLike | None):
        model, draft = resolve_pair(model, draft)  # pair names; --draft auto from the registry
        notes = []
        if model is None and draft is None:  # the default pair (or, offline, its fallback)
            model, draft, note = default_sources()
            notes += [note] if note else []
        if model is None or draft is None:
            raise LoadError("pass --model with --draft (or neither, for the default pair).")
        tpath, dpath = resolve(model), resolve(draft)
        if tpath.is_dir():
            tpath = gguf.find_gguf(tpath) or tpath
        tcfg = gguf.read_config(tpath) if gguf.is_gguf(tpath) else read_json(tpath / "config.json")
        try:
            dcfg = DraftConfig.from_file(dpath / "config.json")
        except ConfigError as e:
            raise LoadError(str(e))
        validate_pair(tcfg, dcfg, str(model), str(draft))
        return cls(str(model), str(draft), tpath, dpath, tcfg, dcfg, notes)

    @property
    def label(self) -> str:
        """How sentences name the target: its pair's name when the registry knows it (not a
        250-character `pypi:` string), else as given."""
        known = load_registry().find_target(self.model)
        return known.name if known is not None else self.model

    @property
    def text_config(self) -> dict:
        return self.target_config.get("text_config", self.target_config)

    def check_layers(self, layers: list) -> None:
        if len(layers) != self.text_config.get("num_hidden_layers"):
            raise LoadError(f"target '{self.model}' has an unexpected layer layout.")

    def pair(
        self,
        target,
        drafter,
        tokenizer,
        block_size: int | None = None,
        *,
        mirror: Mirror | None = None,
    ) -> LoadedPair:
        pair = LoadedPair(
            target=target,
            drafter=drafter,
            tokenizer=tokenizer,
            model_id=self.model,
            draft_id=self.draft,
            block_size=block_size or self.draft_config.block_size,
            target_config=self.target_config,
            generation_config=optional_json(self.target_path / "generation_config.json"),
            mirror=mirror,
        )
        return pair


def quantize_drafter(drafter: nn.Module, bits: int, group_size: int = 64) -> None:
    """Quantize the drafter's linear layers in place; norms and small tensors stay in float."""
    if bits not in (4, 8):
        raise LoadError(f"--draft-bits must be 4 or 8 (got {bits}).")
    nn.quantize(
        drafter,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda p, m: (
            isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0
        ),
    )
    drafter.config.quantization = {"group_size": group_size, "bits": bits}
    materialize(drafter)
