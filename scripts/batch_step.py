"""A batched plain step of the default pair's target: the batch engine's ragged rows (each row
its own KV cache, its attention run per row: `batch.RaggedAttention`) against mlx-lm's
`BatchKVCache` (one left-padded cache, one attention per layer), B rows of 60 + 9 i tokens.

    LD_PRELOAD=<libopenblas.so.0> .venv/bin/python scripts/batch_step.py 4

Medians of synchronous steps (build + eval), in ms; run it on an idle machine. Results:
`bench/results/linux-x86_64-2core-amd-epyc-batch-step.md`.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache

from dflash_mac.batch import forward_rows, ragged_hooks
from dflash_mac.capture import FeatureCapture
from dflash_mac.decode import DecodeState
from dflash_mac.prepare import prepare

STEPS, SKIP = 24, 4  # steps timed, of which the first SKIP are not kept


def ragged(pair, prompts: list[list[int]], capture: bool) -> float:
    """Median ms of a ragged batched step (with the engine's per-layer capture queue)."""
    states = [DecodeState(pair) for _ in prompts]
    for s, p in zip(states, prompts):
        pair.target(mx.array([p]), cache=s.target_cache)
        mx.eval([c.state for c in s.target_cache])
    tok, times = mx.array([[p[-1]] for p in prompts]), []
    cap = FeatureCapture(pair.target, pair.layer_ids, queue=capture)
    with ragged_hooks(pair), cap, mx.stream(generation_stream):
        for _ in range(STEPS):
            t = time.perf_counter()
            tok = mx.argmax(forward_rows(pair, tok, states)[:, -1:], -1)
            mx.eval(tok)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[SKIP:])


def padded(pair, prompts: list[list[int]]) -> float:
    """Median ms of mlx-lm's batched step on one left-padded cache."""
    width = max(map(len, prompts))
    cache = [BatchKVCache([width - len(p) for p in prompts]) for _ in pair.target.layers]
    x = mx.array([[0] * (width - len(p)) + p for p in prompts])
    pair.target(x, cache=cache)
    mx.eval([c.state for c in cache])
    tok, times = x[:, -1:], []
    with mx.stream(generation_stream):
        for _ in range(STEPS):
            t = time.perf_counter()
            tok = mx.argmax(pair.target(tok, cache=cache)[:, -1:], -1)
            mx.eval(tok)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[SKIP:])


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    pair = prepare(None, None, block_size="auto").pair
    prompts = [[(37 * j + 11 * i) % 20000 + 100 for j in range(60 + 9 * i)] for i in range(rows)]
    for _ in range(2):
        ours, queued, theirs = (
            ragged(pair, prompts, False),
            ragged(pair, prompts, True),
            padded(pair, prompts),
        )
        print(
            f"B={rows}: ragged {ours:.1f} ms, ragged + capture queue {queued:.1f} ms, "
            f"mlx-lm padded {theirs:.1f} ms (ratio {theirs / ours:.3f} / {theirs / queued:.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
