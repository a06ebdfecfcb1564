"""Decode statistics (docs/design.md §9): τ, acceptance histogram, per-position acceptance,
speeds. τ is tokens per cycle over all cycles (what the speed follows); the histogram,
survival and per-position acceptance are those of the drafting cycles."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace


def drafting(lengths: list[int], sizes: list[int] | None = None) -> list[int]:
    """The committed lengths of the drafting cycles (block size > 1): a plain step (size 1,
    what `auto` runs where drafting does not pay, or the last cycle when one token is left)
    drafts nothing, so it has no place in the acceptance pictures. Without per-cycle sizes
    every cycle counts."""
    if sizes is None or len(sizes) != len(lengths):
        return list(lengths)
    return [a for a, b in zip(lengths, sizes) if b > 1]


def drafter_cycles(
    lengths: list[int], sizes: list[int] | None, copied: list[bool] | None
) -> tuple[list[int], list[int] | None]:
    """(committed, sizes) of the cycles the drafter drafted or plain steps: copy cycles apart
    (a copy's width is the copy's, not a block the drafter proposed)."""
    sizes = list(sizes) if sizes is not None and len(sizes) == len(lengths) else None
    if not copied or not any(copied) or len(copied) != len(lengths):
        return list(lengths), sizes
    keep = [not c for c in copied]
    own = [a for a, k in zip(lengths, keep) if k]
    return own, sizes and [b for b, k in zip(sizes, keep) if k]


def histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of committed-per-cycle values 1..block_size."""
    counts = [0] * block_size
    for a in lengths:
        counts[min(max(a, 1), block_size) - 1] += 1
    return counts


def survival(lengths: list[int], block_size: int) -> list[float]:
    """Prefix survival P(A >= k) for k = 1..block_size."""
    n = len(lengths)
    return [sum(a >= k for a in lengths) / n if n else 0.0 for k in range(1, block_size + 1)]


def position_acceptance(
    lengths: list[int], block_size: int, sizes: list[int] | None = None
) -> list[float]:
    """P(draft position k accepted | positions 1..k-1 accepted), k = 1..block_size-1.

    A cycle committing A tokens accepted A-1 drafts (the last token is the bonus). `sizes`
    (per cycle, as `auto` chose them or as the room left cut the last ones) limits each cycle
    to the positions it drafted: a plain step (size 1) drafts none, and a block of 5 that
    accepted all 4 drafts says nothing about position 5; without it every cycle is taken to be
    of `block_size`."""
    sizes = sizes if sizes is not None else [block_size] * len(lengths)
    out = []
    for k in range(1, block_size):
        reached = sum(a - 1 >= k - 1 and b > k for a, b in zip(lengths, sizes))
        accepted = sum(a - 1 >= k and b > k for a, b in zip(lengths, sizes))
        out.append(accepted / reached if reached else 0.0)
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two values)."""
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class DecodeStats:
    """Statistics of one generation up to an event: an immutable snapshot (each event carries
    its own, so a consumer on another thread never sees it change)."""

    block_size: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    acceptance_lengths: tuple[int, ...] = ()
    prefill_time: float = 0.0
    decode_time: float = 0.0
    peak_memory_bytes: int = 0
    auto: bool = False  # `--block-size auto`: the controller chose each cycle's size
    block_sizes: tuple[int, ...] = ()  # per cycle (1: a plain target step)
    block_reason: str = ""  # why the controller chose the last size
    host_time: float = 0.0  # host bookkeeping between syncs (rollback, text, stats, yield)
    draft_context: int = 0  # positions held by the drafter's (bounded) context cache
    ranks: int = 1  # a distributed target: the ranks it is sharded over
    parallel: str = ""  # tensor | pipeline ("" in one process)
    collectives_per_cycle: int = 0  # per target forward, counted in its graph at start-up
    collective_ms_per_cycle: float = 0.0  # that many all_sums, timed by a start-up probe
    copied: tuple[bool, ...] = ()  # per cycle: its drafts were copied (drafting/copies.py)
    # per cycle: its copy came from earlier answers (drafting/suffix.py), not this request's own
    # text
    suffixed: tuple[bool, ...] = ()
    trees: tuple[int, ...] = ()  # per cycle: its tree's node budget (0: a chain; drafting/tree.py)
    widths: tuple[int, ...] = ()  # per cycle: positions its verify checked (anchor + drafts)

    @property
    def tau(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def block_label(self) -> str:
        """ "8", or "auto ≤8" when the controller chose."""
        return f"auto ≤{self.block_size}" if self.auto else str(self.block_size)

    @property
    def draft_cycles(self) -> int:
        return len(self.draft_lengths)

    @property
    def plain_steps(self) -> int:
        return sum(b == 1 for b in self.block_sizes)

    def drafter_cycles(self) -> tuple[list[int], list[int] | None]:
        """(committed, sizes) of the cycles the drafter drafted or plain steps: copies apart."""
        sizes = list(self.block_sizes) or None
        return drafter_cycles(list(self.acceptance_lengths), sizes, list(self.copied))

    @property
    def draft_lengths(self) -> list[int]:
        """Committed tokens of each drafting cycle (`drafting`; copies apart)."""
        return drafting(*self.drafter_cycles())

    @property
    def copy_cycles(self) -> int:
        """Cycles that copied this request's own text (suffix drafts apart)."""
        return sum(self.copied) - sum(self.suffixed)

    @property
    def suffix_cycles(self) -> int:
        """Copy cycles whose drafts came from earlier answers (suffix drafting)."""
        return sum(self.suffixed)

    @property
    def suffix_tokens(self) -> int:
        """Tokens committed by suffix cycles (accepted drafts and their bonus tokens)."""
        return sum(a for a, c in zip(self.acceptance_lengths, self.suffixed) if c)

    @property
    def copy_tokens(self) -> int:
        """Tokens committed by copy cycles (accepted copies and their bonus tokens)."""
        return sum(self.copy_lengths) - self.suffix_tokens

    @property
    def copy_lengths(self) -> list[int]:
        return [a for a, c in zip(self.acceptance_lengths, self.copied) if c]

    @property
    def tree_cycles(self) -> int:
        return sum(b > 0 for b in self.trees)

    @property
    def tree_tau(self) -> float:
        """Tokens committed per tree cycle (its accepted depth + the bonus)."""
        got = [a for a, b in zip(self.acceptance_lengths, self.trees) if b > 0]
        return sum(got) / len(got) if got else 0.0

    @property
    def tree_mix(self) -> str:
        """How often each tree budget ran, e.g. "8×12 16×3" ("" without trees)."""
        counts: dict[int, int] = {}
        for b in self.trees:
            if b:
                counts[b] = counts.get(b, 0) + 1
        return " ".join(f"{b}×{n}" for b, n in sorted(counts.items()))

    @property
    def host_ms_per_cycle(self) -> float:
        return 1000 * self.host_time / self.cycles if self.cycles else 0.0

    @property
    def block_mix(self) -> str:
        """How often each drafter block size ran, e.g. "1×12 5×3 8×20" (1: a plain step;
        copies apart: their width is the copy's)."""
        counts: dict[int, int] = {}
        for b in self.drafter_cycles()[1] or []:
            counts[b] = counts.get(b, 0) + 1
        return " ".join(f"{b}×{n}" for b, n in sorted(counts.items()))

    @property
    def widest_verify(self) -> int:
        """The most positions one verify pass checked: a block, a copy or a tree, anchor in."""
        return max(self.widths or self.block_sizes or (1,))

    @property
    def histogram(self) -> list[int]:
        return histogram(self.draft_lengths, self.block_size)

    @property
    def survival(self) -> list[float]:
        return survival(self.draft_lengths, self.block_size)

    @property
    def position_acceptance(self) -> list[float]:
        lengths, sizes = self.drafter_cycles()
        return position_acceptance(lengths, self.block_size, sizes)

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generation_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def ttft(self) -> float:
        return self.prefill_time

    @property
    def peak_memory_gb(self) -> float:
        return self.peak_memory_bytes / 1e9

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generation_tokens": self.generation_tokens,
            "block_size": self.block_size,
            "cycles": self.cycles,
            "draft_cycles": self.draft_cycles,
            "acceptance_lengths": list(self.acceptance_lengths),
            "tau": self.tau,
            "histogram": self.histogram,
            "position_acceptance": self.position_acceptance,
            "survival": self.survival,
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "ttft_s": self.ttft,
            "peak_memory_gb": self.peak_memory_gb,
            "auto": self.auto,
            "block_sizes": list(self.block_sizes),
            "block_reason": self.block_reason,
            "host_ms_per_cycle": self.host_ms_per_cycle,
            "draft_context": self.draft_context,
            "copy_cycles": self.copy_cycles,
            "copy_tokens": self.copy_tokens,
            "tree_cycles": self.tree_cycles,
            "tree_tau": self.tree_tau,
            "tree_budgets": self.tree_mix,
            "widest_verify": self.widest_verify,
            **(
                {
                    "ranks": self.ranks,
                    "parallel": self.parallel,
                    "collectives_per_cycle": self.collectives_per_cycle,
                    "collective_ms_per_cycle": self.collective_ms_per_cycle,
                }
                if self.ranks > 1
                else {}
            ),
        }


class StatsRecorder:
    """Builds a stream's `DecodeStats` snapshots: the per-cycle lists grow here and each
    snapshot takes tuples of them (the consumer may be on another thread)."""

    def __init__(
        self,
        block_size: int,
        prompt_tokens: int,
        cached_tokens: int,
        auto: bool,
        facts: dict,
        peak_memory: Callable[[], int] = lambda: 0,
    ):
        self.peak_memory = peak_memory
        self.base = DecodeStats(
            block_size,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            auto=auto,
            **facts,
        )
        self.t0 = self.t_decode = time.perf_counter()
        self.lengths: list[int] = []
        self.sizes: list[int] = []
        self.copied: list[bool] = []
        self.suffixed: list[bool] = []
        self.trees: list[int] = []
        self.widths: list[int] = []
        self.reason, self.host, self.context = "", 0.0, 0

    def prefilled(self) -> None:
        """The prefill and the first token are done: decoding starts now."""
        self.t_decode = time.perf_counter()
        self.base = replace(self.base, prefill_time=self.t_decode - self.t0)

    def cycle(
        self,
        bs: int,
        committed: int,
        host: float,
        reason: str,
        context: int,
        copied: bool = False,
        tree: int = 0,
        width: int = 0,
        suffixed: bool = False,
    ) -> None:
        """One cycle: its block size, what it committed, and `width`, the positions its verify
        checked (a tree's nodes or a graft's; 0: `bs`)."""
        self.lengths.append(committed)
        self.sizes.append(bs)
        self.widths.append(width or bs)
        self.copied.append(copied)
        self.suffixed.append(suffixed)
        self.trees.append(tree)
        self.reason, self.context = reason, context
        self.host += host

    def snapshot(self, tokens: int) -> DecodeStats:
        return replace(
            self.base,
            acceptance_lengths=tuple(self.lengths),
            block_sizes=tuple(self.sizes),
            copied=tuple(self.copied),
            suffixed=tuple(self.suffixed),
            trees=tuple(self.trees),
            widths=tuple(self.widths),
            block_reason=self.reason,
            host_time=self.host,
            draft_context=self.context,
            generation_tokens=tokens,
            decode_time=time.perf_counter() - self.t_decode if self.lengths else 0.0,
            peak_memory_bytes=self.peak_memory(),
        )
