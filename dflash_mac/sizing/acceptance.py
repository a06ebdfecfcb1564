"""What a cycle is expected to commit, for `--block-size auto` (controller.py):
E[tokens | bs] = 1 + sum_j prod_{k<=j} alpha_k from the running acceptance curve (`Acceptance`:
per-position conditional acceptance alpha_k with exponentially decayed counts; a position not
yet observed inherits the estimate of the one before it), and a tree cycle's committed tokens
by node budget (`TreeAcceptance`). A sampled cycle is counted by its expectations
(`positions`). Pure Python (no MLX)."""

from __future__ import annotations

from collections.abc import Sequence


def positions(n: int, accepted: int, odds: Sequence[float] = ()) -> tuple[list[float], list[float]]:
    """(reached, accepted) for draft positions 1..n of a cycle that judged n drafts and
    accepted `accepted`: indicators, or, given a sampled cycle's `odds` (2n values: each
    draft's acceptance probability min(1, p/q), then each position's expected acceptance
    sum(min(p, q))), their expectations given the drafts. Same means, far less noise: a
    rejection sampler's coin flips and the draws at each position average out (Rao-Blackwell),
    and every cycle says something about its later positions, not only those it reached."""
    if len(odds) != 2 * n:
        reached = [float(k <= accepted + 1) for k in range(1, n + 1)]
        return reached, [float(k <= accepted) for k in range(1, n + 1)]
    reached, hits, w = [], [], 1.0
    for k in range(n):
        reached.append(w)
        hits.append(w * odds[n + k])
        w *= odds[k]
    return reached, hits


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

    def observe(self, bs: int, a: int, elapsed: int = 1, odds: Sequence[float] = ()) -> None:
        """A drafting cycle at `bs` accepted `a` of its bs-1 drafts (a sampled one: counted by
        its `odds`, `positions`), `elapsed` cycles after the last one observed. Plain steps in
        between age the estimate as drafting cycles do (the text moved on: after a poor
        stretch, probes on good text bring drafting back sooner), up to AGE_MAX of them (one
        probe must not outweigh the history: a lucky block at sampling-like acceptance would
        bring the probes back)."""
        fade = self.decay ** min(elapsed, self.AGE_MAX)
        self.reached = [r * fade for r in self.reached]
        self.accepted = [x * fade for x in self.accepted]
        self.boost *= fade
        reached, hits = positions(bs - 1, a, odds)
        for k in range(min(bs - 1, len(self.reached))):
            self.reached[k] += reached[k]
            self.accepted[k] += hits[k]

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
    """What a tree cycle commits by node budget, as a gain over what the largest chain was
    expected to commit on the same cycles (the controller's running estimate, which follows
    the text: so the text's difficulty mostly cancels and a few cycles tell; the tree's own
    chain of likeliest children is no yardstick, a 4-node tree's is 4 deep at most). The gain
    starts from an optimistic guess worth `WEIGHT` chain tokens and drifts back to it slowly
    while no tree runs (`DECAY` a cycle), so a budget that lost is tried again after hundreds
    of cycles, not every few: each try of a losing tree costs what it loses."""

    WEIGHT = 4.0
    DECAY = 0.999
    MEMORY = 64.0  # chain tokens' worth of evidence a remembered gain starts with, at most

    def __init__(self) -> None:
        self.tokens: dict[int, float] = {}  # decayed sums of the trees' committed tokens
        self.chains: dict[int, float] = {}  # ... and of their chains'

    def age(self) -> None:
        """One cycle passed (every cycle, whatever ran)."""
        for b in self.chains:
            self.tokens[b] *= self.DECAY
            self.chains[b] *= self.DECAY

    def observe(self, budget: int, committed: int, chain: float) -> None:
        """A tree of `budget` nodes committed `committed` tokens where the chain was expected
        to commit `chain`."""
        self.tokens[budget] = self.tokens.get(budget, 0.0) + committed
        self.chains[budget] = self.chains.get(budget, 0.0) + chain

    def gain(self, budget: int, guess: float) -> float:
        """Committed tokens per token of the chain, estimated."""
        c, x = self.chains.get(budget, 0.0), self.tokens.get(budget, 0.0)
        return (x + self.WEIGHT * guess) / (c + self.WEIGHT)

    def state(self) -> dict:
        """The decayed sums by budget, to remember between processes (`restore`)."""
        return {str(b): [self.tokens[b], self.chains[b]] for b in self.chains}

    def restore(self, state: object) -> None:
        """Start from remembered sums, worth MEMORY chain tokens at most; an invalid `state`
        changes nothing."""
        try:
            sums = {int(b): (float(x), float(c)) for b, (x, c) in state.items()}  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            return
        for b, (x, c) in sums.items():
            if c > 0 and x >= 0:
                scale = min(1.0, self.MEMORY / c)
                self.tokens[b], self.chains[b] = x * scale, c * scale
