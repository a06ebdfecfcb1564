"""The pair's cost curve on this machine: the time of one decode cycle at block size 1..N
relative to a plain one-token step, the prior of `--block-size auto` (docs/bench.md).

A cycle at block size bs is the drafter pass for `[anchor, MASK × bs-1]` plus the target's
verify of bs tokens and the one host sync, exactly as the decode loop runs it
(`decode.queue_cycle` / `decode.verify`); bs = 1 is a plain target step, timed as the loop
runs a run of them (`PLAIN_BURST` steps, each queued on the previous one's still-lazy token
before its sync, as mlx-lm's `generate_step` does), so the ratios compare a drafting cycle with
the plain decoding it replaces, not with a stalled single step. Each size is timed `reps`
times, round robin over the sizes, after two warm-up rounds on a prompt of `context` tokens,
the target cache trimmed back after every cycle; the median is kept, and the ratios are made
non-decreasing in bs (a wider verify never costs less: a dip is noise). The whole curve is timed
greedy and again at T = 0.7 (`measure_both`: sampled cycles draw their drafts and verify by
rejection); both are saved where `auto` reads its prior (`policy.cost_curve_path`), the
sampled one for requests with a temperature.

`dflash-mac bench --cost-curve` measures the full curve (`reps` 12). Front ends that run
`auto` call `needed` / `calibrate` once their inputs are checked: a pair without a saved curve
on this machine gets a quick one (`QUICK_REPS`, sizes up to auto's largest) measured once and
saved, because sizes `auto` does not run keep the prior's cost, and the generic guess can be
far from a machine's curve (a GPU's wide verify costs little more than one token).
`DFLASH_MAC_CALIBRATE=0` turns that off."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .capture import FeatureCapture, queues_layers
from .decode import DecodeState, DraftContext, prefill, propose, queue_cycle, queue_verify
from .distributed.group import world
from .pair import Pair
from .platform import write_atomic
from .policy import AUTO, cost_curve_path
from .sampling import SamplingParams

PLAIN_BURST = 8  # plain steps timed as a run, each queued before the previous one's sync
SAMPLED_TEMP = 0.7  # the sampled curve's temperature (the chat default of most pairs)
FULL_REPS = 12  # `bench --cost-curve`
QUICK_REPS = 4  # the curve measured at first use of `auto`
WARMUP_ROUNDS = 2
CALIBRATE_ENV = "DFLASH_MAC_CALIBRATE"  # "0": no quick curve at first use

Progress = Callable[[], None]  # called after each round over the sizes


def measure(
    pair: Pair,
    max_bs: int = 16,
    context: int = 128,
    reps: int = FULL_REPS,
    temperature: float = 0.0,
    progress: Progress | None = None,
) -> dict:
    """Median seconds per cycle for bs = 1..max_bs and the ratios to bs = 1, greedy or (with
    `temperature`) sampled: drafts drawn, verified by rejection, plain steps drawn too. The
    drafter pass is also timed alone (`draft_seconds`, bs >= 2): the rest of a cycle is its
    verify and the host sync."""
    vocab = pair.drafter.config.vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(context)]
    state = DecodeState(pair)
    burst = 1 if state.rollback.hybrid else PLAIN_BURST  # a hybrid trims one verify at most
    sp = SamplingParams(temperature)
    key = mx.random.key(0)
    times: dict[int, list[float]] = {bs: [] for bs in range(1, max_bs + 1)}
    drafting: dict[int, list[float]] = {bs: [] for bs in range(2, max_bs + 1)}
    mask = pair.drafter.config.mask_token_id
    with (
        FeatureCapture(pair.target, pair.layer_ids, queue=queues_layers()) as cap,
        state.rollback.hooks(),
        mx.stream(generation_stream),
    ):
        prefill(pair, state, ids, cap, 2048)
        ctx = DraftContext(pair.drafter, state.draft_cache)
        for _ in range(reps + WARMUP_ROUNDS):  # round robin: load drifts hit all sizes alike
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
                if bs > 1:  # the drafter pass alone (it leaves its context cache as it was)
                    block = mx.array([ids[-1]] + [mask] * (bs - 1), mx.int32)
                    t = time.perf_counter()
                    mx.eval(propose(pair, block, ctx.cache, sp, key)[0])
                    drafting[bs].append(time.perf_counter() - t)
            if progress:
                progress()
    seconds = {bs: statistics.median(ts[WARMUP_ROUNDS:]) for bs, ts in times.items()}
    ratios = non_decreasing([seconds[bs] / seconds[1] for bs in range(2, max_bs + 1)])
    draft = {bs: statistics.median(ts[WARMUP_ROUNDS:]) for bs, ts in drafting.items()}
    return {
        "seconds": {str(b): s for b, s in seconds.items()},
        "draft_seconds": {str(b): s for b, s in draft.items()},
        "ratios": {"1": 1.0} | {str(b): r for b, r in enumerate(ratios, start=2)},
        "context": context,
        "reps": reps,
    }


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): runs that dip are
    replaced by their mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def measure_both(
    pair: Pair,
    max_bs: int = 16,
    context: int = 128,
    reps: int = FULL_REPS,
    progress: Progress | None = None,
) -> dict:
    """The greedy curve, with the curve at SAMPLED_TEMP under "sampled" (what `auto` uses as
    its prior for requests with a temperature)."""
    curve = measure(pair, max_bs, context, reps, progress=progress)
    sampled = measure(pair, max_bs, context, reps, SAMPLED_TEMP, progress)
    return curve | {"sampled": {"temperature": SAMPLED_TEMP} | sampled}


def rounds(reps: int) -> int:
    """How many times `measure_both` calls its `progress`."""
    return 2 * (reps + WARMUP_ROUNDS)


def save(curve: dict, path: Path) -> Path:
    return write_atomic(path, json.dumps(curve, indent=1) + "\n")


def saved(pair: Pair) -> dict | None:
    """The curve saved for the pair on this machine; None when absent or unreadable."""
    try:
        data = json.loads(cost_curve_path(pair).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def sizes(table: object) -> set[int]:
    """The block sizes a saved ratio table covers (none when it is malformed)."""
    try:
        return {int(b) for b in table["ratios"]}
    except (KeyError, TypeError, ValueError):
        return set()


def missing(pair: Pair, bs_max: int) -> bool:
    """True when `auto` up to `bs_max` would run on the generic guess and a quick curve should
    be measured first: no readable curve with a greedy and a sampled table is saved for the
    pair on this machine, or it stops short of `bs_max`. False with `DFLASH_MAC_CALIBRATE=0`,
    in a distributed job (rank 0 alone cannot time the sharded forward the same way) and where
    the data directory cannot be made (nowhere to keep it: `auto` keeps the guess)."""
    if os.environ.get(CALIBRATE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if bs_max < 2 or world() is not None:
        return False
    try:
        cost_curve_path(pair)
    except OSError:
        return False
    data = saved(pair) or {}
    both = sizes(data) & sizes(data.get("sampled"))
    return max(both, default=0) < bs_max


def prior_name(pair: Pair) -> str:
    """What `auto` starts from for the pair on this machine, in words (the bench's header)."""
    data = saved(pair)
    if not data or not sizes(data):
        return "the generic guess (no cost curve saved on this machine)"
    kind = "quick curve (first use)" if data.get("quick") else "curve (bench --cost-curve)"
    return f"{kind}, bs 1..{max(sizes(data))}, {data.get('reps', '?')} timings per size"


def needed(pair: Pair, requested: int | str | None) -> bool:
    """Whether a command run with `--block-size requested` measures the quick curve first:
    `auto` (None or "auto", up to `pair.block_size`) and `missing`."""
    return requested in (None, AUTO) and missing(pair, pair.block_size)


def title(pair: Pair) -> str:
    """What the front ends show while `calibrate` runs."""
    return f"Timing block sizes 1..{pair.block_size} on this machine (once for this pair)"


def steps() -> int:
    """How many times `calibrate` calls its `progress`."""
    return rounds(QUICK_REPS)


def calibrate(pair: Pair, bs_max: int, progress: Progress | None = None) -> Path | str:
    """Measure the quick curve up to `bs_max`, greedy and sampled, and save it for `auto`:
    its path, or why it could not be saved (a sentence; generation goes on regardless)."""
    curve = measure_both(pair, bs_max, reps=QUICK_REPS, progress=progress)
    path = cost_curve_path(pair)
    try:
        return save(curve | {"quick": True}, path)
    except OSError as e:
        return f"could not save the cost curve of --block-size auto to {path} ({e.strerror or e})."
