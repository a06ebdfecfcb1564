"""`dflash-mac convert`: quantize a target (via mlx-lm) or a DFlash drafter folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from dflash_mac.errors import LoadError
from dflash_mac.loading.sources import missing_folder
from dflash_mac.models.config import DFLASH1, DFLASH2, ConfigError, DraftConfig

BITS_HELP = "Bits per weight: 4 or 8 (MLX affine quantization)."
GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization accepts


def check_options(bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise LoadError(f"--bits must be 4 or 8 (got {bits}).")
    if group_size not in GROUP_SIZES:
        raise LoadError(
            f"--group-size must be 32, 64 or 128, the sizes MLX quantizes with (got {group_size})."
        )


def quantized_tensors(folder: Path) -> int:
    """How many quantized weights (`*.scales` tensors) the safetensors files of `folder` hold;
    read from the file headers, without loading weights."""
    count = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        count += sum(k.endswith(".scales") for k in header)
    return count


def check_quantized(src: str, out: Path, group_size: int) -> None:
    """Fail (and remove `out`) when nothing was quantized: no weight width divisible by the
    group size, so every layer stayed in float."""
    if quantized_tensors(out) == 0:
        shutil.rmtree(out, ignore_errors=True)
        raise LoadError(
            f"nothing in '{src}' could be quantized with group size {group_size} "
            "(no weight width is a multiple of it); try --group-size 32."
        )


def is_drafter(cfg: dict) -> bool:
    return bool({DFLASH1, DFLASH2} & set(cfg.get("architectures") or []))


def convert_drafter(src: Path, out: Path, bits: int, group_size: int = 64) -> Path:
    """Quantize a drafter folder: linear layers to `bits`, norms and small tensors in float."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_mac.loading.loader import load_drafter, quantize_drafter, read_json

    try:
        cfg = DraftConfig.from_file(src / "config.json")
    except ConfigError as e:
        raise LoadError(str(e))
    if cfg.quantization:
        raise LoadError(f"drafter {src} is already quantized.")
    model = load_drafter(src, cfg)
    quantize_drafter(model, bits, group_size)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    raw = dict(read_json(src / "config.json"), quantization=model.config.quantization)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    mx.save_safetensors(
        str(out / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    return out


def convert_target(src: str, out: Path, bits: int, group_size: int = 64) -> Path:
    """Quantize a target with mlx-lm's converter (what `mlx_lm.convert -q` does)."""
    from mlx_lm import convert as mlx_convert

    try:
        mlx_convert(
            str(src), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group_size
        )
    except Exception as e:  # mlx-lm raises ValueError / OSError / KeyError on bad folders
        raise LoadError(f"mlx-lm could not convert '{src}' ({e}).")
    return out


def convert(
    src: str = typer.Argument(..., help="Target or drafter: local folder or Hugging Face id."),
    out: Path = typer.Argument(..., help="Output folder (must not exist)."),
    bits: int = typer.Option(4, "--bits", help=BITS_HELP),
    group_size: int = typer.Option(64, "--group-size", help="Quantization group size."),
) -> None:
    """Quantize a target model or a DFlash drafter to 4 or 8 bits (group 64 by default).

    Quantized pairs default to block size min(5, drafter block): MLX's quantized matmul loses
    efficiency at wide verify widths."""
    from dflash_mac.loading.registry import load_registry

    check_options(bits, group_size)
    if out.exists():
        raise LoadError(f"{out} already exists; pass a new output folder.")
    if (entry := load_registry().get(src)) is not None and not Path(src).exists():
        raise LoadError(
            f"'{src}' is a pair name; convert takes one model: its target "
            f"{entry.target_source()} or its drafter {entry.draft_source()}."
        )
    missing_folder(src)
    from dflash_mac.loading.loader import read_json, resolve  # mlx-lm: after the checks

    path = resolve(src)
    if is_drafter(read_json(path / "config.json")):
        convert_drafter(path, out, bits, group_size)
        kind = "drafter"
    else:
        convert_target(str(path), out, bits, group_size)
        kind = "target"
    check_quantized(src, out, group_size)
    typer.echo(f"wrote {bits}-bit {kind} to {out} ({quantized_tensors(out)} quantized weights)")
