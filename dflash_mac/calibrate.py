"""The pair's cost curve on this machine: the time of one decode cycle at block size 1..N
relative to a plain one-token step, the prior of `--block-size auto` (docs/bench.md).

Cycles are timed by running the decode loop itself (`decode.speculative_stream`) at one fixed
size with a controller that keeps the loop's own cycle times (from one host sync to the next,
steady cycles only, as the online cost model learns them), so a change to how cycles run
changes the prior with it. bs = 1 is a run of plain steps, each queued on the previous one's
still-lazy token (as mlx-lm's `generate_step`), so the ratios compare a drafting cycle with the
plain decoding it replaces. Each size is run `reps` times, round robin over the sizes, after
a short warm-up round (each kind of cycle once: its first run pays for MLX's compiles), on a
prompt of `context` tokens that is cut back after every run; the median is kept, and the
ratios are made non-decreasing in bs (a wider verify never costs less: a dip is noise). The
whole curve is timed greedy and again at T = 0.7 (`measure_both`);
both are saved where `auto` reads its prior (`sizing.files.cost_curve_path`).

`dflash-mac bench --cost-curve` measures the full curve (`reps` 12) and, where the pair batches,
greedy batched cycles of 2, 4 and 8 rows (`measure_batches`: the prior of `BatchBlockRule`).
Front ends that run `auto` call `needed` / `calibrate` once their inputs are checked: a pair
without a saved curve on this machine gets a quick one (`QUICK_REPS` rounds over `quick_sizes`
up to auto's largest, the sizes between interpolated) measured once and saved, because sizes
`auto` does not run keep the prior's cost, and the generic guess can be far from a machine's
curve (a GPU's wide verify costs little more than one token).
`DFLASH_MAC_CALIBRATE=0` turns that off."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .batching.ragged import batch_reason
from .batching.scheduler import BatchEngine, BatchRequest
from .drafting.copies import CopyRates
from .engine.cycle import trees_allowed
from .engine.decode import DecodeState, GenerationConfig, speculative_stream
from .engine.drafts import propose
from .engine.verify import SamplingParams
from .host import write_atomic
from .pair import Pair
from .sizing.batch_rule import BatchBlockRule
from .sizing.choice import BlockChoice
from .sizing.controller import TREES, Decision
from .sizing.cost import ContextCost, noise
from .sizing.files import cost_curve_path

BATCHES = (2, 4, 8)  # rows of the batched cycles `bench --cost-curve` times (serve --max-batch)
BATCH_CYCLES = 6  # steady batched cycles timed per (rows, block size)
PLAIN_BURST = 8  # plain steps timed as a run, each queued before the previous one's sync
SAMPLED_TEMP = 0.7  # the sampled curve's temperature (the chat default of most pairs)
FULL_REPS = 12  # `bench --cost-curve`
LONG_CONTEXTS = (1024, 2048, 4096)  # where `bench --cost-curve` times how costs grow
CONTEXT_REPS = 3  # measured rounds at each of them
QUICK_REPS = 3  # the curve measured at first use of `auto` (at `quick_sizes`)
QUICK_SECONDS = 3.0  # more quick rounds (up to FULL_REPS) while the first took under this
QUICK_TRIES = 3  # first uses that measure it again while it comes out noisy (a busy host)
NOISY_RETRIES = 2  # times a measurement adds `reps` more rounds while its medians look busy
WARMUP_ROUNDS = 1  # a short one (`script(..., warmup=True)`)
WARMUP_PLAIN = 3  # plain steps in it: the first ones after a drafting cycle are not steady
CALIBRATE_ENV = "DFLASH_MAC_CALIBRATE"  # "0": no quick curve at first use

Progress = Callable[[], None]  # called after each round over the sizes


Arm = tuple[int, int]  # (block size, tree budget; 0: a chain)


class ScriptedSizes:
    """A block-size controller for the measurement (a `sizing.sizer.BlockSizer`): the cycles
    of a script, one per cycle, keeping the times of the steady cycles of each kind (what the
    loop's cost model learns from: a plain step amid plain steps, a drafting cycle after a
    drafting one). It prices no copies: the measurement copies nothing."""

    def __init__(self, arms: list[Arm]):
        self.script, self.next = arms, 0
        self.last = Decision(arms[0][0], "measuring", tree=arms[0][1])
        self.updates = 0
        self.seconds: dict[Arm, list[float]] = {}
        self.copy_rates = CopyRates()  # (the measurement copies nothing)

    def choose(self) -> Decision:
        size, tree = self.script[min(self.next, len(self.script) - 1)]
        self.next += 1
        self.last = Decision(size, "measuring", tree=tree)
        return self.last

    def update(
        self,
        bs: int,
        accepted: int,
        seconds: float | None,
        steady: bool = True,
        tree: int = 0,
        chain: int = 0,
        odds: Sequence[float] = (),
        reach: int = 0,
    ) -> None:
        self.updates += 1
        if steady and seconds:
            self.seconds.setdefault((bs, tree), []).append(seconds)

    @property
    def done(self) -> bool:
        return self.updates >= len(self.script)


def script(arms: list[Arm], rng: random.Random, warmup: bool = False) -> list[Arm]:
    """One round's cycles: every kind in a shuffled order (load drifts and the context growing
    over the round hit all kinds alike), a run of plain steps, two cycles of each other kind
    (the first after plain steps is not steady). A warm-up round runs each kind once: on
    the real pair a full warm-up round measured like the rounds after it, so a second one (a
    sixth of the quick curve's time) bought nothing."""
    order = rng.sample(arms, len(arms))
    plain, other = (WARMUP_PLAIN, 1) if warmup else (PLAIN_BURST + 1, 2)
    return [a for arm in order for a in [arm] * (plain if arm[0] == 1 else other)]


def prompt_ids(vocab: int, context: int) -> list[int]:
    """The measurement's prompt: `context` token ids spread over the vocabulary."""
    return [(7919 * i + 11) % vocab for i in range(context)]


def timed_rounds(
    pair: Pair,
    ids: list[int],
    arms: list[Arm],
    max_bs: int,
    sp: SamplingParams,
    reps: int,
    state: DecodeState,
    progress: Progress | None = None,
    budget: float = 0.0,
) -> Iterator[tuple[DecodeState, dict[Arm, list[float]]]]:
    """Run `reps` measured rounds (after WARMUP_ROUNDS) of every arm's cycles on the prompt
    `ids`, cut back to it after each round; yield the state and the steady cycle times by arm
    of each measured round. Then more rounds, up to max(reps, FULL_REPS), while the measured
    ones took under `budget` seconds (not counted by `progress`): a small model's cycles take
    milliseconds, and three rounds of them priced its block 8 at 2.9 plain steps where twelve
    said 2.4."""
    rng = random.Random(0)
    start = time.perf_counter()
    for r in range(max(reps, FULL_REPS) + WARMUP_ROUNDS):
        measured = r - WARMUP_ROUNDS
        if measured >= reps and time.perf_counter() - start >= budget:
            break
        timer = ScriptedSizes(script(arms, rng, warmup=r < WARMUP_ROUNDS))
        longest = sum(bs for bs, _ in timer.script) + 1
        cfg = GenerationConfig(
            longest, BlockChoice(max_bs), sp, seed=r, use_eos=False, copy=False, tree=0
        )  # the drafter's cycles of each kind: no copies in between
        for _ in speculative_stream(
            pair, ids, cfg, state, lambda t=timer: t.done, controller=timer
        ):
            pass
        if not state.rollback.hybrid:
            state.trim_to(len(ids) - 1)  # the next round prefills the last prompt token
        if r >= WARMUP_ROUNDS:
            yield state, timer.seconds
        if state.rollback.hybrid:  # its state cannot be cut back to the prompt: anew
            state = DecodeState(pair)
        if r < WARMUP_ROUNDS:
            start = time.perf_counter()
        if progress and measured < reps:
            progress()


def quick_sizes(max_bs: int) -> list[int]:
    """The block sizes the quick curve times: 1..4, then every other size and `max_bs` (a
    verify's cost grows smoothly with its width past a few tokens: the rest are interpolated)."""
    return sorted({*range(1, min(4, max_bs) + 1), *range(6, max_bs, 2), max_bs})


def interpolate(values: dict[int, float], max_bs: int) -> dict[int, float]:
    """`values` at every size 1..max_bs: a missing size on the line between its neighbours."""
    known = sorted(values)
    out = {}
    for bs in range(1, max_bs + 1):
        lo = max(k for k in known if k <= bs)
        hi = min(k for k in known if k >= bs)
        w = 0.0 if hi == lo else (bs - lo) / (hi - lo)
        out[bs] = values[lo] + w * (values[hi] - values[lo])
    return out


def measure(
    pair: Pair,
    max_bs: int = 16,
    context: int = 128,
    reps: int = FULL_REPS,
    temperature: float = 0.0,
    progress: Progress | None = None,
    sizes: list[int] | None = None,
    budget: float = 0.0,
) -> dict:
    """Median seconds per cycle for bs = 1..max_bs and the ratios to bs = 1, greedy or (with
    `temperature`) sampled: drafts drawn, verified by rejection, plain steps drawn too; where
    the target takes trees, also tree cycles of `auto`'s budgets at depth max_bs - 1 (`trees`,
    by budget). The drafter pass is also timed alone (`draft_seconds`, bs >= 2): the rest of a
    cycle is its verify and the host sync. Given `sizes` (1 and max_bs among them), only those
    are timed and the others interpolated (listed under `interpolated`). Where the medians
    read as a busy machine's (`sizing.cost.noise`), `reps` more rounds are timed, up to
    NOISY_RETRIES times (`retried`). `budget`: seconds the first `reps` rounds may grow to
    with more (`timed_rounds`); `reps` in the table is the first rounds' count."""
    ids = prompt_ids(pair.drafter.config.vocab_size, context)
    sp = SamplingParams(temperature)
    sizes = sorted(sizes) if sizes else list(range(1, max_bs + 1))
    state = DecodeState(pair)
    budgets = (
        TREES if max_bs > 1 and trees_allowed(pair, state.target_cache, None, None, None) else ()
    )
    arms = [(bs, 0) for bs in sizes] + [(max_bs, b) for b in budgets]
    times: dict[Arm, list[float]] = {arm: [] for arm in arms}
    drafting: dict[int, list[float]] = {bs: [] for bs in sizes[1:]}
    mask, key = pair.drafter.config.mask_token_id, mx.random.key(0)
    measured = 0
    for attempt in range(1 + NOISY_RETRIES):  # more rounds while the medians look busy
        if attempt and state.rollback.hybrid:
            state = DecodeState(pair)
        first = attempt == 0  # only the first rounds may grow with `budget`, and are counted
        rounds = timed_rounds(pair, ids, arms, max_bs, sp, reps, state, progress, budget * first)
        for now, seconds in rounds:
            measured += first
            for arm, timed in seconds.items():
                times[arm] += timed
            for bs in drafting:  # the drafter pass alone (it leaves its context as it was)
                block = mx.array([ids[-1]] + [mask] * (bs - 1), mx.int32)
                with mx.stream(generation_stream):
                    t = time.perf_counter()
                    mx.eval(propose(pair, block, now.draft_cache, sp, key)[0])
                    drafting[bs].append(time.perf_counter() - t)
        table = curve_table(times, drafting, sizes, budgets, max_bs)
        progress = None  # the extra rounds are not in the caller's count
        if not noise(table):
            break
    between = [b for b in range(1, max_bs + 1) if b not in sizes]  # interpolated
    return (
        table
        | {"tree_depth": max_bs - 1, "context": context, "reps": measured}
        | ({"interpolated": between} if between else {})
        | ({"retried": attempt} if attempt else {})  # `reps` more rounds, `attempt` times
    )


def curve_table(
    times: dict[Arm, list[float]],
    drafting: dict[int, list[float]],
    sizes: list[int],
    budgets: tuple[int, ...],
    max_bs: int,
) -> dict:
    """The medians of the timed cycles as a curve's table: seconds by block size (the sizes
    not timed interpolated), ratios made non-decreasing, the drafter pass, trees."""
    seconds = interpolate({bs: statistics.median(times[(bs, 0)]) for bs in sizes}, max_bs)
    ratios = non_decreasing([seconds[bs] / seconds[1] for bs in range(2, max_bs + 1)])
    draft = {bs: statistics.median(ts) for bs, ts in drafting.items()}
    timed = [b for b in budgets if times[(max_bs, b)]]
    trees = {b: statistics.median(times[(max_bs, b)]) / seconds[1] for b in timed}
    return {
        "seconds": {str(b): s for b, s in seconds.items()},
        "draft_seconds": {str(b): s for b, s in draft.items()},
        "ratios": {"1": 1.0} | {str(b): r for b, r in enumerate(ratios, start=2)},
        "trees": {str(b): r for b, r in trees.items()},
    }


def contexts_for(pair: Pair, bs: int, contexts: tuple[int, ...] = LONG_CONTEXTS) -> list[int]:
    """The long contexts the pair's target has room for (with a measurement round after)."""
    room = pair.context_length - (PLAIN_BURST + 1 + 2 * bs) * 2
    return [n for n in contexts if n <= room]


def measure_contexts(
    pair: Pair,
    bs: int,
    base: int = 128,
    contexts: tuple[int, ...] = LONG_CONTEXTS,
    reps: int = CONTEXT_REPS,
    progress: Progress | None = None,
) -> dict:
    """A plain step and a greedy cycle of `bs` tokens timed at a short context (`base`) and at
    the longer `contexts` the target has room for, and the fit `auto` prices long contexts with
    (`ContextCost.fit`): ``{"long_context": {"base", "growth", "slope", "block_size",
    "points": [{"context", "plain", "cycle"}]}}``."""
    vocab = pair.drafter.config.vocab_size
    points = []
    for n in [base, *contexts_for(pair, bs, contexts)]:
        ids = prompt_ids(vocab, n)
        arms = [(1, 0), (bs, 0)]
        times: dict[Arm, list[float]] = {arm: [] for arm in arms}
        state, greedy = DecodeState(pair), SamplingParams()
        for _, seconds in timed_rounds(pair, ids, arms, bs, greedy, reps, state, progress):
            for arm, timed in seconds.items():
                times[arm] += timed
        plain, cycle = (statistics.median(times[arm]) for arm in arms)
        points.append({"context": n, "plain": plain, "cycle": cycle})
    fit = ContextCost.fit(points, bs)
    return {
        "long_context": {"base": fit.base, "growth": fit.growth, "slope": fit.slope}
        | {"block_size": bs, "points": points}
    }


@dataclass
class TimedRule(BatchBlockRule):
    """A fixed block size whose every cycle time is kept (the batched measurement's
    `sizing.sizer.BatchSizer`)."""

    samples: list[float] = field(default_factory=list)

    def update(
        self,
        batch: int,
        bs: int,
        seconds: float | None,
        accepted: list[int],
        odds: Sequence[Sequence[float]] = (),
    ) -> None:
        if seconds is not None:  # None: a cycle with copies, not one of this shape
            self.samples.append(seconds)


def batch_sizes(bs_max: int) -> list[int]:
    """The block sizes a batched table covers: those the batch's block rule weighs."""
    return BatchBlockRule(bs_max).candidates


def measure_batches(
    pair: Pair,
    bs_max: int,
    plain_seconds: float,
    batches: tuple[int, ...] = BATCHES,
    context: int = 128,
    cycles: int = BATCH_CYCLES,
    progress: Progress | None = None,
) -> dict:
    """Median seconds of a greedy batched cycle (`batching.scheduler.BatchEngine`, every row on
    the same prompt of `context` tokens) of B rows at each block size the batch rule weighs, and
    its ratio to a one-row plain step (`plain_seconds`): ``{"batches": {B: {bs: ratio}},
    "batch_seconds": ...}``. The first two cycles of each (B, bs) compile and are not kept."""
    ids = prompt_ids(pair.drafter.config.vocab_size, context)
    seconds: dict[str, dict[str, float]] = {}
    for rows in batches:
        for bs in batch_sizes(bs_max):
            rule = TimedRule(bs, fixed=True)
            engine = BatchEngine(pair, rows, rule=rule)
            cfg = GenerationConfig(
                (cycles + 3) * bs + 1, BlockChoice(bs), SamplingParams(), use_eos=False, copy=False
            )
            for _ in range(rows):
                engine.add(
                    BatchRequest(
                        ids,
                        cfg,
                        DecodeState(pair),
                        emit=lambda e: None,
                        should_stop=lambda r=rule: len(r.samples) >= cycles + 2,
                    )
                )
            engine.run()
            kept = rule.samples[2:] or rule.samples
            seconds.setdefault(str(rows), {})[str(bs)] = statistics.median(kept)
            if progress:
                progress()
    ratios = {b: {k: v / plain_seconds for k, v in row.items()} for b, row in seconds.items()}
    return {"batches": ratios, "batch_seconds": seconds}


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
    batched: bool = False,
    contexts: bool = False,
    sizes: list[int] | None = None,
    budget: float = 0.0,
) -> dict:
    """The greedy curve, with the curve at SAMPLED_TEMP under "sampled" (what `auto` uses as
    its prior for requests with a temperature); `batched`, where the pair decodes in batches
    (serve --max-batch), also the batched cycles up to the pair's block size
    (`measure_batches`); `contexts`, also how a cycle at the pair's block size grows with the
    context (`measure_contexts`). `sizes`, `budget`: as `measure`'s."""
    curve = measure(pair, max_bs, context, reps, progress=progress, sizes=sizes, budget=budget)
    sampled = measure(pair, max_bs, context, reps, SAMPLED_TEMP, progress, sizes, budget)
    curve |= {"sampled": {"temperature": SAMPLED_TEMP} | sampled}
    if batched and batch_reason(pair) is None:
        plain = curve["seconds"]["1"]
        curve |= measure_batches(pair, pair.block_size, plain, context=context, progress=progress)
    if contexts:
        curve |= measure_contexts(pair, pair.block_size, context, progress=progress)
    return curve


def rounds(reps: int) -> int:
    """How many times `measure_both` calls its `progress`."""
    return 2 * (reps + WARMUP_ROUNDS)


def all_rounds(pair: Pair, reps: int) -> int:
    """How many times `measure_both(..., batched=True, contexts=True)` calls its `progress`."""
    batched = len(BATCHES) * len(batch_sizes(pair.block_size)) if batch_reason(pair) is None else 0
    long = (1 + len(contexts_for(pair, pair.block_size))) * (CONTEXT_REPS + WARMUP_ROUNDS)
    return rounds(reps) + batched + long


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
    for a distributed target (rank 0 alone cannot time the sharded forward the same way) and where
    the data directory cannot be made (nowhere to keep it: `auto` keeps the guess)."""
    if os.environ.get(CALIBRATE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if bs_max < 2 or pair.mirror is not None:
        return False
    try:
        cost_curve_path(pair)
    except OSError:
        return False
    data = saved(pair) or {}
    both = sizes(data) & sizes(data.get("sampled"))
    again = data.get("quick") and data.get("tries", 1) < QUICK_TRIES and bool(busy(data))
    return max(both, default=0) < bs_max or again


def busy(data: dict) -> list[str]:
    """Why a saved curve reads as timed on a busy machine (`sizing.cost.noise`, greedy and
    sampled); `auto` ignores such a curve."""
    sampled = data.get("sampled")
    return noise(data) + [f"sampled: {n}" for n in noise(sampled) if isinstance(sampled, dict)]


def prior_name(pair: Pair) -> str:
    """What `auto` starts from for the pair on this machine, in words (the bench's header)."""
    data = saved(pair)
    if not data or not sizes(data):
        return "the generic guess (no cost curve saved on this machine)"
    kind = "quick curve (first use)" if data.get("quick") else "curve (bench --cost-curve)"
    if found := busy(data):
        return f"the generic guess (the saved {kind} was timed on a busy machine: {found[0]})"
    between = data.get("interpolated") or []
    gaps = f" ({', '.join(map(str, between))} interpolated)" if between else ""
    return f"{kind}, bs 1..{max(sizes(data))}{gaps}, {data.get('reps', '?')} timings per size"


def needed(pair: Pair, block: BlockChoice) -> bool:
    """Whether a command run with `block` measures the quick curve first: `auto` and
    `missing` up to its largest size."""
    return block.auto and missing(pair, block.size)


def title(block: BlockChoice) -> str:
    """What the front ends show while `calibrate` runs."""
    return f"Timing block sizes 1..{block.size} on this machine (once for this pair)"


def steps() -> int:
    """How many times `calibrate` calls its `progress`."""
    return rounds(QUICK_REPS)


def calibrate(pair: Pair, bs_max: int, progress: Progress | None = None) -> Path | str:
    """Measure the quick curve up to `bs_max`, greedy and sampled, and save it for `auto`:
    its path, or why it could not be saved (a sentence; generation goes on regardless)."""
    sizes = quick_sizes(bs_max)
    curve = measure_both(
        pair, bs_max, reps=QUICK_REPS, progress=progress, sizes=sizes, budget=QUICK_SECONDS
    )
    path = cost_curve_path(pair)
    before = saved(pair) or {}
    again = before.get("quick") and busy(before) and busy(curve)  # busy again: count it
    tries = before.get("tries", 1) + 1 if again else 1
    try:
        return save(curve | {"quick": True, "tries": tries}, path)
    except OSError as e:
        return f"could not save the cost curve of --block-size auto to {path} ({e.strerror or e})."
