"""`dflash-mac bench --cost-curve`: the time of one decode cycle at block size 1..N relative
to a plain one-token step, on this machine and pair (docs/bench.md).

A cycle at block size bs is the drafter pass for `[anchor, MASK × bs-1]` plus the target's
verify of bs tokens and the one host sync, exactly as the decode loop runs it
(`decode.queue_cycle` / `decode.verify`); bs = 1 is a plain target step, timed as the loop
runs a run of them (`PLAIN_BURST` steps, each queued on the previous one's still-lazy token
before its sync, as mlx-lm's `generate_step` does), so the ratios compare a drafting cycle with
the plain decoding it replaces, not with a stalled single step. Each size is timed
`reps` times, round robin over the sizes, after a warm-up on a prompt of `context` tokens, the
target cache trimmed back after every cycle, and the median kept. The ratios are saved where
`--block-size auto` reads its prior (`policy.cost_curve_path`)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from dflash_mac.pair import Pair

PLAIN_BURST = 8  # plain steps timed as a run, each queued before the previous one's sync


def measure(pair: Pair, max_bs: int = 16, context: int = 128, reps: int = 12) -> dict:
    """Median seconds per cycle for bs = 1..max_bs and the ratios to bs = 1."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from dflash_mac.capture import FeatureCapture, queues_layers
    from dflash_mac.decode import DecodeState, DraftContext, prefill, queue_cycle, queue_verify
    from dflash_mac.sampling import SamplingParams

    vocab = pair.drafter.config.vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(context)]
    state = DecodeState(pair)
    burst = 1 if state.rollback.hybrid else PLAIN_BURST  # a hybrid trims one verify at most
    sp = SamplingParams()
    key = mx.random.key(0)
    times: dict[int, list[float]] = {bs: [] for bs in range(1, max_bs + 1)}
    with (
        FeatureCapture(pair.target, pair.layer_ids, queue=queues_layers()) as cap,
        state.rollback.hooks(),
        mx.stream(generation_stream),
    ):
        prefill(pair, state, ids, cap, 2048)
        ctx = DraftContext(pair.drafter, state.draft_cache)
        for _ in range(reps + 2):  # round robin over the sizes: load drifts hit all alike
            for bs in times:
                n = burst if bs == 1 else 1
                t = time.perf_counter()
                c = queue_cycle(pair, state, ctx, bs, ids[-1], sp, key)
                for i in range(n):
                    if c.outcome is None:
                        queue_verify(pair, state, c, sp)
                    nxt = (
                        queue_cycle(pair, state, ctx, 1, c.verdict[1], sp, key)
                        if i < n - 1
                        else None
                    )
                    c.outcome.tolist()  # the cycle's one host sync
                    c = nxt
                times[bs].append((time.perf_counter() - t) / n)
                if state.rollback.hybrid:  # keep the pass whole: its window can then be cut
                    state.rollback.rollback(0, bs - 1)
                state.rollback.trim(bs * n)  # back to the prompt
    seconds = {bs: statistics.median(ts[2:]) for bs, ts in times.items()}  # two warm-ups
    unit = seconds[1]
    return {
        "seconds": {str(b): s for b, s in seconds.items()},
        "ratios": {str(b): (1.0 if b == 1 else s / unit) for b, s in seconds.items()},
        "context": context,
        "reps": reps,
    }


def save(curve: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve, indent=1) + "\n")
    return path


def render(curve: dict, width: int = 40) -> str:
    """A table and a terminal plot of the ratios; the break-even column is the tokens a cycle
    must commit on average to match plain decoding."""
    ratios = {int(b): r for b, r in curve["ratios"].items()}
    secs = {int(b): s for b, s in curve["seconds"].items()}
    top = max(ratios.values())
    lines = [
        "bs   ms/cycle   × plain step   break-even τ",
        *(
            f"{b:>2} {1000 * secs[b]:>10.2f} {r:>14.2f} {r:>14.2f}  "
            f"{'█' * max(1, round(width * r / top))}"
            for b, r in sorted(ratios.items())
        ),
    ]
    return "\n".join(lines) + "\n"
