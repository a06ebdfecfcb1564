"""Copy drafting (prompt lookup): when the last few committed tokens occurred earlier in the
prompt or the answer, what followed them there is a draft that costs no drafter pass. Edits
repeat most of a file, refactors repeat their arguments: such drafts run long.

The target verifies a copied block like any other, so greedy output is unchanged; sampled, a
copied token is a draft whose q puts all its mass on it, and the usual rejection sampling with
the residual keeps the target's distribution. `CopyPolicy` sizes each copy from how the last
ones fared and pauses after repeated misses, so text that does not repeat pays almost nothing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .suffix import MAX_MATCH, SuffixMemory

N = 3  # tokens a match needs (the anchor and the two before it)
RESYNC = 8  # tokens after leaving the source within which the copy may resume by one token


class CopyIndex:
    """Where each n-gram of the committed ids last ended, and where the text being copied
    stands. The sequence a match continues is `ids` + [anchor]: its last n-gram ends at the
    anchor, so every n-gram of `ids` is earlier.

    `follow` keeps the source aligned: once the committed tokens have repeated the text at
    `follow` for at least n tokens, the copy goes on from there even where a later occurrence
    of the last n-gram exists (an edit copies the original file, not a recent line of the
    answer that shares a few tokens with it). A shorter run gives way to an n-gram match.

    Where the answer leaves the source (an edit) and no n-gram matches after it (a rename: the
    new name's tokens and the two after them occur nowhere), the copy resumes at the anchor's
    first occurrence in the source just past where the answer left it, within RESYNC tokens,
    so an edit is copied around without waiting for three tokens to match again.

    `memory`: earlier answers (suffix.py), asked where this text has no match (or always,
    with `local` False: copies from this text off); `suffixed` says whether the last proposal
    came from there."""

    def __init__(
        self, ids: list[int], n: int = N, memory: SuffixMemory | None = None, local: bool = True
    ):
        self.n, self.local = n, local
        self.memory = memory
        self.suffixed = False
        self.ids: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram → the position its last copy ended
        self.follow: int | None = None  # the earlier position aligned with ids[-1]
        self.run = 0  # tokens the alignment has matched in a row
        self.lost: tuple[int, int] | None = None  # (source position, answer position) left at
        self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        n, start = self.n, len(self.ids)
        self.ids += ids
        for end in range(start, len(self.ids)):
            gram = tuple(self.ids[end - n + 1 : end + 1]) if end >= n - 1 else None
            self.align(self.ids[end], end, self.last.get(gram) if gram else None)
            if gram:
                self.last[gram] = end

    def align(self, token: int, end: int, match: int | None) -> None:
        """Move the alignment to cover `token` at `end` (`match`: where the n-gram ending
        there last ended, if anywhere)."""
        f = self.follow
        goes_on = f is not None and f + 1 < end and self.ids[f + 1] == token
        if goes_on and (self.run >= self.n or match is None):
            self.follow, self.run = f + 1, self.run + 1  # the source goes on
            return
        if f is not None and not goes_on:
            self.lost = (f + 1, end)
        if match is not None:
            self.follow, self.run, self.lost = match, self.n, None
        elif (j := self.resync(token, end)) is not None:
            self.follow, self.run, self.lost = j, 1, None
        else:
            self.follow, self.run = None, 0

    def resync(self, token: int, end: int) -> int | None:
        """Where `token` (at `end`) first occurs in the source past where the answer left it,
        as far along as the answer has gone since plus a few tokens, within RESYNC tokens of
        leaving; None elsewhere."""
        if self.lost is None:
            return None
        src, left = self.lost
        gone = end - left
        if gone > RESYNC:
            self.lost = None
            return None
        for j in range(src, min(src + gone + 4, end)):
            if self.ids[j] == token:
                return j
        return None

    def propose(self, anchor: int, k: int) -> list[int]:
        """Up to `k` tokens that followed the aligned source (`follow`) if the anchor goes on
        with it, else the latest earlier occurrence of the last n-1 ids and `anchor`, else
        the resumed source (`resync`); [] when there is none. A repeat that overlaps itself (a
        loop shorter than k) continues with its period."""
        f, here = self.follow, len(self.ids)
        match = self.last.get(tuple(self.ids[-(self.n - 1) :] + [anchor]))
        if not self.local:
            end: int | None = None
        elif f is not None and f + 1 < here and self.ids[f + 1] == anchor:
            end = f + 1 if (self.run >= self.n or match is None) else match
        else:
            end = match if match is not None else self.resync(anchor, here)
        self.suffixed = False
        if k <= 0:
            return []
        if end is None:
            if self.memory is None:
                return []
            copy = self.memory.propose(self.ids[-(MAX_MATCH - 1) :] + [anchor], k)
            self.suffixed = bool(copy)
            return copy
        period = here - end  # from the earlier occurrence to the anchor

        def at(j: int) -> int:
            return self.ids[j] if j < here else anchor

        return [at(end + 1 + i % period) for i in range(k)]

    def may_match(self) -> bool:
        """Whether the text repeats now: the committed tokens follow an earlier stretch, or
        left one within RESYNC tokens. Then the next anchor may go on with a copy, and a step
        queued ahead (before the anchor is known) would miss it. Two tokens seen before are not
        enough: a long prompt holds most pairs, and giving up the look-ahead for each cost more
        than the copies it caught (6.8k-token prompt: 0.96x against 1.02x without copies).
        A repeat that starts after a queued step is copied one token later."""
        f = self.follow
        if self.local and ((f is not None and f + 1 < len(self.ids)) or self.lost is not None):
            return True
        return self.memory is not None and self.memory.may_match(self.ids)


@dataclass
class CopyRates:
    """What copies got, as moving averages: how often a copied token follows an accepted one
    after a copy accepted whole (an edit copying its file goes on) and after a partial one, and
    what doubtful copies (after a partial one) commit and how often none (from the edit
    suite's replay, docs/design.md §6). Kept by whoever continues requests of one setting (the
    `auto` controller, and remembered with its acceptance between processes), so a request
    starts from what the last ones' copies got: a sampled target turns down more copied tokens
    than a greedy one. `wait_gain`: what a plain step that waited for its anchor (a copy
    may come) gained over one queued ahead, in plain steps, averaged (`CopyPolicy.waits`)."""

    sure_rate: float = 0.95
    doubtful_rate: float = 0.6
    doubtful_hit: float = 2.7
    doubtful_zero: float = 0.3
    wait_gain: float = 0.5  # optimistic: waits run until they are measured

    def state(self) -> dict[str, float]:
        """The rates, to remember between processes (`read`)."""
        return {k: round(v, 4) for k, v in asdict(self).items()}

    @classmethod
    def read(cls, state: object) -> CopyRates:
        """Rates remembered by an earlier process; the defaults where `state` is not valid."""
        try:
            rates = cls(**{k: float(v) for k, v in state.items()})  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            return cls()
        unit = (rates.sure_rate, rates.doubtful_rate, rates.doubtful_zero)
        if not all(0.0 <= x <= 1.0 for x in unit) or not 0.0 <= rates.doubtful_hit <= 64:
            return cls()
        if not -1.0 <= rates.wait_gain <= CopyPolicy.longest:
            return cls()
        return rates


@dataclass
class CopyPolicy:
    """How long the next copy may be: it doubles after a fully accepted copy (up to `longest`),
    shrinks to what was accepted plus two after a partial one; `patience` misses in a row pause
    copying for `pause` cycles, each pause twice the last (reset by a hit). After a partial
    copy the next is not `sure`: where a tree is due, it may become a branch of that tree.
    `rates`: what copies got (`CopyRates`), passed in where they outlive the request. Where
    the costs price every copy out (poor rates carried over from other text, or a fresh
    start's doubtful rate where a verify is dear), `probe` lets every `patience + 1`-th refused
    one through at up to `PROBE` tokens (the caller prices it as what it looks for, a repeat
    taken whole, at a fresh start's rate): rates only move when copies run, so without it a
    request that repeats its prompt would never find out."""

    PROBE = 4  # tokens of a probing copy (a 5-token verify costs ~1.5 plain steps on a CPU)
    TOKEN_ALPHA = 0.05  # the rates' step per copied token judged
    WAIT_PROBE = 8  # where waits lost lately, every 8th still waits: the gain stays measured
    longest: int = 32  # a 32-token verify costs ~3 plain steps on a CPU, less on a GPU
    budget: int = 8
    patience: int = 3
    misses: int = 0
    pause: int = 8
    paused: int = 0
    sure: bool = False  # the last copy was accepted whole (else a tree cycle may hedge it)
    refused: int = 0  # copies the costs refused since the last one ran
    skipped: int = 0  # waits for an anchor passed up since the last one
    rates: CopyRates = field(default_factory=CopyRates)
    counts: dict[str, int] = field(default_factory=lambda: {"cycles": 0, "tokens": 0})

    @property
    def rate(self) -> float:
        """How often the next copy's tokens are expected to follow accepted ones."""
        r = self.rates
        return r.sure_rate if self.sure else r.doubtful_rate

    def length(self) -> int:
        """The most tokens to copy this cycle (0: no copy now)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.budget

    def probe(self, longest: int) -> int:
        """Tokens to copy after the costs refused a copy of up to `longest` (0: none)."""
        self.refused += 1
        if self.refused <= self.patience:
            return 0
        return min(longest, self.PROBE)

    def waits(self) -> bool:
        """Whether a plain step waits for its anchor on the host, where a copy may follow it,
        instead of being queued ahead on the lazy token (the pipeline's overlap lost: a tenth
        of a step on the tiny pair on a CPU): while waits gained lately (`rates.wait_gain`),
        else every WAIT_PROBE-th time. A sampled target turns down most copies, and waiting
        for each cost more than the copies caught (tiny pair, T 0.7: 221 waits, 44 copies)."""
        if self.rates.wait_gain > 0:
            return True
        self.skipped = (self.skipped + 1) % self.WAIT_PROBE
        return self.skipped == 0

    def waited(self, gain: float) -> None:
        """What a wait gained, in plain steps: a copy's tokens less its cost, the wait in it,
        or (no copy) minus the wait alone."""
        r = self.rates
        r.wait_gain += 0.1 * (min(max(gain, -1.0), float(self.longest)) - r.wait_gain)

    def update(self, proposed: int, accepted: int) -> None:
        self.refused = 0
        self.counts["cycles"] += 1
        self.counts["tokens"] += accepted
        r = self.rates
        if not self.sure:
            r.doubtful_hit += 0.1 * (accepted - r.doubtful_hit)
            r.doubtful_zero += 0.1 * ((accepted == 0) - r.doubtful_zero)
        # counted per copied token judged (each accepted one a success, the rejection that
        # ended a partial copy a failure; a whole copy ends with none): counted per copy, five
        # 1-token misses outweighed a 32-token repeat taken whole, and `auto` cut the repeats
        # of an edit to 5 tokens a cycle where block 8 copied them whole
        kept = (1.0 - self.TOKEN_ALPHA) ** accepted
        fail = 1.0 - self.TOKEN_ALPHA if accepted < proposed else 1.0
        if self.sure:
            r.sure_rate = (1.0 - (1.0 - r.sure_rate) * kept) * fail
        else:
            r.doubtful_rate = (1.0 - (1.0 - r.doubtful_rate) * kept) * fail
        self.sure = accepted == proposed
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
