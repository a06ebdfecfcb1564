"""What a cycle costs, for `--block-size auto` (controller.py) and the batch rule's prior:
cost(bs), the time of a cycle at block size bs relative to a one-token target step.

A prior curve (`CostCurve`: measured once per pair and machine by `dflash-mac bench
--cost-curve`, else a generic guess; `at_context` prices it at a long context through
`ContextCost`; `noise` refuses one timed on a busy machine) is scaled and refined online by the
measured cycle times (`CostModel`: the host's one-token step times each size's ratio to it,
exponential moving averages; the first cycle at each size, which compiles its graphs, is not
used). Pure Python (no MLX)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# A generic prior: a drafting cycle costs a one-token step, plus the drafter pass and the extra
# verify width. Replaced by the measured curve when one is saved for the pair and machine.
PRIOR_DRAFT_OVERHEAD = 0.5
PRIOR_PER_TOKEN = 0.06
# At long contexts a plain step costs more and each extra verified token attends to the whole
# context (a one-query attention is a fused kernel; more queries are not), so a wide verify
# costs more plain steps than the short-context curve says. Measured on a 2-core CPU
# (SmolLM2-135M, fp32: a 9-token verify is 1.58 steps at 256 tokens, 2.87 at 6,800;
# docs/bench.md "Long contexts"), per 1,000 context tokens past the curve's own:
CURVE_CONTEXT = 256  # about the context a cost curve is measured at
STEP_GROWTH = 0.16  # a one-token step's growth, in short-context steps
CONTEXT_SLOPE = 0.062  # each extra verified token's added cost, in short-context steps


@dataclass(frozen=True)
class ContextCost:
    """How a cycle's cost grows with the context, per 1,000 tokens past `base`, in one-token
    steps at `base`: a one-token step by `growth`, each extra verified token by `slope`. The
    defaults were measured on a 2-core CPU; `bench --cost-curve` fits this machine's (`fit`)."""

    base: int = CURVE_CONTEXT
    growth: float = STEP_GROWTH
    slope: float = CONTEXT_SLOPE
    measured: bool = False

    @classmethod
    def fit(cls, points: list[dict], bs: int) -> ContextCost:
        """The least-squares fit through the first point (the shortest context) of timed
        `{"context", "plain", "cycle"}` points, a plain step's and a `bs`-token cycle's
        seconds: plain(n) / u = 1 + growth * k and (cycle(n) - plain(n)) / u =
        (cycle(base) - plain(base)) / u + (bs - 1) * slope * k, with u = plain(base) and
        k = (n - base) / 1000. Negative fits are clamped to 0."""
        first, rest = points[0], points[1:]
        u, extra = first["plain"], first["cycle"] - first["plain"]
        ks = [(p["context"] - first["context"]) / 1000 for p in rest]
        kk = sum(k * k for k in ks)
        if not rest or kk <= 0 or u <= 0 or bs < 2:
            return cls(base=first["context"])
        grow = [p["plain"] / u - 1 for p in rest]
        wide = [((p["cycle"] - p["plain"]) - extra) / u / (bs - 1) for p in rest]
        growth = sum(k * y for k, y in zip(ks, grow, strict=True)) / kk
        slope = sum(k * y for k, y in zip(ks, wide, strict=True)) / kk
        return cls(first["context"], max(growth, 0.0), max(slope, 0.0), measured=True)

    @classmethod
    def read(cls, data: object) -> ContextCost:
        """The fit saved with a curve (`"long_context"`), else the default."""
        try:
            fit = cls(int(data["base"]), float(data["growth"]), float(data["slope"]), True)
        except (KeyError, TypeError, ValueError):
            return cls()
        return fit if fit.growth >= 0 and fit.slope >= 0 and fit.base >= 0 else cls()


NOISE_DIP = 0.8  # a cycle timed below this share of a cheaper kind's time: not a steady cost
NOISE_FLOOR = 0.005  # seconds: a smaller dip is timer and scheduler jitter on a small model


def noise(table: dict) -> list[str]:
    """Why one table of a saved curve (greedy, or its `sampled` part) cannot be this machine's
    steady costs: a block size timed well below a smaller one (`seconds`, the medians before
    they were made non-decreasing), or a tree below the chain of its verify width (it
    verifies as many tokens after a deeper drafter pass; trees against each other vary too
    much on a small model to tell). A busy host
    makes such curves, and a prior that prices drafting at 1.4 plain steps here and 2.9 there
    steers `auto` wrong for good: the online costs stay near the prior (`CostModel.TRUST`).
    [] when the table is consistent."""
    try:
        seconds = {int(b): float(v) for b, v in table.get("seconds", {}).items()}
        ratios = {int(b): float(v) for b, v in table["ratios"].items()}
        trees = {int(n): float(v) for n, v in table.get("trees", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return ["unreadable"]
    unit = seconds.get(1, 1.0)  # a one-token step's seconds: what turns a ratio into seconds

    def dip(value: float, above: float, scale: float = 1.0) -> bool:
        return value < NOISE_DIP * above and (above - value) * scale > NOISE_FLOOR

    found, top = [], 0.0
    for b in sorted(seconds):
        if dip(seconds[b], top):
            found.append(f"block {b} timed at {seconds[b] / top:.0%} of a smaller block")
        top = max(top, seconds[b])
    for n in sorted(trees):
        chain = ratios.get(min(n + 1, max(ratios, default=1)), 1.0)
        if dip(trees[n], chain, unit):
            found.append(f"tree of {n} timed at {trees[n] / chain:.0%} of a chain as wide")
    return found


@dataclass
class CostCurve:
    """Cost of a cycle at block size bs relative to a one-token step (ratio[1] == 1)."""

    ratios: dict[int, float]
    measured: bool = False  # from `bench --cost-curve` (else the generic guess)
    trees: dict[int, float] = field(default_factory=dict)  # tree cycles by node budget
    batches: dict[tuple[int, int], float] = field(default_factory=dict)  # (B rows, bs)
    context: ContextCost = field(default_factory=ContextCost)  # growth with the context
    drafts: dict[int, float] = field(default_factory=dict)  # the drafter pass alone, by bs

    @classmethod
    def generic(cls, bs_max: int) -> CostCurve:
        r = {b: 1.0 + PRIOR_DRAFT_OVERHEAD + PRIOR_PER_TOKEN * (b - 1) for b in range(2, 33)}
        return cls({1: 1.0, **r}, drafts={2: PRIOR_DRAFT_OVERHEAD})

    def draft(self, bs: int) -> float:
        """The drafter pass's share of a cycle at `bs` (the timed size at or below it, else
        the smallest; 0 where the curve timed none: a copy is then priced as a chain)."""
        if not self.drafts or bs < 2:
            return 0.0
        return self.drafts[max((b for b in self.drafts if b <= bs), default=min(self.drafts))]

    def copy(self, width: int) -> float:
        """A copy cycle verifying `width` tokens: a chain cycle as wide, less its drafter pass
        (a copy has none; on a small model on a CPU that pass is a third of the cycle)."""
        return max(1.0, self.ratio(width) - self.draft(width))

    def ratio(self, bs: int) -> float:
        if bs in self.ratios:
            return self.ratios[bs]
        if not self.ratios:
            return 1.0
        top = max(self.ratios)  # beyond the curve: extend its last slope
        slope = self.ratios[top] - self.ratios.get(top - 1, self.ratios[top])
        return self.ratios[top] + max(slope, 0.0) * (bs - top)

    def at_context(self, tokens: int) -> CostCurve:
        """The curve at a context of `tokens` (it was timed at a short one): in units of that
        context's one-token step, 1 + growth per 1,000 tokens of the short one, a cycle of b
        tokens costs its short-context overhead plus (b - 1) * slope per 1,000 tokens (both
        past the fit's base; `ContextCost`). Measured where the curve and the fit both are."""
        c = self.context
        k = max(tokens - c.base, 0) / 1000
        unit = 1 + c.growth * k

        def at(b: int, r: float) -> float:
            return 1 + ((r - 1) + (b - 1) * c.slope * k) / unit

        ratios = {b: at(b, r) for b, r in self.ratios.items()}
        trees = {n: at(1 + n, r) for n, r in self.trees.items()}
        drafts = {b: d / unit for b, d in self.drafts.items()}  # the drafter's context is short
        measured = self.measured and c.measured
        return CostCurve(ratios, measured, trees, self.batches, c, drafts)

    @classmethod
    def load(cls, path: Path, sampled: bool = False) -> CostCurve | None:
        """A saved curve (bench/costcurve.py writes it); None when absent, unreadable or timed
        on a busy machine (`noise`: `auto` then starts from the generic guess and times a plain
        step itself). `sampled`: the curve timed at a sampling temperature where the file has
        one (sampled cycles draw, and verify by rejection, so their ratios differ), else the
        greedy one."""
        try:
            data = json.loads(Path(path).read_text())
            part = data.get("sampled", {}) if sampled else {}
            if noise(part if part.get("ratios") else data):
                return None
            table = part.get("ratios")
            ratios = {int(k): float(v) for k, v in (table or data["ratios"]).items()}
            trees = part.get("trees") if table else data.get("trees")
            trees = {int(k): float(v) for k, v in (trees or {}).items()}
            timed = part if table else data  # the drafter pass alone, as a share of a step
            unit = float(timed.get("seconds", {}).get("1", 0.0))
            drafts = timed.get("draft_seconds", {}) if unit > 0 else {}
            drafts = {int(k): float(v) / unit for k, v in drafts.items()}
            batches = {  # timed greedy only: a batched cycle's cost barely depends on sampling
                (int(b), int(k)): float(v)
                for b, row in data.get("batches", {}).items()
                for k, v in row.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        values = [*ratios.values(), *trees.values(), *batches.values()]
        if ratios.get(1) != 1.0 or any(v <= 0 for v in values):
            return None
        context = ContextCost.read(data.get("long_context"))
        drafts = {b: d for b, d in drafts.items() if d > 0}
        return cls(ratios, True, trees, batches, context, drafts)


class CostModel:
    """Seconds per cycle at each block size, as a one-token step's seconds (`unit`: the host's
    speed now) times each size's ratio to it (`ratios`, else the prior curve's).

    A host's speed drifts by a third within minutes, so past a size's FIRST timings its ratio
    is learned only from cycles timed within FRESH observations of the unit being timed by
    another kind of cycle (a plain step, or a size whose ratio is known); the other cycles
    track the unit through their ratio. A size run for minutes on end keeps the ratio it was
    learned at while the host speeds up or slows down, instead of its current seconds being
    divided by a plain step timed minutes earlier."""

    SPIKE = 2.0  # one observation moves at most this factor from the average
    TRUST = 1.25  # measured ratios stay within this factor of a measured prior
    FRESH = 8  # observations after the unit was timed in which other sizes learn their ratio
    FIRST = 3  # a size's first timings learn its ratio whenever they come (nothing to track by)

    def __init__(self, prior: CostCurve, alpha: float = 0.2, unit_of: CostModel | None = None):
        self.prior, self.alpha = prior, alpha
        self.unit_of = unit_of  # a tree model takes the one-token step from the chain model
        self.seconds: dict[int, float] = {}  # each size's cycle seconds, averaged (damped)
        self.counts: dict[int, int] = {}
        self.ratios: dict[int, float] = {}  # each size's seconds over a fresh unit, averaged
        self.learned: dict[int, int] = {}  # cycles each ratio was learned from
        self.unit: float | None = None  # estimated seconds of a one-token step
        self.units = 0  # observations the unit was timed from
        self.source: tuple[int, int] | None = None  # (model, size) that timed the unit last
        self.age = 0  # observations since
        self.first_seen: set[int] = set()
        self.copy_scale = 1.0  # copy cycles' time over their estimate (`copy`), averaged
        self.copies = 0  # copy cycles it was learned from

    def observe(self, bs: int, seconds: float) -> None:
        """Feed one cycle's time. The first cycle at each size is not used: it builds and
        compiles that size's graphs, a one-off that would make the size look dear for long."""
        if seconds <= 0:
            return
        if bs not in self.first_seen:
            self.first_seen.add(bs)
            return
        if (old := self.seconds.get(bs)) is not None:  # a hiccup of a shared machine: damp it
            seconds = min(max(seconds, old / self.SPIKE), old * self.SPIKE)
        n = self.counts[bs] = self.counts.get(bs, 0) + 1
        self.seconds[bs] = self.average(self.seconds.get(bs), seconds, n)
        base, me = self.unit_of or self, (id(self), bs)
        base.age += 1
        if bs == 1 and self.unit_of is None:  # a plain step times the unit itself (the first
            base.time_unit(seconds, me, restart=n == 1)  # replaces estimates through ratios)
        elif base.unit is not None and (
            self.learned.get(bs, 0) < self.FIRST or (base.source != me and base.age <= self.FRESH)
        ):
            m = self.learned[bs] = self.learned.get(bs, 0) + 1
            self.ratios[bs] = self.average(self.ratios.get(bs), seconds / base.unit, m)
        else:  # the host's speed through this size's ratio
            base.time_unit(seconds / self.ratio(bs), me)

    def time_unit(self, seconds: float, source: tuple[int, int], restart: bool = False) -> None:
        """One estimate of the one-token step's seconds, from `source` (`restart`: the first
        of a new average)."""
        self.units = 1 if restart else self.units + 1
        self.unit = self.average(self.unit, seconds, self.units)
        self.source, self.age = source, 0

    def average(self, old: float | None, new: float, n: int) -> float:
        """An exponential moving average that is the plain mean of its first 1/alpha values
        (so no single early value weighs more than the later ones)."""
        return new if old is None else old + max(self.alpha, 1 / n) * (new - old)

    def ratio(self, bs: int) -> float:
        """A size's learned ratio to a one-token step, else the prior's (unclamped)."""
        return self.ratios.get(bs) or self.prior.ratio(bs)

    def cost(self, bs: int) -> float:
        """Relative cost of a cycle at `bs` (1.0 for a one-token step); its overhead over a
        plain step stays within a factor `TRUST` (measured prior) or `2 * TRUST` (the guess) of
        the prior's: timings taken at different moments on a loaded machine must not turn a
        paying size into a losing one, or a losing one into a paying one."""
        prior = self.prior.ratio(bs)
        if bs not in self.ratios:
            return prior
        trust = self.TRUST if self.prior.measured else 2 * self.TRUST
        low = 1.0 + (prior - 1.0) / trust  # a drafting cycle's overhead shrinks by `trust` at most
        return min(max(self.ratios[bs], low), prior * trust)

    def copy(self, width: int) -> float:
        """Relative cost of a copy verifying `width` tokens: the cycle as wide, less the
        prior's drafter pass (`CostCurve.copy`), times what copy cycles measured of that
        estimate (`observe_copy`, within `TRUST`)."""
        scale = min(max(self.copy_scale, 1 / self.TRUST), self.TRUST)
        return max(1.0, self.copy_estimate(width) * scale)

    def copy_estimate(self, width: int) -> float:
        """A copy's cost before what copy cycles measured: the cycle as wide less the pass."""
        return max(1.0, self.cost(width) - self.prior.draft(width))

    def observe_copy(self, width: int, seconds: float) -> None:
        """Feed a copy cycle's time: how far `copy_estimate` is off, learned as one factor for
        all widths (each repeat copies its own length, too few of each to learn them apart;
        docs/bench.md has what it corrected)."""
        if seconds <= 0 or self.unit is None:
            return
        estimate = self.copy_estimate(width)
        scale, self.copies = self.copy_scale, self.copies + 1
        ratio = min(max(seconds / self.unit / estimate, scale / self.SPIKE), scale * self.SPIKE)
        self.copy_scale = self.average(scale, ratio, self.copies)

    @property
    def calibrated(self) -> bool:
        """True when a one-token step was measured or the prior curve is a measured one."""
        return 1 in self.seconds or self.prior.measured


def tree_curve(chain: CostCurve, budgets: tuple[int, ...]) -> CostCurve:
    """A tree cycle's cost by budget: the curve's tree timings where it has them (`trees`),
    else a chain verifying as many tokens (1 + budget) and drafting as many positions."""
    ratios = {b: chain.trees.get(b) or chain.ratio(1 + b) for b in budgets}
    return CostCurve(ratios, measured=chain.measured and all(b in chain.trees for b in budgets))
