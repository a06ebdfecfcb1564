"""The prompt cache's disk tier: the prefix tree's spans as safetensors files, one per node,
written in the background after a request and read when memory misses, so cached prefixes
survive a restart.

A file holds the rows of a span of at most `BLOCK` positions, ending at a multiple of it or
where a tree node ends. It is named by the hash of the pair's key and every token up to its
end, and says its parent's name: a chain of files rebuilds a prefix, and a prompt that shares
only part of a cached conversation finds the files up to the last block they share. The
folder is per pair (`<data dir>/prompt-cache/<target>--<drafter>-<fingerprint>`), and every
file repeats the pair's key, so another model or drafter never reads it. Writes are atomic
(a temporary file, then a rename); a corrupt, truncated or foreign file is removed with one
log line; a full or unwritable disk turns the tier off with one warning. Bounded by bytes:
least recently used files without children go first."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..pair import Pair
from ..sizing.files import pair_file
from .files import FORMAT, SUFFIX, cache_root, read_header
from .tree import Node, Span

log = logging.getLogger("dflash_mac.prompt_cache")
BLOCK = 256  # files end at every multiple of this many positions: prefixes found on disk


def fingerprint(pair: Pair) -> str:
    """What tells this pair's caches from any other's: the ids, the dtypes and a few weights of
    both models (a retrained drafter in the same folder is another pair)."""
    h = hashlib.sha256(f"{pair.model_id}\n{pair.draft_id}".encode())
    for model in (pair.target, pair.drafter):
        params = tree_flatten(model.parameters()) if hasattr(model, "parameters") else []
        for name, a in params[:1] + params[-1:]:
            sample = a.reshape(-1)[:256].astype(mx.float32) if a.size else a
            h.update(f"{name}{a.shape}{a.dtype}{sample.tolist()}".encode())
    return h.hexdigest()[:16]


@dataclass
class Entry:
    start: int
    end: int
    parent: str  # "" for a span starting at position 0
    size: int
    used: float


class DiskTier:
    """One pair's folder of span files, with an index in memory (thread-safe)."""

    def __init__(self, folder: Path, key: str, max_bytes: int, block: int = BLOCK):
        self.folder, self.key, self.max_bytes, self.block = folder, key, max_bytes, block
        self.lock = threading.Lock()
        self.index: dict[str, Entry] = {}
        self.broken = False
        self.jobs: queue.Queue = queue.Queue()
        self.writer: threading.Thread | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.off(e)
            return
        for path in folder.glob("*" + SUFFIX):
            if path.name.startswith("."):  # a write that never finished
                path.unlink(missing_ok=True)
                continue
            try:
                meta = read_header(path)
                if meta.get("format") != FORMAT or meta.get("pair") != key:
                    raise ValueError("written for another pair or format")
                used = path.stat().st_mtime
                entry = Entry(int(meta["start"]), int(meta["end"]), meta["parent"], 0, used)
                entry.size = path.stat().st_size
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.discard(path, e)
                continue
            self.index[path.name[: -len(SUFFIX)]] = entry

    @classmethod
    def for_pair(
        cls, pair: Pair, max_bytes: int, root: Path | None = None, block: int = BLOCK
    ) -> DiskTier:
        key = fingerprint(pair)
        name = f"{pair_file(pair).removesuffix('.json')}-{key}"
        return cls((root or cache_root()) / name, key, max_bytes, block)

    def name(self, ids: list[int]) -> str:
        h = hashlib.sha256(self.key.encode())
        h.update(struct.pack(f"<{len(ids)}i", *ids))
        return h.hexdigest()[:40]

    def off(self, error: Exception) -> None:
        if not self.broken:
            log.warning("prompt cache: the disk tier is off (%s); memory only from now on", error)
        self.broken = True

    def discard(self, path: Path, why: object) -> None:
        log.warning("prompt cache: removed %s (%s)", path.name, why)
        path.unlink(missing_ok=True)

    def stats(self) -> dict:
        with self.lock:
            return {"bytes": sum(e.size for e in self.index.values()), "files": len(self.index)}

    # -- reading (the request's thread) ---------------------------------------------------

    def lookup(self, ids: list[int], beyond: int) -> list[Span] | None:
        """The spans of the longest prefix of `ids` longer than `beyond` that is on disk, from
        position 0 (None if there is none)."""
        if self.broken:
            return None
        with self.lock:
            ends = sorted({e.end for e in self.index.values() if beyond < e.end <= len(ids)})
        for end in reversed(ends):
            chain = self.chain(self.name(ids[:end]))
            if chain is not None:
                spans = [self.load(name) for name in chain]
                if all(s is not None for s in spans) and spans[-1].end == end:
                    if [t for s in spans for t in s.tokens] == ids[:end]:
                        return spans
        return None

    def chain(self, name: str) -> list[str] | None:
        """The names from position 0 down to `name`, or None if a link is missing."""
        out = []
        with self.lock:
            while name:
                entry = self.index.get(name)
                if entry is None:
                    return None
                out.append(name)
                name = entry.parent
        return out[::-1]

    def load(self, name: str) -> Span | None:
        path = self.folder / (name + SUFFIX)
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            if meta.get("pair") != self.key:
                raise ValueError("written for another pair")
            span = decode(arrays, meta)
            os.utime(path)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            self.discard(path, e)
            with self.lock:
                self.index.pop(name, None)
            return None
        with self.lock:
            if name in self.index:
                self.index[name].used = time.time()
        return span

    # -- writing (a background thread) ----------------------------------------------------

    def save(self, ids: list[int], nodes: list[Node]) -> None:
        """Queue `nodes` (along `ids`, their arrays evaluated) to be written."""
        if self.broken or not nodes:
            return
        for node in nodes:
            s, b = node.span, self.block
            cuts = [s.start, *range((s.start // b + 1) * b, s.end, b), s.end]
            for lo, hi in zip(cuts, cuts[1:]):
                piece = s if (lo, hi) == (s.start, s.end) else s.part(lo, hi)
                arrays, meta = encode(piece)
                mx.eval(list(arrays.values()))  # here: the writer thread has no stream
                meta.update(format=FORMAT, pair=self.key, parent=self.name(ids[:lo]) if lo else "")
                self.jobs.put((self.name(ids[:hi]), arrays, meta, lo, hi))
            node.saved = True
        if self.writer is None:
            self.writer = threading.Thread(target=self.write_all, daemon=True, name="cache-disk")
            self.writer.start()

    def write_all(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self.write(*job)
            finally:
                self.jobs.task_done()
        self.jobs.task_done()

    def write(self, name: str, arrays: dict, meta: dict, start: int, end: int) -> None:
        if self.broken:
            return
        tmp = self.folder / f".tmp-{name}-{os.getpid()}"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            os.replace(str(tmp) + SUFFIX, self.folder / (name + SUFFIX))
            size = (self.folder / (name + SUFFIX)).stat().st_size
        except (OSError, RuntimeError) as e:
            Path(str(tmp) + SUFFIX).unlink(missing_ok=True)
            self.off(e)
            return
        with self.lock:
            self.index[name] = Entry(start, end, meta["parent"], size, time.time())
        self.shrink()

    def shrink(self) -> None:
        """Remove least recently used files that no other file continues, until within bounds."""
        while True:
            with self.lock:
                total = sum(e.size for e in self.index.values())
                parents = {e.parent for e in self.index.values()}
                leaves = [(e.used, n) for n, e in self.index.items() if n not in parents]
                if total <= self.max_bytes or not leaves:
                    return
                _, victim = min(leaves)
                del self.index[victim]
            (self.folder / (victim + SUFFIX)).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued file is written."""
        self.jobs.join()

    def close(self) -> None:
        if self.writer is not None:
            self.jobs.put(None)
            self.writer.join()
            self.writer = None


def encode(span: Span) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays = {"tokens": mx.array(span.tokens, dtype=mx.int32)}
    for part, layers in (("t", span.target), ("d", span.drafter), ("r", span.recurrent)):
        for i, rows in enumerate(layers or []):
            for j, a in enumerate(rows or []):
                arrays[f"{part}.{i}.{j}"] = a
    meta = {
        "start": str(span.start),
        "end": str(span.end),
        "target": str(len(span.target)),
        "drafter": "-" if span.drafter is None else str(len(span.drafter)),
        "recurrent": "-" if span.recurrent is None else str(len(span.recurrent)),
    }
    return arrays, meta


def decode(arrays: dict[str, mx.array], meta: dict[str, str]) -> Span:
    def layers(part: str, count: str) -> list | None:
        if count == "-":
            return None
        out = []
        for i in range(int(count)):
            rows = [arrays[f"{part}.{i}.{j}"] for j in range(8) if f"{part}.{i}.{j}" in arrays]
            out.append(rows or None)
        return out

    tokens = arrays["tokens"].tolist()
    start = int(meta["start"])
    if start + len(tokens) != int(meta["end"]):
        raise ValueError("tokens do not match the span")
    target = layers("t", meta["target"])
    drafter = layers("d", meta["drafter"])
    if drafter is not None:
        drafter = [r or [] for r in drafter]  # position-only drafter layers keep no rows
    return Span(start, tokens, target, drafter, layers("r", meta["recurrent"]))
