"""The engine side of the chat app: loading, the turn statistics, the context window.

Nothing here touches widgets; the app runs these in thread workers and posts messages."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dflash_mac.api import PromptError, fit_max_tokens, reasoning_args
from dflash_mac.engine.stats import DecodeStats
from dflash_mac.loading.registry import load_registry
from dflash_mac.sizing.choice import BlockChoice


@dataclass
class ChatOptions:
    """What `dflash-mac chat` was started with."""

    model: str | None = None
    draft: str | None = None
    system: str | None = None
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    block_size: int | str | None = None
    max_tokens: int = 1024
    reasoning: str | None = None
    draft_bits: int | None = None
    seed: int | None = None
    chat_template: str | None = None  # a template that replaces the model's (its text)
    max_kv_size: int | None = None  # the target's rotating window (None: unbounded)
    draft_vocab: int | None = None  # a K-row drafter head (draft_vocab.py)
    # suffix drafting from this chat's earlier answers (drafting/suffix.py)
    suffix: bool | None = None

    def generation_kwargs(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "block_size": self.block_size,
            "temp": self.temp,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "suffix": self.suffix,
        }


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the loaded pair shown in the side panel."""

    model: str
    kind: str
    block_size: int
    kernels: str
    reasoning: bool  # the chat template has an on/off thinking switch
    auto: bool = False  # `--block-size auto`: block_size is the most it picks

    @property
    def block(self) -> str:
        """ "8", or "auto ≤8": what the blocks will be before the first answer says more."""
        return BlockChoice(self.block_size, auto=self.auto).label


def turn_stats(stats: DecodeStats, finish: str | None) -> dict:
    """The numbers stored with an answer and shown in its stats line: what this answer
    measured. No speedup: a plain rate timed at another moment and context is no baseline
    (`dflash-mac bench` times both back to back; docs/chat.md)."""
    return {
        "tokens": stats.generation_tokens,
        "tps": round(stats.decode_tps, 2),
        "tau": round(stats.tau, 3),
        "prompt": stats.prompt_tokens,
        "cached": stats.cached_tokens,
        "finish": finish,
    }


def block_label(stats: Any) -> str:
    """The panel's block row: the fixed size, or auto with its last choice (1: plain target
    steps); why it chose is `auto_reason`'s row."""
    if not getattr(stats, "auto", False):
        return str(stats.block_size)
    sizes = getattr(stats, "block_sizes", ())
    now = "" if not sizes else " · now plain steps" if sizes[-1] == 1 else f" · now {sizes[-1]}"
    return f"{stats.block_label}{now}"


@dataclass(frozen=True)
class Fit:
    """A turn's prompt after fitting the conversation into the model's context."""

    prompt: Any  # ids (or the message list for a fake session without a tokenizer)
    thinking: bool  # the answer starts inside a thinking section
    skip: int  # messages left out from the start of the conversation (whole turns)
    max_tokens: int  # the answer's budget, capped to the room left in the context
    capped: bool


@dataclass
class Backend:
    """A session-like object (`stream(prompt, should_stop=..., **kw)`) plus what the UI shows.

    With a tokenizer the prompt is tokenized here: when the new conversation text extends the
    text of the last turn (prompt + answer), the ids are that turn's prompt ids + the answer's
    generated ids + the tokenized rest, so exactly the tokens the session has cached are
    reused even where re-tokenizing the answer would give other ids. A fake session in tests
    (no tokenizer) receives the message list as is."""

    session: Any
    info: EngineInfo
    tokenizer: Any = None
    warnings: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one engine job at a time
    last: tuple[str, list[int]] | None = None  # text and ids of the last finished turn
    pending: tuple[str, list[int]] | None = None  # text and ids of the turn being generated
    context: int = 0  # the model's context in tokens (0: unknown, no window management)
    block: Any = None  # the block-size choice resolved at load (`sizing.choice.BlockChoice`)

    def render(self, messages: list[dict], system: str | None, reasoning: str | None) -> str:
        full = ([{"role": "system", "content": system}] if system else []) + messages
        return self.tokenizer.apply_chat_template(
            full,
            add_generation_prompt=True,
            tokenize=False,
            **reasoning_args(self.tokenizer, reasoning),
        )

    def prompt(
        self, messages: list[dict], system: str | None, reasoning: str | None
    ) -> tuple[Any, bool]:
        """(prompt for `session.stream`, whether the answer starts inside a thinking section)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            full = ([{"role": "system", "content": system}] if system else []) + messages
            return full, False
        text = self.render(messages, system, reasoning)
        if self.last and text.startswith(self.last[0]):
            rest = text[len(self.last[0]) :]
            ids = self.last[1] + list(self.tokenizer.encode(rest, add_special_tokens=False))
        else:
            ids = self.session.tokenize(messages, system=system or None, reasoning=reasoning)
        self.pending = (text, ids)
        return ids, text.rstrip().endswith("<think>")

    def fit(
        self,
        messages: list[dict],
        system: str | None,
        reasoning: str | None,
        max_tokens: int,
        skip: int = 0,
    ) -> Fit:
        """The prompt for the next answer, keeping the system prompt and the newest turns.

        When the conversation plus room for an answer (max_tokens, at most a quarter of the
        context) no longer fits the context, the oldest turns (a question and its answer)
        are left out until the prompt fills at most half of the context, so that the next
        few turns fit again and reuse the cached prefix; `skip` only grows. A last message
        that alone does not fit fails with the usual PromptError."""
        limit = self.context
        while True:
            prompt, thinking = self.prompt(messages[skip:], system, reasoning)
            if not self.context or not prompt or not isinstance(prompt[0], int):
                return Fit(prompt, thinking, skip, max_tokens, False)
            room = min(max_tokens, max(1, self.context // 4))
            if len(prompt) + room <= limit or skip + 2 >= len(messages):
                break
            skip, limit = skip + 2, self.context // 2
        budget = fit_max_tokens(self.context, len(prompt), max_tokens)
        return Fit(prompt, thinking, skip, budget.max_tokens, budget.capped)

    def record(self, answer: str, answer_ids: list[int]) -> None:
        """Remember a finished turn (its text and ids) for the next turn's prompt."""
        if self.pending is not None:
            text, ids = self.pending
            self.last, self.pending = (text + answer, ids + list(answer_ids)), None

    def stream(self, prompt: Any, should_stop: Callable[[], bool], **kwargs: Any) -> Iterator:
        """A turn's events; afterwards what `auto` saw is remembered for the next process."""
        if self.block is not None:
            kwargs["block_size"] = self.block
        yield from self.session.stream(prompt, should_stop=should_stop, **kwargs)
        if (tuning := getattr(self.session, "tuning", None)) is not None:
            from dflash_mac.sizing.files import save_acceptance

            save_acceptance(self.session.pair, tuning)

    def warm(
        self, messages: list[dict], system: str | None, reasoning: str | None, skip: int = 0
    ) -> tuple[int, int]:
        """Prefill a resumed conversation while the user types, so that its next turn only
        prefills the new message; returns (cached tokens (0: nothing done), messages left
        out to fit the context)."""
        if self.tokenizer is None or not messages or not hasattr(self.session, "state"):
            return 0, skip
        fit = self.fit(messages, system, reasoning, 1, skip)
        for _ in self.session.stream(fit.prompt, should_stop=lambda: True, max_tokens=1):
            pass
        self.pending = None
        return len(self.session.state.ids), fit.skip


def kernels_name() -> str:
    from dflash_mac.metal_kernels import kernels_in_use

    try:
        return str(kernels_in_use())
    except Exception:
        return "reference"


def has_thinking_switch(tokenizer: Any) -> bool:
    try:
        return bool(reasoning_args(tokenizer, "off"))
    except PromptError:
        return False


Status = Callable[[str, float | None], None]  # a loading step's text and fraction done


def load_backend(opts: ChatOptions, status: Status | None = None) -> Backend:
    """Load the pair (`prepare.prepare`, as every front end), measure its cost curve when
    `auto` has none on this machine (once), and open a session (runs in a worker; `status`
    hears each step)."""
    from dflash_mac.cli.terminal import ranked_loader
    from dflash_mac.prepare import (
        calibrate,
        calibration_steps,
        calibration_title,
        needs_calibration,
        prepare,
    )
    from dflash_mac.session import Session
    from dflash_mac.sizing.files import load_tuning

    prepared = prepare(
        opts.model,
        opts.draft,
        block_size=opts.block_size,
        draft_bits=opts.draft_bits,
        draft_vocab=opts.draft_vocab,
        reasoning=opts.reasoning,
        chat_template=opts.chat_template,
        loader=ranked_loader(),  # under `dflash-mac launch`: rank 0 of a sharded target
    )
    pair, warnings = prepared.pair, list(prepared.warnings)
    if needs_calibration(prepared):
        done, total, what = 0, calibration_steps(), calibration_title(prepared) + "…"

        def step() -> None:
            nonlocal done
            done += 1
            if status:
                status(what, done / total)

        saved, said = calibrate(prepared, step)
        if not saved:  # a toast, and the chat goes on
            warnings.append(said)
    info = EngineInfo(
        model=str(opts.model or load_registry().default_pair.name),
        kind=pair.kind,
        block_size=prepared.block.size,
        kernels=kernels_name(),
        reasoning=has_thinking_switch(pair.tokenizer),
        auto=prepared.block.auto,
    )
    session = Session(pair, tuning=load_tuning(pair), max_kv_size=opts.max_kv_size)
    return Backend(
        session, info, pair.tokenizer, warnings, context=pair.context_length, block=prepared.block
    )
