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
timed a few times, so a prior that is a few per cent off at a size is corrected; and while
drafting, a few plain steps now and then time the one-token step the costs are ratios of (the
host's speed drifts: cost.py). Greedy and
sampled decoding keep apart cost models (`AutoTuning.controller`). Pure Python (no MLX):
unit-testable with synthetic inputs (docs/bench.md).

The costs are cost.py's, the acceptance acceptance.py's; `AutoTuning` (tuning.py) keeps the
controllers that requests continue; sizer.py says what the decode loop asks of a controller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..drafting.copies import CopyRates
from .acceptance import Acceptance, TreeAcceptance, positions
from .cost import CostModel, tree_curve

# A tree at first is guessed to commit this much more than the chain of its depth (DDTree
# reports 1.3x and more; the guess only decides whether trees get tried, then they are measured
# against what the largest chain was expected to commit on the same cycles: TreeAcceptance)
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
    """Chooses each cycle's block size (1..bs_max); see the module docstring. What the decode
    loop asks of it is `sizer.CopySizer` (a `BlockSizer` that also prices copies)."""

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
    UNIT_EVERY = (64, 128, 512)  # cycles between plain steps timed while drafting: least, first,
    # most (a host's speed drifts by a third within minutes; the costs are ratios to it)
    UNIT_STEPS = 3  # plain steps a timing takes: the middle one is timed amid its kind
    UNIT_MATCH = 0.1  # a timed step this close to the unit the drafting cycles tracked agrees

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
        self.unit_every, self.unit_timed, self.unit_steps = self.UNIT_EVERY[1], 0, 0
        self.last = Decision(1 if plain_first else bs_max, "start")
        self.memory: str | None = None  # where its acceptance is remembered (files.py)
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
        chain = self.acc.expected_tokens(self.bs_max)
        gain = self.tree_acc.gain
        return {b: chain * gain(b, TREE_GUESS) / self.tree_cost.cost(b) for b in self.trees}

    def graft_pays(self, budget: int, copy: int, hit: float, zero: float) -> bool:
        """Whether a doubtful copy of `copy` tokens should ride on this cycle's tree of `budget`
        nodes (tree.graft) rather than run alone: alone it commits 1 + `hit` tokens at the cost
        of a verify of copy + 1; on the tree it also gains the tree's tokens where it misses
        from the first (`zero` of the time) and costs the tree plus its nodes. On a CPU, where
        a verify costs its width, the copy alone wins; where verifies are nearly flat, not."""
        tree = self.acc.expected_tokens(self.bs_max) * self.tree_acc.gain(budget, TREE_GUESS)
        alone = (1 + hit) / self.cost.copy(copy + 1)
        both = 1 + hit + zero * max(tree - 1, 0.0)
        return both / (self.tree_cost.cost(budget) + self.cost.copy(copy + 1) - 1) > alone

    def copy_length(self, longest: int, rate: float) -> int:
        """How many tokens a copy proposes (0: none). A copy of n tokens commits 1 + rate +
        ... + rate^n expected tokens (`rate`: how often a copied token follows an accepted one)
        for a verify of n + 1, costed as a chain of that width less its drafter pass (a copy
        has none: `CostModel.copy`). `longest` if that beats the cycle the controller chose (a
        plain step at least), else the best shorter length that does: at a short context every
        useful copy passes, at a long one (each verified token attends to the whole context)
        long doubtful copies do not."""
        chosen = max(self.last.rates.get(self.last.size, 0.0), 1.0 / self.cost.cost(1))
        rates, expected = {}, 1.0
        for n in range(1, longest + 1):
            expected += rate**n
            rates[n] = expected / self.cost.copy(n + 1)
        if rates and rates[longest] > chosen:
            return longest
        best = max(rates, key=rates.get, default=0)
        return best if best and rates[best] > chosen else 0

    def copied(self, width: int, seconds: float) -> None:
        """A copy cycle verifying `width` tokens took `seconds` amid cycles of its kind."""
        if self.timed:
            self.cost.observe_copy(width, seconds)

    def plain_step(self) -> float | None:
        """A one-token step's seconds now, as the costs track it (None: not timed yet)."""
        return self.cost.unit if self.timed else None

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
        elif (self.unit_steps or rates[cur] < rates[1] * self.cost.TRUST) and self.unit_due():
            self.last = Decision(1, "timing a plain step (the machine's speed drifts)", rates)
        elif (near := self.untimed_neighbour(rates)) is not None:
            self.last = Decision(near, f"timing block {near} (close to {cur})", rates)
        else:
            self.last = Decision(cur, f"expected {rates[cur]:.2f}× a plain step", rates)
        if self.plain_first and self.last.size == 1:
            self.last = replace(self.last, reason=f"long context, {self.last.reason}")
        return self.last

    def unit_due(self) -> bool:
        """Whether this drafting stretch's cycle is a plain step that times the unit the costs
        are ratios of (UNIT_STEPS of them every `unit_every` cycles): a size run for minutes
        tracks the host's speed through its own ratio, and only a timed plain step shows
        that ratio was off (a curve timed at another moment). Asked only where drafting's
        expected gain is within the costs' TRUST (beyond it no ratio error the costs may
        learn turns the choice; one begun is finished, or its first step is wasted); further
        apart while they agree with the tracked unit, closer while not (`retime`)."""
        if not self.timed:
            return False
        if self.unit_steps:
            self.unit_steps -= 1
            return True
        if self.cycles - self.unit_timed < self.unit_every:
            return False
        self.unit_steps, self.unit_timed = self.UNIT_STEPS - 1, self.cycles
        return True

    def retime(self, seconds: float) -> None:
        """A plain step timed amid its kind: the next timing comes twice as late if it agrees
        with the unit (UNIT_MATCH), at the least interval if not."""
        least, _, most = self.UNIT_EVERY
        unit, self.unit_timed = self.cost.unit, self.cycles
        if unit:
            agrees = abs(seconds / unit - 1.0) <= self.UNIT_MATCH
            self.unit_every = min(2 * self.unit_every, most) if agrees else least

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
        self.unit_every, self.unit_timed, self.unit_steps = self.UNIT_EVERY[1], 0, 0
        return max(near, key=rates.get)

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
        """Feed back a finished cycle: `accepted` drafts of bs-1 (a tree's: its accepted
        depth; `tree` its budget, `chain` what the chain of its likeliest children accepted,
        which keeps the chains' estimate learning while trees run, of its first `reach`
        positions (those the tree drafted; 0: all); a sampled chain's `odds`:
        acceptance.positions) and its time (None: not timed); `steady`: the time is that of a
        cycle amid its kind, which the cost model learns from (a probe's is not: it also
        appends the waiting context and restarts the pipeline, but whether it paid is judged on
        what it really cost)."""
        self.cycles += 1
        self.idle += 1
        self.upside *= self.UPSIDE_DECAY
        self.tree_acc.age()
        cost = self.tree_cost if tree else self.cost
        if seconds is not None and steady and self.timed:
            if bs == 1:
                self.retime(seconds)
            cost.observe(tree or bs, seconds)
        if bs < 2:
            return
        if tree:  # against what the largest chain was expected to commit, as `tree_rates` uses
            self.tree_acc.observe(tree, accepted + 1, self.acc.expected_tokens(self.bs_max))
        if tree:  # the chain's positions past the tree's reach were not judged: not rejected
            self.acc.observe(min(bs, reach + 1) if reach else bs, chain, self.idle)
        else:
            self.acc.observe(bs, accepted, self.idle, odds)
        self.idle = 0
        spent = cost.cost(tree or bs)
        if seconds is not None and self.timed and self.cost.unit:
            spent = max(spent, seconds / self.cost.unit)
        if odds and not tree:  # what it was expected to commit given its drafts: less noise
            accepted = sum(positions(bs - 1, accepted, odds)[1])
        if not self.fallback:  # the upside is what drafting realised, never what it expected
            rate = (accepted + 1) / spent
            self.realised += self.GAIN_ALPHA * (rate - self.realised)
            self.upside = max(self.upside, self.realised - 1.0)
        else:  # a probe: sooner next time if it paid, else later
            paid = accepted + 1 >= spent
            grown = self.interval // 2 if paid else 2 * self.interval
            self.interval = min(max(grown, self.probe_base), self.probe_cap())
            self.countdown = self.interval
