"""Presence, frequency and repetition penalties and logit bias, with mlx-lm's definitions
(`mlx_lm.sample_utils.make_logits_processors`), applied to the target's p and the drafter's q
alike (docs/design.md §7: rejection sampling stays lossless when both see the same transform).

Block position j is penalised given its own prefix: the committed tokens plus drafts 1..j.
Counts over the last `context_size` tokens of that prefix come from one scatter for all
positions. A leaf like `distribution.py`: drafters and the engine both use it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .distribution import SamplingParams, probabilities, sample

CONTEXT_SIZE = 20  # mlx-lm's default window for all three penalties


@dataclass(frozen=True)
class Limit:
    """The accepted range of one setting: the one rule (and wording) of the CLI and server."""

    lo: float
    hi: float
    lo_open: bool = False

    def check(self, name: str, value: float) -> None:
        """ValueError with one sentence naming the setting as `name` when out of range."""
        if value < self.lo or value > self.hi or (self.lo_open and value == self.lo):
            low = f"> {self.lo}" if self.lo_open else f">= {self.lo}"
            raise ValueError(f"{name} must be {low} and <= {self.hi} (got {value}).")


# request field -> range (OpenAI's for presence / frequency and logit bias; repetition as vLLM)
LIMITS = {
    "presence_penalty": Limit(-2.0, 2.0),
    "frequency_penalty": Limit(-2.0, 2.0),
    "repetition_penalty": Limit(0.0, 10.0, lo_open=True),
    "logit_bias": Limit(-100.0, 100.0),
}
Namer = Callable[[str], str]  # a request field as a front end names it


def flag_name(field: str) -> str:
    """The command line's name of a request field: `--presence-penalty`."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class Penalties:
    """A request's logit transforms before temperature; zeros / None / () mean off."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    context_size: int = CONTEXT_SIZE

    @classmethod
    def make(
        cls,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        context_size: int = CONTEXT_SIZE,
    ) -> Penalties | None:
        """The validated transform, or None when nothing is set (no cost at all then)."""
        pen = cls(
            float(presence_penalty or 0.0),
            float(frequency_penalty or 0.0),
            None if repetition_penalty is None else float(repetition_penalty),
            tuple((int(k), float(v)) for k, v in (logit_bias or {}).items()),
            context_size,
        ).validate()
        return pen if pen.active else None

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition or self.logit_bias)

    def validate(self, vocab: int | None = None, name: Namer = flag_name) -> Penalties:
        """Raise ValueError with one sentence naming the bad setting (`name`: how the front
        end names a request field)."""
        for field, value in (
            ("presence_penalty", self.presence),
            ("frequency_penalty", self.frequency),
            ("repetition_penalty", self.repetition),
        ):
            if value is not None:
                LIMITS[field].check(name(field), value)
        if self.context_size < 1:
            raise ValueError(f"the penalty context must be at least 1 (got {self.context_size}).")
        for tok, bias in self.logit_bias:
            check_bias_token(tok, vocab, name)
            LIMITS["logit_bias"].check(name("logit_bias"), bias)
        return self

    def bind(self, history: list[int]) -> PenaltyContext:
        """The context for one block whose committed prefix ends with `history`."""
        tail = history[-self.context_size :]
        return PenaltyContext(self, mx.array(tail, dtype=mx.int32), len(tail))


def check_bias_token(tok: int, vocab: int | None, name: Namer = flag_name) -> None:
    """A logit-bias key must be a token id of the vocabulary (0..vocab-1 when known)."""
    if tok < 0 or (vocab is not None and tok >= vocab):
        known = f" (0..{vocab - 1})" if vocab is not None else ""
        raise ValueError(f"{name('logit_bias')} token {tok} is not in the vocabulary{known}.")


@dataclass
class PenaltyContext:
    """One block's committed tail; `apply` penalises logits of block positions."""

    pen: Penalties
    tail: mx.array  # the last `context_size` committed tokens, int32
    m: int

    def counts(self, drafts: mx.array, first: int, rows: int, vocab: int) -> mx.array:
        """Occurrences ``[rows, V]`` in the window before positions first..first+rows-1."""
        last = first + rows - 1
        seq = mx.concatenate([self.tail, drafts[:last].astype(mx.int32)])
        L = seq.shape[0]
        out = mx.zeros((rows, vocab), dtype=mx.float32)
        if L == 0:
            return out
        i = mx.arange(L)[None, :]
        end = self.m + mx.arange(first, last + 1)[:, None]  # prefix length of each row
        w = ((i < end) & (i >= end - self.pen.context_size)).astype(mx.float32)
        r = mx.broadcast_to(mx.arange(rows)[:, None], (rows, L))
        return out.at[r, mx.broadcast_to(seq[None], (rows, L))].add(w)

    def apply(self, logits: mx.array, drafts: mx.array, first: int = 0) -> mx.array:
        """Penalised ``logits [R, V]`` of block positions first..first+R-1 (position j's
        prefix: the committed tail and drafts[:j]). Order as mlx-lm: bias, repetition,
        presence, frequency."""
        p = self.pen
        rows, vocab = logits.shape
        if p.logit_bias:
            idx = mx.array([k for k, _ in p.logit_bias])
            logits = logits.at[:, idx].add(mx.array([v for _, v in p.logit_bias]))
        if not (p.repetition or p.presence or p.frequency):
            return logits
        counts = self.counts(drafts, first, rows, vocab)
        present = counts > 0
        if p.repetition:
            scaled = mx.where(logits < 0, logits * p.repetition, logits / p.repetition)
            logits = mx.where(present, scaled, logits)
        if p.presence:
            logits = mx.where(present, logits - p.presence, logits)
        if p.frequency:
            logits = logits - (p.frequency * counts).astype(logits.dtype)
        return logits


def draft_sequential(
    logits: mx.array, ctx: PenaltyContext, sp: SamplingParams, key: mx.array
) -> tuple[mx.array, mx.array | None]:
    """Drafts from drafter ``logits [n, V]`` one position at a time, each penalised given the
    drafts before it; q ``[n, V]`` is what each draft was drawn from (None when greedy).
    Lazy: n small graph steps, no host sync."""
    n = logits.shape[0]
    keys = mx.random.split(key, max(n, 1))
    drafts = mx.zeros((0,), dtype=mx.int32)
    qs = []
    for i in range(n):
        row = ctx.apply(logits[i : i + 1], drafts, first=i)
        if sp.greedy:
            d = mx.argmax(row, axis=-1)
        else:
            q = probabilities(row, sp)
            qs.append(q)
            d = sample(q, key=keys[i])
        drafts = mx.concatenate([drafts, d.astype(mx.int32)])
    return drafts, (mx.concatenate(qs) if qs else None)
