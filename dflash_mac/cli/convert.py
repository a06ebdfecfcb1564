"""`dflash-mac convert`: quantize a target (via mlx-lm) or a DFlash drafter folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from mlx.utils import tree_flatten

from dflash_mac.loading import LoadError, load_drafter, quantize_drafter, read_json, resolve
from dflash_mac.models.config import DFLASH1, DFLASH2, ConfigError, DraftConfig

BITS_HELP = "Bits per weight: 4 or 8 (MLX affine quantization)."


def is_drafter(cfg: dict) -> bool:
    return bool({DFLASH1, DFLASH2} & set(cfg.get("architectures") or []))


def convert_drafter(src: Path, out: Path, bits: int, group_size: int = 64) -> Path:
    """Quantize a drafter folder: linear layers to `bits`, norms and small tensors in float."""
    import mlx.core as mx

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
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return out


def convert_target(src: str, out: Path, bits: int, group_size: int = 64) -> Path:
    """Quantize a target with mlx-lm's converter (what `mlx_lm.convert -q` does)."""
    from mlx_lm import convert as mlx_convert

    if bits not in (4, 8):
        raise LoadError(f"--bits must be 4 or 8 (got {bits}).")
    try:
        mlx_convert(str(src), mlx_path=str(out), quantize=True, q_bits=bits,
                    q_group_size=group_size)
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
    if out.exists():
        raise LoadError(f"{out} already exists; pass a new output folder.")
    path = resolve(src)
    if is_drafter(read_json(path / "config.json")):
        convert_drafter(path, out, bits, group_size)
        kind = "drafter"
    else:
        convert_target(str(path), out, bits, group_size)
        kind = "target"
    typer.echo(f"wrote {bits}-bit {kind} to {out}")
