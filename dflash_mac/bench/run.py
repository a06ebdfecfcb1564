"""The bench runner: same-process baseline vs DFlash, warmed up, lossless-checked
(docs/design.md §9).

For every prompt (seeded shuffle per trial) the runner measures plain target decoding
(`mlx_lm.generate.generate_step` on `pair.target`, no capture hooks; where the engine queues
the target's layers as they are built, on MLX's CPU backend, the baseline's layers are queued
the same way, so the comparison measures DFlash and not that queueing) and DFlash
(`dflash_mac.api.stream_generate`) for each block size, in orders balanced over the
prompts (`balanced_orders`).
Both are timed identically by the runner:

- TTFT: from the call to the first token on the host (prefill + first sample);
- decode tok/s: tokens after the first ÷ time from the first token to the last one;
- peak memory: `mx.reset_peak_memory()` before the run, `mx.get_peak_memory()` after.

Aggregation is in summary.py, the report in report.py, the live view in view.py and the
command in command.py.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_mac.api import check_context
from dflash_mac.drafting.suffix import SuffixMemory
from dflash_mac.engine.stats import drafter_cycles, drafting, histogram
from dflash_mac.pair import Pair
from dflash_mac.settings import AUTO
from dflash_mac.sizing.tuning import AutoTuning

from .inputs import BenchPrompt

# -- measuring ----------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """What to measure."""

    block_sizes: list[int]
    max_tokens: int = 128
    trials: int = 2
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    use_eos: bool = True
    cooldown: float = 0.0
    warmup_tokens: int = 16
    seeded_dflash: bool = False  # sampled DFlash runs seeded too (auto then relearns each run)
    copy: bool | None = None  # copy drafting in the DFlash runs (None: not at block 1)
    tree: int | None = None  # tree drafting (None: `auto` weighs trees; 0 chains; N nodes)
    suffix: bool | None = None  # suffix drafting from the other prompts' answers (None: as copy)

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


@dataclass
class Run:
    """One measured generation (baseline when `block_size` is None)."""

    tokens: list[int]
    prompt_tokens: int
    ttft: float
    decode_time: float
    peak_memory: int
    finish_reason: str
    block_size: int | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)  # per cycle (what auto chose)
    host_time: float = 0.0  # host time between syncs (DecodeStats.host_time)
    trees: list[int] = field(default_factory=list)  # per cycle: tree budget (0: a chain)
    copied: list[bool] = field(default_factory=list)  # per cycle: its drafts were a copy

    def drafter_cycles(self) -> tuple[list[int], list[int] | None]:
        """(committed, sizes) of its drafter's cycles and plain steps: copies apart."""
        return drafter_cycles(self.acceptance_lengths, self.block_sizes, self.copied)

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first (the first one is part of TTFT)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft if self.ttft > 0 else 0.0

    @property
    def host_ms_per_cycle(self) -> float:
        n = len(self.acceptance_lengths)
        return 1000 * self.host_time / n if n else 0.0

    @property
    def tau(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def as_dict(self) -> dict:
        d = {
            "generation_tokens": len(self.tokens),
            "decode_tokens": self.decode_tokens,
            "decode_time_s": self.decode_time,
            "decode_tps": self.decode_tps,
            "ttft_s": self.ttft,
            "prefill_tps": self.prefill_tps,
            "peak_memory_bytes": self.peak_memory,
            "finish_reason": self.finish_reason,
            "tokens": list(self.tokens),
        }
        if self.block_size is not None:
            auto = self.block_size == AUTO
            own, sizes = self.drafter_cycles()
            bs = max(sizes or [1]) if auto else self.block_size  # its widest drafter block
            d.update(
                block_size=self.block_size,
                tau=self.tau,
                cycles=len(self.acceptance_lengths),
                acceptance_lengths=list(self.acceptance_lengths),
                histogram=histogram(drafting(own, sizes), bs),
                copy_cycles=sum(self.copied),
                block_sizes=list(self.block_sizes),
                host_ms_per_cycle=self.host_ms_per_cycle,
                tree_cycles=sum(b > 0 for b in self.trees),
                tree_budgets=sorted({b for b in self.trees if b}),
            )
        return d


class Clock:
    """First/last token times of one run, relative to its start."""

    def __init__(self) -> None:
        gc.collect()
        import mlx.core as mx

        mx.reset_peak_memory()
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def tick(self, kept: bool = True) -> None:
        now = time.perf_counter() - self.t0
        if self.first is None:
            self.first = now
        if kept:
            self.last = now

    def result(self, tokens: list[int], prompt_tokens: int, reason: str, **kw) -> Run:
        import mlx.core as mx

        first = self.first or 0.0
        return Run(
            list(tokens),
            prompt_tokens,
            first,
            max((self.last or first) - first, 0.0),
            mx.get_peak_memory(),
            reason,
            **kw,
        )


def run_baseline(
    pair: Pair, ids: list[int], cfg: BenchConfig, seed: int, max_tokens: int | None = None
) -> Run:
    """Plain target decoding with mlx-lm's `generate_step` (same weights, no capture; layers
    queued as the engine queues them, see `capture.queues_layers`)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from dflash_mac.target.capture import layer_queue
    from dflash_mac.target.hooks import is_hooked

    # (a distributed target's leader hook mirrors every forward: the baseline's too)
    assert not is_hooked(pair.target, ignore=pair.mirror), "the baseline runs unhooked"
    max_tokens = max_tokens or cfg.max_tokens
    sampler = None if cfg.greedy else make_sampler(cfg.temp, cfg.top_p, cfg.min_p, top_k=cfg.top_k)
    eos = pair.eos_ids if cfg.use_eos else set()
    mx.random.seed(seed)
    tokens, reason = [], "length"
    clock = Clock()
    with layer_queue(pair.target):
        steps = generate_step(mx.array(ids), pair.target, max_tokens=max_tokens, sampler=sampler)
        for tok, _ in steps:
            if tok in eos:
                clock.tick(kept=False)
                reason = "stop"
                break
            tokens.append(tok)
            clock.tick()
        steps.close()
    return clock.result(tokens, len(ids), reason)


def run_dflash(
    pair: Pair,
    ids: list[int],
    cfg: BenchConfig,
    block_size: int,
    seed: int,
    on_cycle: Callable[[int, int], Any] | None = None,
    max_tokens: int | None = None,
    tuning: AutoTuning | None = None,
) -> Run:
    """DFlash through `stream_generate`, timed like the baseline; `on_cycle(accepted, size)`.
    `tuning`: what `auto` learnt in the runs before (a fresh one: the generic guess)."""
    from dflash_mac.api import stream_generate

    tokens, last = [], None
    clock = Clock()
    for ev in stream_generate(
        pair,
        ids,
        max_tokens=max_tokens or cfg.max_tokens,
        block_size=block_size,
        temp=cfg.temp,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        seed=seed,
        use_eos=cfg.use_eos,
        copy=cfg.copy,
        suffix=cfg.suffix,
        tree=cfg.tree,
        tuning=tuning if tuning is not None else AutoTuning(),
    ):
        clock.tick(kept=bool(ev.tokens))
        tokens += ev.tokens
        last = ev
        if ev.accepted and on_cycle:
            copy = ev.stats.copied[-1]  # size 0: not a drafter block (live histogram)
            on_cycle(ev.accepted, 0 if copy else ev.stats.block_sizes[-1])
    return clock.result(
        tokens,
        len(ids),
        last.finish_reason,
        block_size=block_size,
        acceptance_lengths=list(last.stats.acceptance_lengths),
        block_sizes=list(last.stats.block_sizes),
        host_time=last.stats.host_time,
        trees=list(last.stats.trees),
        copied=list(last.stats.copied),
    )


def other_answers(answers: dict[int, list[int]], i: int) -> SuffixMemory:
    """Suffix drafting's memory for a run of prompt `i`: the answers to the suite's other
    prompts so far (as a server that served them would hold), never an earlier trial's answer
    to this one, which it would copy whole and so time a repeat, not the prompt."""
    memory = SuffixMemory()
    for j, answer in answers.items():
        if j != i:
            memory.add(answer)
    return memory


def dflash_seed(cfg: BenchConfig, seed: int) -> int | None:
    """The seed of a DFlash run. Sampled runs go unseeded unless asked: a seeded request gets
    a fresh `auto` controller (so the seed alone fixes the text), while unseeded requests with
    one setting continue one controller, as the turns of a chat or a server's requests do."""
    return seed if cfg.greedy or cfg.seeded_dflash else None


def balanced_orders(n: int) -> list[list[int]]:
    """Run orders of n configurations balanced for what runs just before (a Williams design):
    over the rows every configuration runs in every slot, and right after every other one,
    equally often (n rows for even n, 2n for odd). On the CPU a run right after another one on
    the same prompt comes out ~1 % faster, so a fixed order would favour one configuration."""
    base, lo, hi = [0], 1, n - 1
    while lo <= hi:
        base.append(lo)
        lo += 1
        if lo <= hi:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


class Observer:
    """Callbacks of a bench run (the live view implements them); all optional."""

    def start(self, bp: BenchPrompt, trial: int, index: int, bs: int | None) -> None:
        """A run begins (`bs` None: the baseline)."""

    def cycle(self, bs: int, accepted: int, size: int) -> None:
        """A DFlash cycle committed `accepted` tokens in a run at `bs`; `size`: its block (what
        `auto` chose; 1: a plain step; 0: a copy, no drafter block)."""

    def done(self, run: Run) -> None:
        """A run finished."""

    def checked(self, record: dict, greedy: bool) -> None:
        """All runs of one (trial, prompt) finished."""


def run_bench(
    pair: Pair,
    prompts: list[BenchPrompt],
    ids: list[list[int]],
    cfg: BenchConfig,
    observer: Observer | None = None,
    tuning: AutoTuning | None = None,
) -> list[dict]:
    """Warm up, then measure every (trial, prompt): baseline and DFlash per block size.
    Unseeded `auto` runs continue `tuning` (what `auto` starts from), as a server's requests do.

    Returns one record per (trial, prompt) with the baseline run and the DFlash runs."""
    obs = observer or Observer()
    tuning = tuning if tuning is not None else AutoTuning()
    limits = [check_context(pair, x, cfg.max_tokens) for x in ids]  # capped to the context
    # Warm-up: one short run of each kind (and block size) before anything is timed.
    w = min(cfg.warmup_tokens, cfg.max_tokens)
    run_baseline(pair, ids[0], cfg, cfg.seed, max_tokens=w)
    for bs in cfg.block_sizes:
        run_dflash(pair, ids[0], cfg, bs, dflash_seed(cfg, cfg.seed), None, w, tuning)

    configs: list[int | None] = [None, *cfg.block_sizes]  # None: the baseline
    orders = balanced_orders(len(configs))
    records = []
    answers: dict[int, list[int]] = {}  # each prompt's last DFlash answer (suffix drafting)
    for trial in range(cfg.trials):
        order = list(range(len(prompts)))
        random.Random(cfg.seed * 1_000_003 + trial).shuffle(order)
        for pos, i in enumerate(order):
            bp, seed = prompts[i], cfg.seed + 7919 * trial + i
            rec = {
                "id": bp.id,
                "suite": bp.suite,
                "trial": trial,
                "position": pos,
                "prompt_tokens": len(ids[i]),
                "baseline": None,
                "dflash": {},
            }
            jobs = [configs[j] for j in orders[(trial * len(order) + pos) % len(orders)]]
            for bs in jobs:
                if cfg.cooldown > 0:
                    time.sleep(cfg.cooldown)
                obs.start(bp, trial, pos, bs)
                if bs is None:
                    run = rec["baseline"] = run_baseline(pair, ids[i], cfg, seed, limits[i])
                else:
                    tuning.answers = other_answers(answers, i)
                    run = rec["dflash"][bs] = run_dflash(
                        pair,
                        ids[i],
                        cfg,
                        bs,
                        dflash_seed(cfg, seed),
                        lambda a, size, b=bs: obs.cycle(b, a, size),
                        limits[i],
                        tuning,
                    )
                    answers[i] = run.tokens
                obs.done(run)
            obs.checked(rec, cfg.greedy)
            records.append(rec)
    return records
