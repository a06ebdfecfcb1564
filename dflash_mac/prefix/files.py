"""The prompt cache's files on disk as `dflash-mac cache` reads them: where they live, a
file's header and a pair folder's totals, without MLX (`prefix/disk.py` writes and loads
them)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..host import data_dir

FORMAT = "dflash-mac-prefix/1"
SUFFIX = ".safetensors"


def cache_root() -> Path:
    return data_dir() / "prompt-cache"


def read_header(path: Path) -> dict:
    """A safetensors file's metadata, reading only its header (ValueError if malformed)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 24:
            raise ValueError("header too large")
        body = f.read(n)
    if len(body) != n:
        raise ValueError("truncated")
    meta = json.loads(body).get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta


def summary(folder: Path) -> dict:
    """What one pair's folder holds (read-only: bad files are left for the server to remove):
    files, bytes, cached positions and when it was last used."""
    files = size = tokens = 0
    used = 0.0
    for path in folder.glob("*" + SUFFIX):
        try:
            meta, stat = read_header(path), path.stat()
            tokens += int(meta["end"]) - int(meta["start"])
        except (OSError, ValueError, KeyError):
            continue
        files, size, used = files + 1, size + stat.st_size, max(used, stat.st_mtime)
    return {"files": files, "bytes": size, "tokens": tokens, "used": used}
