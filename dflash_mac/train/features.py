"""The frozen target's side of training, computed once: features and soft labels on disk.

A training step spends most of its time in the frozen target's forward (the features every
block is conditioned on, the hidden states its soft labels come from), and every epoch repeats
the same forwards over the same sequences. `FeatureStore` runs that forward ONCE per sequence
(alone, unpadded), keeps the features of every position and, for the KL losses, the top-k
target logits with their log-normaliser at each training temperature, in memory-mapped files
under the data folder; the loop then reads rows instead of running the target. The soft labels
it gives are the ones `soft.target_soft_labels` computes (the same top-k ids, `p_T = exp(top/T -
lse_T)`); `tests/test_train_features.py` checks the loss of a step is the live one.

Built in chunks with a progress count written after each (resumable); the folder's name hashes
the data file, the layer ids, the length cap and the soft-label settings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from dflash_mac.target.structure import target_head

from .batches import target_forward
from .data import Sequence
from .soft import (
    LossSpec,
    SoftLabels,
    host_log_normalisers,
    label_positions,
    soft_from_top,
    top_k_logits,
)

FILES = ("features", "top_ids", "top_logits", "lse")


@dataclass
class StoreLayout:
    """Where each sequence's rows start, and the widths of the arrays."""

    starts: list[int]  # row of each sequence's first token
    lengths: list[int]
    width: int  # features per token: n_layers · hidden
    top_k: int  # 0: no soft labels kept
    temperatures: list[float]

    @property
    def rows(self) -> int:
        return self.starts[-1] + self.lengths[-1] if self.starts else 0


class FeatureStore:
    """Memory-mapped target features (and soft-label logits) of every training sequence."""

    def __init__(self, folder: Path, layout: StoreLayout, mode: str = "r"):
        self.folder, self.layout = folder, layout
        shapes = {
            "features": (layout.rows, layout.width),
            "top_ids": (layout.rows, layout.top_k),
            "top_logits": (layout.rows, layout.top_k),
            "lse": (layout.rows, len(layout.temperatures)),
        }
        dtypes = {"top_ids": np.int32}
        self.arrays = {
            name: np.lib.format.open_memmap(
                folder / f"{name}.npy",
                mode=mode,
                dtype=dtypes.get(name, np.float32),
                shape=shapes[name] if mode == "w+" else None,
            )
            for name in FILES
            if name == "features" or layout.top_k
        }

    # --- building -------------------------------------------------------------------------

    @staticmethod
    def folder_of(data_file: Path, layer_ids: list[int], max_length: int, spec: LossSpec) -> Path:
        """The store's folder: its name hashes the data file and the settings it holds."""
        top_k = spec.top_k if spec.soft else 0
        temps = list(spec.temperatures) if spec.soft else []
        key = json.dumps([data_file.name, layer_ids, max_length, top_k, temps]).encode()
        return data_file.parent / f"features-{hashlib.sha256(key).hexdigest()[:12]}"

    @staticmethod
    def done(folder: Path) -> int:
        """Sequences a store's build has finished (0 before it starts)."""
        meta = folder / "meta.json"
        return json.loads(meta.read_text())["done"] if meta.exists() else 0

    @classmethod
    def open_or_build(
        cls,
        target: nn.Module,
        layer_ids: list[int],
        seqs: list[Sequence],
        data_file: Path,
        max_length: int,
        spec: LossSpec,
        progress: Callable[[int, int], None] | None = None,
    ) -> FeatureStore:
        """The store for these sequences next to `data_file`, built (or finished) first."""
        top_k = spec.top_k if spec.soft else 0
        temps = list(spec.temperatures) if spec.soft else []
        folder = cls.folder_of(data_file, layer_ids, max_length, spec)
        lengths = [min(len(s.ids), max_length) for s in seqs]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        meta = folder / "meta.json"
        done = json.loads(meta.read_text())["done"] if meta.exists() else -1
        if done == len(seqs):
            layout = StoreLayout(**json.loads((folder / "layout.json").read_text()))
            return cls(folder, layout)
        width = int(target_forward(target, layer_ids, mx.array([seqs[0].ids[:1]]))[0].shape[-1])
        layout = StoreLayout(starts, lengths, width, top_k, temps)
        folder.mkdir(parents=True, exist_ok=True)
        if done < 0:
            (folder / "layout.json").write_text(json.dumps(layout.__dict__))
            store, done = cls(folder, layout, "w+"), 0
        else:
            store = cls(folder, layout, "r+")
        head = target_head(target) if top_k else None
        for i in range(done, len(seqs)):
            ids = seqs[i].ids[:max_length]
            store._write(i, target, layer_ids, ids, len(seqs[i].prompt), head, spec)
            if (i + 1) % 16 == 0 or i + 1 == len(seqs):
                for a in store.arrays.values():
                    a.flush()
                meta.write_text(json.dumps({"done": i + 1}))
                if progress:
                    progress(i + 1, len(seqs))
        return cls(folder, layout)

    def _write(
        self, i: int, target, layer_ids, ids: list[int], prompt: int, head, spec: LossSpec
    ) -> None:
        feats, hidden = target_forward(
            target, layer_ids, mx.array([ids]), want_hidden=head is not None
        )
        start = self.layout.starts[i]
        self.arrays["features"][start : start + len(ids)] = np.array(feats[0])
        if head is None:
            return
        # rows whose next token is a response token, the only ones read (`label_positions`
        # from the prompt's length, the vocabulary counts from one before): the rest stay 0
        lo, hi = min(max(prompt - 1, 0), len(ids) - 1), len(ids) - 1
        logits = head.logits(hidden[0, lo:hi]).astype(mx.float32)  # [hi - lo, V]
        top_ids, top = top_k_logits(logits, spec.top_k)
        rows = slice(start + lo, start + hi)
        self.arrays["top_ids"][rows] = np.array(top_ids)
        self.arrays["top_logits"][rows] = np.array(top)
        self.arrays["lse"][rows] = host_log_normalisers(np.array(logits), spec.temperatures)

    # --- reading --------------------------------------------------------------------------

    def _rows(self, name: str, i: int, n: int | None = None) -> np.ndarray:
        s, length = self.layout.starts[i], self.layout.lengths[i]
        return self.arrays[name][s : s + (length if n is None else n)]

    def features(self, idx: list[int], length: int) -> mx.array:
        """Features of sequences `idx`, right-padded with zeros to `length`: ``[B, S, n·H]``."""
        out = np.zeros((len(idx), length, self.layout.width), dtype=np.float32)
        for j, i in enumerate(idx):
            n = min(length, self.layout.lengths[i])
            out[j, :n] = self._rows("features", i, n)
        return mx.array(out)

    def soft(self, idx: list[int], anchors: np.ndarray, block_size: int) -> SoftLabels:
        """Soft labels of every block (anchors ``[B, N]``), as `target_soft_labels` gives."""
        pos = np.array(label_positions(mx.array(anchors), block_size))  # [B, N, P]
        ids = np.stack([self._rows("top_ids", i)[p] for i, p in zip(idx, pos)])
        top = np.stack([self._rows("top_logits", i)[p] for i, p in zip(idx, pos)])
        lse = np.stack([self._rows("lse", i)[p] for i, p in zip(idx, pos)])  # [B, N, P, nT]
        return soft_from_top(mx.array(ids), mx.array(top), mx.array(lse), self.layout.temperatures)

    def soft_mass(self, i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Top-k ids and their p at T 1 of sequence `i`'s rows ``lo..hi-1`` (None without
        soft labels at T 1)."""
        temps = self.layout.temperatures
        if not self.layout.top_k or 1.0 not in temps:
            return None
        t1 = temps.index(1.0)
        ids, top = self._rows("top_ids", i)[lo:hi], self._rows("top_logits", i)[lo:hi]
        return ids, np.exp(top - self._rows("lse", i)[lo:hi, t1 : t1 + 1])


class StoreSet:
    """Several stores (one per data file) read as one: sequence `i` of the files' sequences
    in order. A new data file adds a store; the ones built before are kept."""

    def __init__(self, stores: list[FeatureStore]):
        self.stores = stores
        counts = [len(s.layout.lengths) for s in stores]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)

    @property
    def rows(self) -> int:
        return sum(s.layout.rows for s in self.stores)

    def _where(self, i: int) -> tuple[FeatureStore, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.stores[k], i - int(self.starts[k])

    def features(self, idx: list[int], length: int) -> mx.array:
        return mx.concatenate([self._call("features", i, length) for i in idx])

    def soft(self, idx: list[int], anchors: np.ndarray, block_size: int) -> SoftLabels:
        parts = [self._call("soft", i, anchors[j : j + 1], block_size) for j, i in enumerate(idx)]
        if len(parts) == 1:
            return parts[0]
        return SoftLabels(
            mx.concatenate([p.ids for p in parts]),
            mx.concatenate([p.probs for p in parts], axis=1),
            mx.concatenate([p.tail for p in parts], axis=1),
        )

    def soft_mass(self, i: int, lo: int, hi: int):
        store, local = self._where(i)
        return store.soft_mass(local, lo, hi)

    def _call(self, name: str, i: int, *args):
        store, local = self._where(i)
        return getattr(store, name)([local], *args)
