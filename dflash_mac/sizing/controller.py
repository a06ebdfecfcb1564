"""`--block-size auto`: an online controller that picks each cycle's block size.

It maximises expected tokens per second, E[tokens | bs] / cost(bs), where
- cost(bs) is the time of a cycle at block size bs relative to a one-token target step: a prior
  curve (measured once per pair and machine by `dflash-mac bench --cost-curve`, else a generic
  guess) scaled and refined online by the measured cycle times (exponential moving averages;
  the first cycle at each size, which compiles its graphs, is not used);
- E[tokens | bs] = 1 + sum_j prod_{k<=j} alpha_k comes from the running acceptance curve:
  per-position conditional acceptance alpha_k with exponentially decayed counts; a position not
  yet observed inherits the estimate of the one before it. The starting guess is a
  well-trained drafter's (0.7 per position) weighing as much as several drafting cycles
  (greedy), fading as their counts do, so one rejected block at a fresh start neither turns
  drafting off nor shrinks the block; where the registry gives the drafter's own measured
  acceptance (`acceptance_guess`), that is the start, weighing one cycle.

Block size 1 is plain target decoding (no drafter pass). When drafting does not pay the
controller falls back to it and probes one drafting cycle now and then, a chain (the cheapest
cycle that measures acceptance; trees compete again once drafting pays), twice as late after
a probe that did not pay, judged on its measured time, twice as soon after one that did; at
most 256 steps apart, fewer the more drafting gained lately (realised: tokens per cycle time,
never the guess a fresh controller starts from). It falls back 5 % below a plain step's rate
and resumes only 10 % above it, so it does not flap. A size next to the chosen one
that is within 5 % of it and still has only the prior's cost runs now and then until it was
timed a few times, so a prior that is a few per cent off at a size is corrected. Greedy and
sampled decoding keep apart cost models (policy.auto_controller). Pure Python (no MLX):
unit-testable with synthetic inputs (docs/bench.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..drafting.copies import CopyRates
from ..drafting.suffix import SuffixMemory

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
NOISE_FLOOR = 0.002  # seconds: a smaller dip is timer and scheduler jitter on a tiny model


def noise(table: dict) -> list[str]:
    """Why one table of a saved curve (greedy, or its `sampled` part) cannot be this machine's
    steady costs: a block size timed well below a smaller one (`seconds`, the medians before
    they were made non-decreasing), a tree below a smaller tree, or a tree below the chain of
    its verify width (it verifies as many tokens after a deeper drafter pass). A busy host
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
    top = 0.0
    for n in sorted(trees):
        cheaper = max(top, ratios.get(min(n + 1, max(ratios, default=1)), 1.0))
        if dip(trees[n], cheaper, unit):
            found.append(f"tree of {n} timed at {trees[n] / cheaper:.0%} of a cheaper cycle")
        top = max(top, trees[n])
    return found


@dataclass
class CostCurve:
    """Cost of a cycle at block size bs relative to a one-token step (ratio[1] == 1)."""

    ratios: dict[int, float]
    measured: bool = False  # from `bench --cost-curve` (else the generic guess)
    trees: dict[int, float] = field(default_factory=dict)  # tree cycles by node budget
    batches: dict[tuple[int, int], float] = field(default_factory=dict)  # (B rows, bs)
    context: ContextCost = field(default_factory=ContextCost)  # growth with the context

    @classmethod
    def generic(cls, bs_max: int) -> CostCurve:
        r = {b: 1.0 + PRIOR_DRAFT_OVERHEAD + PRIOR_PER_TOKEN * (b - 1) for b in range(2, 33)}
        return cls({1: 1.0, **r})

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
        measured = self.measured and c.measured
        return CostCurve(ratios, measured, trees=trees, batches=self.batches, context=c)

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
        return cls(ratios, measured=True, trees=trees, batches=batches, context=context)


class CostModel:
    """Seconds per cycle at each block size: measured averages where there are some, else the
    prior curve times the estimated one-token step."""

    SPIKE = 2.0  # one observation moves at most this factor from the average
    TRUST = 1.25  # measured ratios stay within this factor of a measured prior

    def __init__(self, prior: CostCurve, alpha: float = 0.2, unit_of: CostModel | None = None):
        self.prior, self.alpha = prior, alpha
        self.unit_of = unit_of  # a tree model takes the one-token step from the chain model
        self.seconds: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.unit: float | None = None  # estimated seconds of a one-token step
        self.units = 0  # drafting cycles the unit was estimated from (while no plain step is)
        self.first_seen: set[int] = set()

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
        if self.unit_of is not None:
            return
        if 1 in self.seconds:
            self.unit = self.seconds[1]
        else:
            self.units += 1
            self.unit = self.average(self.unit, seconds / self.prior.ratio(bs), self.units)

    def average(self, old: float | None, new: float, n: int) -> float:
        """An exponential moving average that is the plain mean of its first 1/alpha values
        (so no single early value weighs more than the later ones)."""
        return new if old is None else old + max(self.alpha, 1 / n) * (new - old)

    def cost(self, bs: int) -> float:
        """Relative cost of a cycle at `bs` (1.0 for a one-token step); its overhead over a
        plain step stays within a factor `TRUST` (measured prior) or `2 * TRUST` (the guess) of
        the prior's: timings taken at different moments on a loaded machine must not turn a
        paying size into a losing one, or a losing one into a paying one."""
        prior = self.prior.ratio(bs)
        unit = self.unit_of.unit if self.unit_of is not None else self.unit
        if unit is None or (bs == 1 and self.unit_of is None):
            return prior
        r = self.seconds.get(bs, unit * prior) / unit
        trust = self.TRUST if self.prior.measured else 2 * self.TRUST
        low = 1.0 + (prior - 1.0) / trust  # a drafting cycle's overhead shrinks by `trust` at most
        return min(max(r, low), prior * trust)

    @property
    def calibrated(self) -> bool:
        """True when a one-token step was measured or the prior curve is a measured one."""
        return 1 in self.seconds or self.prior.measured


class Acceptance:
    """Running per-position acceptance with exponentially decayed counts. `weight`: how many
    cycles' worth the estimate a position starts from counts (the guess `prior` for position 1,
    the previous position's estimate for the others); `boost`: extra weight of that start,
    fading as the counts do (the controller's heavy greedy guess)."""

    AGE_MAX = 8  # cycles between two drafting ones that age the counts, at most
    MEMORY = 16  # drafting cycles' worth of evidence a remembered estimate starts with, at most

    def __init__(
        self,
        n_max: int,
        decay: float = 0.97,
        prior: float = 0.7,
        weight: float = 1.0,
        boost: float = 0.0,
    ):
        self.decay, self.prior, self.weight, self.boost = decay, prior, weight, boost
        self.reached = [0.0] * max(n_max, 1)  # index k-1: draft position k
        self.accepted = [0.0] * max(n_max, 1)

    def observe(self, bs: int, a: int, elapsed: int = 1) -> None:
        """A drafting cycle at `bs` accepted `a` of its bs-1 drafts, `elapsed` cycles after the
        last one observed. Plain steps in between age the estimate as drafting cycles do (the
        text moved on: after a poor stretch, probes on good text bring drafting back sooner),
        up to AGE_MAX of them (one probe must not outweigh the history: a lucky block at
        sampling-like acceptance would bring the probes back)."""
        fade = self.decay ** min(elapsed, self.AGE_MAX)
        self.reached = [r * fade for r in self.reached]
        self.accepted = [x * fade for x in self.accepted]
        self.boost *= fade
        for k in range(1, min(bs - 1, len(self.reached)) + 1):
            if k > a + 1:
                break
            self.reached[k - 1] += 1
            self.accepted[k - 1] += k <= a

    def state(self) -> dict:
        """The decayed counts, to remember between processes (`restore`)."""
        return {"reached": list(self.reached), "accepted": list(self.accepted)}

    def restore(self, state: object) -> bool:
        """Start from remembered counts (what earlier requests with the same setting saw),
        worth MEMORY drafting cycles at most so the text at hand soon outweighs them. False,
        and nothing changed, when `state` is not a valid one."""
        try:
            reached = [float(x) for x in state["reached"]]  # type: ignore[index]
            accepted = [float(x) for x in state["accepted"]]  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return False
        valid = len(reached) == len(accepted) and all(
            0.0 <= a <= r + 1e-9 for a, r in zip(accepted, reached)
        )
        if not valid or not reached or reached[0] <= 0:
            return False
        scale = min(1.0, self.MEMORY / reached[0])
        n = len(self.reached)
        pad = [0.0] * max(0, n - len(reached))
        self.reached = [r * scale for r in reached[:n]] + pad
        self.accepted = [a * scale for a in accepted[:n]] + pad
        return True

    def alphas(self, n: int) -> list[float]:
        """alpha_k = P(draft k accepted | 1..k-1 accepted) for k = 1..n."""
        out, prev, w = [], self.prior, self.weight + self.boost
        for k in range(n):
            r = self.reached[k] if k < len(self.reached) else 0.0
            x = self.accepted[k] if k < len(self.accepted) else 0.0
            prev = (x + w * prev) / (r + w)
            out.append(prev)
        return out

    def expected_tokens(self, bs: int) -> float:
        """E[committed tokens | bs] = 1 + sum_j prod_{k<=j} alpha_k."""
        total, surv = 1.0, 1.0
        for a in self.alphas(bs - 1):
            surv *= a
            total += surv
        return total

    def survival(self, n: int) -> list[float]:
        """P(committed >= k), k = 1..n."""
        out, surv = [1.0], 1.0
        for a in self.alphas(n - 1):
            surv *= a
            out.append(surv)
        return out


class TreeAcceptance:
    """Committed tokens per tree cycle by node budget: decayed means that start from an
    optimistic guess (`prior(budget)`, worth `WEIGHT` cycles) and drift back to it while no tree
    runs, so a budget that lost is tried again now and then, on the text at hand."""

    WEIGHT = 2.0
    DECAY = 0.97

    def __init__(self) -> None:
        self.tokens: dict[int, float] = {}  # decayed sums
        self.cycles: dict[int, float] = {}  # decayed counts

    def age(self) -> None:
        """One cycle passed (every cycle, whatever ran)."""
        for b in self.cycles:
            self.tokens[b] *= self.DECAY
            self.cycles[b] *= self.DECAY

    def observe(self, budget: int, committed: int) -> None:
        self.tokens[budget] = self.tokens.get(budget, 0.0) + committed
        self.cycles[budget] = self.cycles.get(budget, 0.0) + 1.0

    def expected(self, budget: int, prior: float) -> float:
        n, x = self.cycles.get(budget, 0.0), self.tokens.get(budget, 0.0)
        return (x + self.WEIGHT * prior) / (n + self.WEIGHT)


# A tree at first is guessed to commit this much more than the chain of its depth (DDTree
# reports 1.3x and more; the guess only decides whether trees get tried, then they are measured)
TREE_GUESS = 1.3
TREES = (4, 8, 16)  # node budgets `auto` weighs (docs/design.md §6)


def tree_arms(tree: int | None) -> tuple[tuple[int, ...], bool]:
    """(tree budgets, whether chains run too) for `--tree-budget`: None `auto` (chains and the
    TREES), 0 chains only, N trees of N nodes only."""
    if tree is None:
        return TREES, True
    return ((tree,), False) if tree > 0 else ((), True)


@dataclass
class Decision:
    """One cycle's choice and why (shown by --verbose, bench and the chat panel)."""

    size: int
    reason: str
    rates: dict[int, float] = field(default_factory=dict)  # tokens per one-token-step time
    tree: int = 0  # a drafting cycle's tree budget (0: a chain of `size`)


def pace(size: int, rates: dict[int, float]) -> str:
    """Why `auto` chose, in words a user reads (`-v`, the chat panel)."""
    return f"block {size} expected at {rates[size]:.2f}× plain speed"


class BlockController:
    """Chooses each cycle's block size (1..bs_max); see the module docstring."""

    PROBE_SCALE = 16  # the probe cap where drafting ran at twice a plain step's rate
    UPSIDE_DECAY = 0.995  # per cycle: drafting's gain is forgotten in a few hundred cycles
    CALIBRATION = 3  # plain steps at most that measure a one-token step (no measured curve)
    RESUME = 2  # drafting resumes past twice the hysteresis: a wrong resume costs more than
    # a late one (its cycles are dearer than their estimate when the machine is busy)
    NEIGHBOUR_BAND = 0.05  # a size next to the chosen one, this close in rate, gets timed
    NEIGHBOUR_TIMINGS = 3  # timed cycles a size gets that way (its first is never timed)
    NEIGHBOUR_EVERY = 16  # drafting cycles between two of them
    GUESS = 0.7  # the generic guess of each position's acceptance (a well-trained drafter's)
    GUESS_WEIGHT = 8.0  # drafting cycles the generic guess is worth at first (fading as theirs)
    GAIN_ALPHA = 0.1  # the realised rate's average: a lucky block alone moves it little

    def __init__(
        self,
        bs_max: int,
        cost: CostModel,
        acceptance: Acceptance | None = None,
        hysteresis: float = 0.05,
        probe_every: int = 8,
        probe_max: int = 256,
        timed: bool = True,
        plain_first: bool = False,
        guess_weight: float = GUESS_WEIGHT,
        guess: float = GUESS,
        trees: tuple[int, ...] = (),
        chains: bool = True,
    ):
        self.bs_max, self.cost = bs_max, cost
        # trees of these budgets, at the largest size's depth, compete with the chains (only
        # they draft when `chains` is False: `--tree-budget N`); their costs by budget
        self.trees, self.chains = tuple(trees), chains or not trees
        self.tree_cost = CostModel(tree_curve(cost.prior, trees), cost.alpha, unit_of=cost)
        self.tree_acc = TreeAcceptance()
        # plain_first: start with plain steps and a pessimistic acceptance prior, so drafting
        # resumes only once probes show it pays (long contexts a drafter is known to lose on)
        # the guess weighs as much as `guess_weight` drafting cycles at first: one rejected
        # block at the start of a fresh process must not turn drafting off (nor shrink the
        # block) on text the drafter predicts well; the pessimistic start gives way to one
        # good probe
        self.acc = acceptance or (
            Acceptance(bs_max, prior=0.25)
            if plain_first
            else Acceptance(bs_max, prior=guess, boost=max(guess_weight - 1.0, 0.0))
        )
        self.hysteresis, self.probe_base, self.probe_max = hysteresis, probe_every, probe_max
        self.current = bs_max  # the drafting size in use
        self.fallback = self.plain_first = plain_first
        self.interval, self.countdown = probe_every, probe_every
        if plain_first:  # known to lose here: the first probe after 64 steps, up to 256 apart
            self.interval = self.countdown = 8 * probe_every
            self.probe_max = 32 * probe_every
        self.upside = 0.0  # how much faster than plain steps drafting ran lately (decaying)
        self.realised = 1.0  # drafting cycles' tokens per plain-step time, averaged (GAIN_ALPHA)
        self.cycles = 0
        self.idle = 0  # cycles since the last drafting one was observed
        self.timed = timed  # False: decide from the prior costs only (reproducible choices)
        self.calibrate_from = 3 if timed and not cost.calibrated else None
        self.neighbour_countdown = self.NEIGHBOUR_EVERY
        self.last = Decision(1 if plain_first else bs_max, "start")
        self.memory: str | None = None  # where its acceptance is remembered (policy.py)
        self.copy_rates = CopyRates()  # what its requests' copies got (they go on from it)

    def start_from(self, state: object, lower: bool = False) -> bool:
        """Start from remembered acceptance (`Acceptance.restore`) where it expects more tokens
        at the largest size than the current estimate: a memory only raises the start (a
        pessimistic one would keep drafting off on text the drafter predicts well until probes
        pay; without it a poor start falls back within a few cycles anyway). `lower`: take a
        pessimistic one too (long contexts, where those few cycles are dear and drafters
        trained on short text mostly lose: it then starts with plain steps and probes)."""
        remembered = Acceptance(self.bs_max, self.acc.decay, self.acc.prior, self.acc.weight)
        if not remembered.restore(state):
            return False
        more = remembered.expected_tokens(self.bs_max) > self.acc.expected_tokens(self.bs_max)
        if not (more or lower):
            return False
        self.acc = remembered
        return True

    def rates(self) -> dict[int, float]:
        sizes = range(1, self.bs_max + 1) if self.chains else (1,)
        return {b: self.acc.expected_tokens(b) / self.cost.cost(b) for b in sizes}

    def tree_rates(self) -> dict[int, float]:
        """Expected tokens per one-token-step time of a tree cycle, by budget."""
        guess = TREE_GUESS * self.acc.expected_tokens(self.bs_max)
        return {b: self.tree_acc.expected(b, guess) / self.tree_cost.cost(b) for b in self.trees}

    def graft_pays(self, budget: int, copy: int, hit: float, zero: float) -> bool:
        """Whether a doubtful copy of `copy` tokens should ride on this cycle's tree of `budget`
        nodes (tree.graft) rather than run alone: alone it commits 1 + `hit` tokens at the cost
        of a verify of copy + 1; on the tree it also gains the tree's tokens where it misses
        from the first (`zero` of the time) and costs the tree plus its nodes. On a CPU, where
        a verify costs its width, the copy alone wins; where verifies are nearly flat, not."""
        guess = TREE_GUESS * self.acc.expected_tokens(self.bs_max)
        tree = self.tree_acc.expected(budget, guess)
        alone = (1 + hit) / self.cost.cost(copy + 1)
        both = 1 + hit + zero * max(tree - 1, 0.0)
        return both / (self.tree_cost.cost(budget) + self.cost.cost(copy + 1) - 1) > alone

    def copy_length(self, longest: int, rate: float) -> int:
        """How many tokens a copy proposes (0: none). A copy of n tokens commits 1 + rate +
        ... + rate^n expected tokens (`rate`: how often a copied token follows an accepted one)
        for a verify of n + 1, here costed as a chain of that width (an upper bound: a copy has
        no drafter pass). `longest` if that beats the cycle the controller chose (a plain step at
        least), else the best shorter length that does: at a short context every useful copy
        passes, at a long one (each verified token attends to the whole context) long doubtful
        copies do not."""
        chosen = max(self.last.rates.get(self.last.size, 0.0), 1.0 / self.cost.cost(1))
        rates, expected = {}, 1.0
        for n in range(1, longest + 1):
            expected += rate**n
            rates[n] = expected / self.cost.cost(n + 1)
        if rates and rates[longest] > chosen:
            return longest
        best = max(rates, key=rates.get, default=0)
        return best if best and rates[best] > chosen else 0

    def calibrating(self) -> bool:
        """Without a measured curve, a short run of plain steps from cycle 3 measures one: its
        first step waits for its own queueing and its first timing is not used (CostModel),
        so up to CALIBRATION steps, until one is timed."""
        start = self.calibrate_from
        if start is None or self.cost.calibrated:
            return False
        return start <= self.cycles < start + self.CALIBRATION

    def probe_cap(self) -> int:
        """The longest wait between probes: shorter the more drafting gained lately. A late
        resume loses `upside` per cycle, a failed probe about one plain step, so the wait that
        balances them grows as 1/sqrt(upside) (PROBE_SCALE at twice a plain step's rate)."""
        if self.upside <= 0:
            return self.probe_max
        cap = round(self.PROBE_SCALE / self.upside**0.5)
        return min(max(cap, self.probe_base), self.probe_max)

    def choose(self) -> Decision:
        """The next cycle: a plain step, a chain of some size, or a tree of some budget (a
        drafting cycle is a tree where the best tree's expected rate beats the chain's)."""
        # while plain, probes are chains: the cheapest cycle that measures acceptance (a
        # tree's estimate starts from the chain's); trees compete again once drafting pays
        probing = self.fallback and self.chains
        chains, trees = self.rates(), {} if probing else self.tree_rates()  # once per cycle
        d = self.choose_size(chains, trees)
        if d.size < 2 or not trees:
            return d
        best = max(trees, key=trees.get)
        chain = chains.get(d.size, 0.0) if self.chains else 0.0
        if self.chains and trees[best] <= chain * (1 + self.hysteresis / 2):
            return d
        why = f"tree of {best} (expected {trees[best]:.2f}× a plain step)"
        self.last = replace(d, size=self.bs_max, tree=best, reason=why)
        return self.last

    def choose_size(self, rates: dict[int, float], trees: dict[int, float]) -> Decision:
        """The block size of the next cycle from the chains' and the trees' expected rates
        (`rates`, `tree_rates`): a drafting size's rate is the better of its chain's and the
        best tree's."""
        if trees:
            best_tree = max(trees.values())
            rates = {b: max(r, best_tree) if b >= 2 else r for b, r in rates.items()}
            if not self.chains:
                rates[self.bs_max] = best_tree
        drafting = {b: r for b, r in rates.items() if b >= 2}
        if not drafting:
            self.last = Decision(1, "block 1 only", rates)
            return self.last
        best = max(drafting, key=drafting.get)
        if rates[best] > rates[self.current] * (1 + self.hysteresis / 2):
            self.current = best
        cur = self.current
        if self.calibrating():
            self.last = Decision(1, "measuring a one-token step", rates)
        elif self.fallback:
            if rates[cur] > rates[1] * (1 + self.RESUME * self.hysteresis):
                self.fallback = False
                self.interval = self.probe_base
                self.last = Decision(cur, f"drafting pays again: {pace(cur, rates)}", rates)
            else:
                self.countdown -= 1
                if self.countdown <= 0:
                    self.last = Decision(cur, f"probing block {cur}", rates)
                else:
                    self.last = Decision(1, f"drafting does not pay: {pace(cur, rates)}", rates)
        elif rates[cur] < rates[1] * (1 - self.hysteresis):
            self.fallback = True
            self.acc.boost = 0.0  # the guess kept drafting on until the evidence spoke
            self.interval = self.countdown = self.probe_base
            self.last = Decision(1, f"drafting does not pay: {pace(cur, rates)}", rates)
        elif (near := self.untimed_neighbour(rates)) is not None:
            self.last = Decision(near, f"timing block {near} (close to {cur})", rates)
        else:
            self.last = Decision(cur, f"expected {rates[cur]:.2f}× a plain step", rates)
        if self.plain_first and self.last.size == 1:
            self.last = replace(self.last, reason=f"long context, {self.last.reason}")
        return self.last

    def untimed_neighbour(self, rates: dict[int, float]) -> int | None:
        """A size next to the chosen one whose cost is still the prior's and whose expected
        rate is within NEIGHBOUR_BAND of the chosen one's, every NEIGHBOUR_EVERY drafting
        cycles, until it was timed NEIGHBOUR_TIMINGS times: a prior measured in a few seconds
        can put a size a few per cent off, and sizes never run would keep that error."""
        if not self.timed:
            return None
        self.neighbour_countdown -= 1
        if self.neighbour_countdown > 0:
            return None
        cur = self.current
        near = [
            b
            for b in (cur - 1, cur + 1)
            if 2 <= b <= self.bs_max
            and b in rates
            and self.cost.counts.get(b, 0) < self.NEIGHBOUR_TIMINGS
            and rates[b] >= rates[cur] * (1 - self.NEIGHBOUR_BAND)
        ]
        if not near:
            return None
        self.neighbour_countdown = self.NEIGHBOUR_EVERY
        return max(near, key=rates.get)

    def update(
        self,
        bs: int,
        accepted: int,
        seconds: float | None,
        steady: bool = True,
        tree: int = 0,
        chain: int = 0,
    ) -> None:
        """Feed back a finished cycle: `accepted` drafts of bs-1 (a tree's: its accepted
        depth; `tree` its budget, `chain` what the chain of its likeliest children accepted,
        which keeps the chains' estimate learning while trees run) and its time (None: not
        timed); `steady`: the time is that of a cycle amid its kind, which the cost model
        learns from (a probe's is not: it also appends the waiting context and restarts the
        pipeline, but whether it paid is judged on what it really cost)."""
        self.cycles += 1
        self.idle += 1
        self.upside *= self.UPSIDE_DECAY
        self.tree_acc.age()
        cost = self.tree_cost if tree else self.cost
        if seconds is not None and steady and self.timed:
            cost.observe(tree or bs, seconds)
        if bs < 2:
            return
        if tree:
            self.tree_acc.observe(tree, accepted + 1)
        self.acc.observe(bs, chain if tree else accepted, self.idle)
        self.idle = 0
        spent = cost.cost(tree or bs)
        if seconds is not None and self.timed and self.cost.unit:
            spent = max(spent, seconds / self.cost.unit)
        if not self.fallback:  # the upside is what drafting realised, never what it expected
            rate = (accepted + 1) / spent
            self.realised += self.GAIN_ALPHA * (rate - self.realised)
            self.upside = max(self.upside, self.realised - 1.0)
        else:  # a probe: sooner next time if it paid, else later
            paid = accepted + 1 >= spent
            grown = self.interval // 2 if paid else 2 * self.interval
            self.interval = min(max(grown, self.probe_base), self.probe_cap())
            self.countdown = self.interval


def tree_curve(chain: CostCurve, budgets: tuple[int, ...]) -> CostCurve:
    """A tree cycle's cost by budget: the curve's tree timings where it has them (`trees`),
    else a chain verifying as many tokens (1 + budget) and drafting as many positions."""
    ratios = {b: chain.trees.get(b) or chain.ratio(1 + b) for b in budgets}
    return CostCurve(ratios, measured=chain.measured and all(b in chain.trees for b in budgets))


@dataclass
class AutoTuning:
    """What `--block-size auto` knows and learns about one pair on this machine: the saved cost
    curves (the prior; None: the generic guess), the acceptance earlier processes remembered
    by setting, and the cost models and controllers that requests continue.

    Owned by whoever serves the requests (a session, the bench, a command) and passed to the
    stream; front ends load and save it (`policy.load_tuning`, `policy.save_acceptance`).
    Greedy and sampled requests keep apart cost models: a sampled cycle draws its drafts and
    verifies by rejection, so greedy timings would make sampled drafting look cheaper than it
    is. Requests with the same sampling setting and context band (short, or from 1,024, 2,048,
    4,096, ... tokens) continue one controller: a chat at T = 0.7 does not relearn each turn
    that drafting does not pay, and long prompts, where drafters trained on short ones accept
    less, do not spoil short ones. The bands keep apart cost models too: at a long context a
    plain step costs more and a wide verify more of them than the curve (measured at a short
    one) says, so there the prior is the curve guessed at the band's middle
    (`CostCurve.at_context`) and the one-token step is timed afresh. `guess`: the acceptance
    per position a new controller starts from (the registry's `acceptance_guess`: what the
    drafter accepts on average, measured; None: the generic, optimistic guess)."""

    greedy_curve: CostCurve | None = None
    sampled_curve: CostCurve | None = None
    remembered: dict = field(default_factory=dict)  # Acceptance.state() by controller memory
    long_from: int = 1024  # context tokens from which a request counts as long
    loses_from: int | None = None  # context tokens from which the drafter is known to lose
    guess: float | None = None  # the drafter's measured acceptance (None: the generic guess)
    cost_models: dict[tuple[bool, int], CostModel] = field(default_factory=dict)  # (sampled, band)
    controllers: dict[tuple, BlockController] = field(default_factory=dict)
    # earlier answers, for suffix drafting (suffix.py): what the session's requests said
    answers: SuffixMemory = field(default_factory=SuffixMemory)

    @property
    def batch_prior(self) -> dict[tuple[int, int], float]:
        """Batched cycles' costs by (B rows, bs) from the saved greedy curve (none: timed)."""
        return self.greedy_curve.batches if self.greedy_curve else {}

    def band(self, context_tokens: int) -> int:
        """A context's band: 0 short, else the power of two it starts at (from `long_from`:
        1,024, 2,048, 4,096, ...), each with its own cost model and controllers."""
        if context_tokens < self.long_from:
            return 0
        band = self.long_from
        while band * 2 <= context_tokens:
            band *= 2
        return band

    def prior(self, bs_max: int, sampled: bool, band: int = 0) -> CostCurve:
        """The cost curve requests start from; in a long band, the curve guessed at its middle
        (`CostCurve.at_context`; class docstring)."""
        curve = self.sampled_curve if sampled else self.greedy_curve
        if curve is None:
            curve = CostCurve.generic(bs_max)
        return curve.at_context(round(band * 1.41)) if band else curve

    def controller(
        self,
        bs_max: int,
        setting: tuple = (),
        context_tokens: int = 0,
        sampled: bool = False,
        timed: bool = True,
        trees: tuple[int, ...] = (),
        chains: bool = True,
    ) -> BlockController:
        """The controller of a request, up to `bs_max`. Where the drafter is known to lose on
        long contexts, a long request starts with plain decoding and drafts only when its
        probes pay. A new controller starts from the remembered acceptance of its setting where
        that is better than the guess, and in a long band whatever it is (`start_from`).
        `timed=False` (seeded sampling): a fresh controller on the prior alone, so the sizes,
        and with them the random draws, depend only on the seed and the text."""
        band = self.band(context_tokens)
        loses = self.loses_from is not None and context_tokens >= self.loses_from
        key = (bs_max, setting, band, loses, trees, chains)
        if timed and key in self.controllers:
            return self.controllers[key]
        prior = self.prior(bs_max, sampled, band)
        if timed:
            model = self.cost_models.setdefault((sampled, band), CostModel(prior))
        else:
            model = CostModel(prior)
        # sampled requests keep a light guess: they mostly meet poorer acceptance, where a heavy
        # one only delays the fallback (the guess is what saves greedy starts); a drafter's own
        # measured acceptance is light too: it is what the average prompt gives, not a hope
        heavy = not sampled and self.guess is None
        controller = BlockController(
            bs_max,
            model,
            timed=timed,
            plain_first=loses,
            guess_weight=BlockController.GUESS_WEIGHT if heavy else 1.0,
            guess=BlockController.GUESS if self.guess is None else self.guess,
            trees=trees,
            chains=chains,
        )
        if timed:
            if not loses:  # known-losing contexts keep their pessimistic start, unremembered
                controller.memory = json.dumps([bs_max, list(setting), band > 0])
                memory = self.remembered.get(controller.memory)
                controller.start_from(memory, lower=band > 0)
                if isinstance(memory, dict):  # what copies got then (none: the defaults)
                    controller.copy_rates = CopyRates.read(memory.get("copy"))
            self.controllers[key] = controller
        return controller

    def acceptance(self) -> dict:
        """What to remember between processes: each kept controller's acceptance and copy
        rates by setting."""
        return {
            c.memory: c.acc.state() | {"copy": c.copy_rates.state()}
            for c in self.controllers.values()
            if c.memory
        }
