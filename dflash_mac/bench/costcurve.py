"""`dflash-mac bench --cost-curve`: the time of one decode cycle at block size 1..N relative
to a plain one-token step, on this machine and pair (docs/bench.md).

A cycle at block size bs is the drafter pass for `[anchor, MASK × bs-1]` plus the target's
verify of bs tokens and the one host sync, exactly as the decode loop runs it
(`decode.queue_cycle` / `decode.verify`); bs = 1 is a plain target step, timed as the loop
runs a run of them (`PLAIN_BURST` steps, each queued on the previous one's still-lazy token
before its sync, as mlx-lm's `generate_step` does), so the ratios compare a drafting cycle with
the plain decoding it replaces, not with a stalled single step. Each size is timed
`reps` times, round robin over the sizes, after a warm-up on a prompt of `context` tokens, the
target cache trimmed back after every cycle, and the median kept. The whole curve is timed
greedy and again at T = 0.7 (`measure_both`: sampled cycles draw their drafts and verify by
rejection); both are saved where `--block-size auto` reads its prior
(`policy.cost_curve_path`), the sampled one for requests with a temperature."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from dflash_mac.pair import Pair

PLAIN_BURST = 8  # plain steps timed as a run, each queued before the previous one's sync
SAMPLED_TEMP = 0.7  # the sampled curve's temperature (the chat default of most pairs)


def measure(
    pair: Pair, max_bs: int = 16, context: int = 128, reps: int = 12, temperature: float = 0.0
) -> dict:
    """Median seconds per cycle for bs = 1..max_bs and the ratios to bs = 1, greedy or (with
    `temperature`) sampled: drafts drawn, verified by rejection, plain steps drawn too."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from dflash_mac.capture import FeatureCapture, queues_layers
    from dflash_mac.decode import DecodeState, DraftContext, prefill, queue_cycle, queue_verify
    from dflash_mac.sampling import SamplingParams

    vocab = pair.drafter.config.vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(context)]
    state = DecodeState(pair)
    burst = 1 if state.rollback.hybrid else PLAIN_BURST  # a hybrid trims one verify at most
    sp = SamplingParams(temperature)
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


def measure_both(pair: Pair, max_bs: int = 16, context: int = 128, reps: int = 12) -> dict:
    """The greedy curve, with the curve at SAMPLED_TEMP under "sampled" (what `auto` uses as
    its prior for requests with a temperature)."""
    curve = measure(pair, max_bs, context, reps)
    sampled = measure(pair, max_bs, context, reps, SAMPLED_TEMP)
    return curve | {"sampled": {"temperature": SAMPLED_TEMP} | sampled}


def save(curve: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve, indent=1) + "\n")
    return path


def render(curve: dict, width: int = 40) -> str:
    """A table and a terminal plot of the ratios; the break-even column is the tokens a cycle
    must commit on average to match plain decoding. A sampled curve adds its own columns."""
    ratios = {int(b): r for b, r in curve["ratios"].items()}
    secs = {int(b): s for b, s in curve["seconds"].items()}
    sampled = curve.get("sampled")
    s_ratios = {int(b): r for b, r in sampled["ratios"].items()} if sampled else {}
    s_secs = {int(b): s for b, s in sampled["seconds"].items()} if sampled else {}
    top = max([*ratios.values(), *s_ratios.values()])
    head = "bs   ms/cycle   × plain step   break-even τ"
    if sampled:
        head += f"   T {sampled['temperature']:g}: ms   × plain step"

    def row(b: int, r: float) -> str:
        line = f"{b:>2} {1000 * secs[b]:>10.2f} {r:>14.2f} {r:>14.2f}"
        if b in s_ratios:
            line += f" {1000 * s_secs[b]:>12.2f} {s_ratios[b]:>14.2f}"
        return f"{line}  {'█' * max(1, round(width * r / top))}"

    lines = [head, *(row(b, r) for b, r in sorted(ratios.items()))]
    return "\n".join(lines) + "\n"
