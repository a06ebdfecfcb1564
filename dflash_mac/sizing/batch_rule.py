"""One block size for a batch, from measured cycle costs (issue #36, docs/design.md §6).

A verify costs more as batch × block grows, so the best block for one request is not the best
for four. `BatchBlockRule` keeps, per batch size B, the measured time of a cycle at each
candidate block size (exponential moving averages; the first cycle at a (B, bs), which compiles
its graphs, is not used) and one running per-position acceptance rate alpha over all rows. It
picks the size maximising B * E[tokens | bs] / cost(B, bs) with E = 1 + alpha + ... +
alpha^(bs-1); candidates are timed in ascending order at each B (three cycles each), a larger
one only while it could still pay at the cost of the largest timed below it (costs grow with
the block), and every `REVISIT` cycles the runner-up is timed again so the costs follow the
machine. With a measured curve by batch size (`bench --cost-curve`, `prior`: a cycle's cost in
one-row plain steps by (B, bs)), only the plain batched step is timed at a new B: the other
sizes start at that time scaled by the curve, and are timed once they are chosen (or revisited
as the runner-up). Pure Python.

`BatchBlockRule` is a `sizer.BatchSizer`, not the one-request `sizer.BlockSizer`: a batch's
size is chosen for its rows and their room and fed back with every row's acceptance at once
(sizer.py says what each loop asks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .acceptance import positions


@dataclass
class BatchBlockRule:
    bs_max: int
    fixed: bool = False  # a fixed --block-size: always bs_max
    alpha: float = 0.5  # per-position acceptance (prior until drafts are seen)
    decay: float = 0.9
    REVISIT = 32
    SAMPLES = 2  # timed cycles before a candidate's cost counts
    cost: dict[tuple[int, int], float] = field(default_factory=dict)
    timed: dict[tuple[int, int], int] = field(default_factory=dict)
    cycles: dict[int, int] = field(default_factory=dict)
    prior: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, bs) -> plain steps
    last_reason: str = ""

    @property
    def candidates(self) -> list[int]:
        return sorted({1, 2, 4, self.bs_max} & set(range(1, self.bs_max + 1)))

    def expected(self, bs: int) -> float:
        """Tokens a row commits per cycle at `bs` (drafts accepted + the bonus)."""
        return sum(self.alpha**j for j in range(bs))

    def choose(self, batch: int, room: int) -> int:
        """The block size of the next cycle of `batch` rows, at most `room` (the most tokens
        any row still needs)."""
        cap = max(1, min(self.bs_max, room))
        if self.fixed:
            self.last_reason = "fixed"
            return cap
        sizes = [s for s in self.candidates if s <= cap] or [1]
        rates: dict[int, float] = {}
        for s in sizes:  # ascending: a cycle costs at least what a smaller one costs
            if (cost := self.known_cost(batch, s)) is not None:
                rates[s] = batch * self.expected(s) / cost
                continue
            floor = max((self.cost[(batch, t)] for t in rates), default=0.0)
            if floor and batch * self.expected(s) / floor < max(rates.values()):
                continue  # cannot pay even at a smaller size's cost: not worth timing
            self.last_reason = "timing"
            return s
        ranked = sorted(rates, key=rates.get, reverse=True)
        n = self.cycles.get(batch, 0)
        if len(ranked) > 1 and n % self.REVISIT == self.REVISIT - 1:
            self.last_reason = "revisit"
            return ranked[1]
        self.last_reason = "best"
        return ranked[0]

    def known_cost(self, batch: int, bs: int) -> float | None:
        """Seconds of a cycle of `batch` rows at `bs`: measured, else the plain batched step's
        measured time scaled by the prior curve, else unknown (None)."""
        if self.timed.get((batch, bs), 0) >= self.SAMPLES + 1:
            return self.cost[(batch, bs)]
        base = (batch, 1)
        if (batch, bs) in self.prior and base in self.prior and bs != 1:
            if self.timed.get(base, 0) >= self.SAMPLES + 1:
                return self.cost[base] * self.prior[(batch, bs)] / self.prior[base]
        return None

    def update(
        self,
        batch: int,
        bs: int,
        seconds: float | None,
        accepted: list[int],
        odds: Sequence[Sequence[float]] = (),
    ) -> None:
        """A cycle of `batch` rows at `bs` took `seconds` (None: not a cycle of that shape, as
        one where some rows verified copies); row i accepted `accepted[i]` of its bs - 1
        drafts (a sampled row: counted by its `odds[i]`, acceptance.positions)."""
        if seconds is None:
            self.learn(bs, accepted, odds)
            return
        key = (batch, bs)
        n = self.timed.get(key, 0)
        self.timed[key] = n + 1
        self.cycles[batch] = self.cycles.get(batch, 0) + 1
        if n >= 1:  # the first cycle at a shape compiles
            old = self.cost.get(key)
            self.cost[key] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self.learn(bs, accepted, odds)

    def learn(self, bs: int, accepted: list[int], odds: Sequence[Sequence[float]] = ()) -> None:
        """The running acceptance, from rows that judged all of a cycle's bs - 1 drafts."""
        if bs > 1 and accepted:
            # per-position acceptance: accepted positions over positions tried (a rejection
            # ends a row's tries; a sampled row's are expectations)
            counts = [positions(bs - 1, a, odds[i] if odds else ()) for i, a in enumerate(accepted)]
            tried = sum(sum(reached) for reached, _ in counts)
            rate = sum(sum(hits) for _, hits in counts) / max(1.0, tried)
            self.alpha = self.decay * self.alpha + (1 - self.decay) * rate
