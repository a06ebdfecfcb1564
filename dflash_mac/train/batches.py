"""Training batches: a resume-safe sequence order, random anchors, and the target's features."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from dflash_mac.target.capture import FeatureCapture
from dflash_mac.target.structure import text_model

from .args import TrainSettings
from .blocks import block_inputs, sample_anchors
from .data import Sequence


@dataclass
class Batch:
    tokens: mx.array  # [B, S] right-padded
    block_ids: mx.array  # [B, N, bs]
    labels: mx.array  # [B, N, bs-1]
    anchors: np.ndarray  # [B, N] (padding blocks repeat a real anchor)
    valid: mx.array  # [B, N] 1 for real blocks
    n_tokens: int  # real tokens in the batch


def sequence_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Sequence indices of a step: a fixed permutation per epoch (resume-safe)."""
    out = []
    for j in range(batch_size):
        g = step * batch_size + j
        out.append(int(sequence_order(n, seed, g // n)[g % n]))
    return out


def make_batch(seqs: list[Sequence], idx: list[int], step: int, s: TrainSettings) -> Batch:
    """Right-padded tokens and each sequence's random anchors (padded to the batch's max)."""
    toks, anchors = [], []
    for j, i in enumerate(idx):
        seq = np.array(seqs[i].ids[: s.max_length], dtype=np.int32)
        rng = np.random.default_rng([s.seed, step, j])
        toks.append(seq)
        anchors.append(sample_anchors(rng, len(seqs[i].prompt), len(seq), s.block_size, s.anchors))
    B, S, N = len(toks), max(len(t) for t in toks), max(len(a) for a in anchors)
    padded = np.zeros((B, S), dtype=np.int32)
    blocks = np.zeros((B, N, s.block_size), dtype=np.int32)
    labels = np.zeros((B, N, s.block_size - 1), dtype=np.int32)
    anc = np.zeros((B, N), dtype=np.int32)
    valid = np.zeros((B, N), dtype=np.float32)
    for j, (t, a) in enumerate(zip(toks, anchors)):
        padded[j, : len(t)] = t
        full = np.concatenate([a, np.full(N - len(a), a[0])]) if len(a) < N else a
        ids, lab = block_inputs(t, full, s.block_size, s.mask_token_id)
        blocks[j], labels[j], anc[j], valid[j, : len(a)] = ids, lab, full, 1.0
    return Batch(
        mx.array(padded),
        mx.array(blocks),
        mx.array(labels),
        anc,
        mx.array(valid),
        sum(len(t) for t in toks),
    )


def target_features(target: nn.Module, layer_ids: list[int], tokens: mx.array) -> mx.array:
    """One frozen target forward -> features of every position ``[B, S, n·H]``."""
    return target_forward(target, layer_ids, tokens)[0]


def target_forward(
    target: nn.Module, layer_ids: list[int], tokens: mx.array, want_hidden: bool = False
) -> tuple[mx.array, mx.array | None]:
    """One frozen target forward -> (features ``[B, S, n·H]``, final-normed hidden states
    ``[B, S, H]`` when `want_hidden`: the LM head turns them into the soft labels)."""
    tm = text_model(target)
    body = getattr(tm, "model", None)  # the decoder stack without the LM head, when exposed
    if want_hidden and body is None:
        raise ValueError("soft labels need a target whose decoder stack is `.model`.")
    with FeatureCapture(target, layer_ids) as cap:
        out = body(tokens) if body is not None else target(tokens)
        feats = mx.stop_gradient(cap.features())
        hidden = mx.stop_gradient(out) if want_hidden else None
        mx.eval(feats, *([hidden] if want_hidden else []))
    del out
    return feats, hidden
