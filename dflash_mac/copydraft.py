"""Copy drafting (prompt lookup): when the last few committed tokens occurred earlier in the
prompt or the answer, what followed them there is a draft that costs no drafter pass. Edits
repeat most of a file, refactors repeat their arguments: such drafts run long.

The target verifies a copied block like any other, so greedy output is unchanged; sampled, a
copied token is a draft whose q puts all its mass on it, and the usual rejection sampling with
the residual keeps the target's distribution. `CopyPolicy` sizes each copy from how the last
ones fared and pauses after repeated misses, so text that does not repeat pays almost nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

N = 3  # tokens a match needs (the anchor and the two before it)


class CopyIndex:
    """Where each n-gram of the committed ids last ended. The sequence a match continues is
    `ids` + [anchor]: its last n-gram ends at the anchor, so every n-gram of `ids` is earlier."""

    def __init__(self, ids: list[int], n: int = N):
        self.n = n
        self.ids: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram → the position its last copy ended
        self.heads: set[tuple[int, ...]] = set()  # their first n-1 tokens
        self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        n, start = self.n, len(self.ids)
        self.ids += ids
        for end in range(max(n - 1, start), len(self.ids)):
            gram = tuple(self.ids[end - n + 1 : end + 1])
            self.last[gram] = end
            self.heads.add(gram[:-1])

    def propose(self, anchor: int, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the last n-1 ids and
        `anchor`; [] when there is none. A repeat that overlaps itself (a loop shorter than k)
        continues with its period."""
        end = self.last.get(tuple(self.ids[-(self.n - 1) :] + [anchor]))
        if end is None or k <= 0:
            return []
        period = len(self.ids) - end  # from the earlier occurrence to the anchor

        def at(j: int) -> int:
            return self.ids[j] if j < len(self.ids) else anchor

        return [at(end + 1 + i % period) for i in range(k)]

    def may_match(self) -> bool:
        """Whether the next anchor could complete a match (then a step queued ahead, before the
        anchor is known, would miss a copy)."""
        return tuple(self.ids[-(self.n - 1) :]) in self.heads


@dataclass
class CopyPolicy:
    """How long the next copy may be: it doubles after a fully accepted copy (up to `longest`),
    shrinks to what was accepted plus two after a partial one; `patience` misses in a row pause
    copying for `pause` cycles, each pause twice the last (reset by a hit)."""

    longest: int = 16  # a 16-token verify costs ~2 plain steps on a CPU, less on a GPU
    budget: int = 8
    patience: int = 3
    misses: int = 0
    pause: int = 8
    paused: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"cycles": 0, "tokens": 0})

    def length(self) -> int:
        """The most tokens to copy this cycle (0: no copy now)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.budget

    def update(self, proposed: int, accepted: int) -> None:
        self.counts["cycles"] += 1
        self.counts["tokens"] += accepted
        if accepted == proposed:
            self.budget = min(self.longest, 2 * self.budget)
        else:
            self.budget = max(2, accepted + 2)
        if accepted == 0:
            self.misses += 1
            if self.misses >= self.patience:
                self.paused, self.pause, self.misses = self.pause, 2 * self.pause, 0
        else:
            self.misses, self.pause = 0, 8
