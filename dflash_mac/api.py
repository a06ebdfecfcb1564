"""Python API: prompt building, `stream_generate` and `generate` (mirroring mlx-lm's names)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .engine.constraints import Grammar, json_grammar
from .engine.decode import DecodeState, GenerationConfig, GenerationEvent, speculative_stream
from .engine.stats import DecodeStats
from .engine.think import REASONING_CHOICES
from .engine.verify import SamplingParams, TokenLogprob
from .errors import PromptError  # noqa: F401  (re-exported)
from .pair import Pair
from .settings import check_request
from .sizing.choice import BlockChoice, block_size_for
from .sizing.files import load_tuning
from .sizing.tuning import AutoTuning


def reasoning_args(tokenizer: Any, reasoning: str | None) -> dict:
    """Map --reasoning onto what the chat template understands."""
    if reasoning is None:
        return {}
    if reasoning not in REASONING_CHOICES:
        raise PromptError(f"--reasoning must be one of {', '.join(REASONING_CHOICES)}.")
    template = getattr(tokenizer, "chat_template", None) or ""
    if reasoning in ("on", "off"):
        if "enable_thinking" in template:
            return {"enable_thinking": reasoning == "on"}
        if reasoning == "on" and "reasoning_effort" in template:
            return {"reasoning_effort": "medium"}
        raise PromptError(
            f"this model's chat template has no thinking switch; "
            f"--reasoning {reasoning} is not supported."
        )
    for key in ("reasoning_effort", "reasoning_strength"):
        if key in template:
            return {
                key: "high"
                if reasoning == "xhigh" and key == "reasoning_effort" and "xhigh" not in template
                else reasoning
            }
    raise PromptError(
        f"this model's chat template has no reasoning levels; "
        f"--reasoning {reasoning} is not supported."
    )


def prompt_ids(
    tokenizer: Any,
    prompt: str | list[dict],
    *,
    system: str | None = None,
    ignore_chat_template: bool = False,
    reasoning: str | None = None,
    chat_template_args: dict | None = None,
) -> list[int]:
    """Token ids for a prompt string or a list of chat messages."""
    if ignore_chat_template or not getattr(tokenizer, "chat_template", None):
        if not isinstance(prompt, str):
            raise PromptError("chat messages need a model with a chat template.")
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise PromptError("the prompt is empty; give at least one token of text.")
        return ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages = [{"role": "system", "content": system}] + messages
    kwargs = {**reasoning_args(tokenizer, reasoning), **(chat_template_args or {})}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))


def make_config(
    max_tokens: int = 256,
    block_size: int | str | BlockChoice | None = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    use_eos: bool = True,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    json_schema: dict | Grammar | None = None,
    copy: bool | None = None,
    tree: int | None = None,
    suffix: bool | None = None,
) -> GenerationConfig:
    """Validated per-request settings (PromptError with one sentence on bad input).

    `logprobs`: each committed token's log-probability and the top `logprobs` (0..20) on the
    events; `json_schema`: the answer is JSON valid against this schema (a dict, or a grammar
    compiled once with `constraints.json_grammar`); `copy`: copy drafting where the last tokens
    repeat earlier text (`drafting/copies.py`; None: on unless `block_size` is 1, plain decoding;
    True at 1: copies and plain steps only); `tree`: tree drafting (`drafting/tree.py`): None
    lets `auto` weigh trees, 0 drafts chains only, N drafts trees of N nodes; `suffix`: drafts
    from the session's earlier answers (`drafting/suffix.py`; None: wherever copies run)."""
    chosen = isinstance(block_size, BlockChoice)  # already resolved against the pair
    sp, pen = check_request(
        max_tokens, None if chosen else block_size, temp, top_p, top_k, min_p, seed,
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias, logprobs, tree,
    )  # fmt: skip
    try:
        compiled = json_schema is None or hasattr(json_schema, "start")
        grammar = json_schema if compiled else json_grammar(json_schema)
    except ValueError as e:
        raise PromptError(str(e))
    cfg = GenerationConfig(max_tokens, None, sp, seed, list(stop or []), use_eos)
    if chosen:
        cfg.block = block_size
    cfg.penalties, cfg.logprobs, cfg.grammar, cfg.copy = pen, logprobs, grammar, copy
    cfg.tree, cfg.suffix = tree, suffix
    return cfg


@dataclass(frozen=True)
class TokenBudget:
    """How many tokens an answer may have: the request's max_tokens, capped to what is left
    of the context after the prompt."""

    max_tokens: int
    capped: bool  # smaller than requested


DEFAULT_SAMPLING_TEMPERATURE = 0.7  # what people chat with when the model card says nothing


def recommended_sampling(pair: Pair) -> SamplingParams:
    """The sampling a pair is meant to be used with: the target's `generation_config.json`
    temperature / top-p / top-k when it samples (`do_sample` not false), else T = 0.7."""
    gen = getattr(pair, "generation_config", None) or {}
    temp = gen.get("temperature") if gen.get("do_sample", True) is not False else None
    if not isinstance(temp, (int, float)) or temp <= 0:
        return SamplingParams(temperature=DEFAULT_SAMPLING_TEMPERATURE)
    top_p, top_k = gen.get("top_p", 1.0), gen.get("top_k", 0)
    return SamplingParams(
        temperature=float(temp),
        top_p=float(top_p) if isinstance(top_p, (int, float)) and 0 < top_p <= 1 else 1.0,
        top_k=int(top_k) if isinstance(top_k, int) and top_k > 0 else 0,
    )


def fit_max_tokens(context_length: int, prompt_tokens: int, max_tokens: int) -> TokenBudget:
    """The one context rule of every front end (generate, serve, chat): a prompt must leave
    room for at least one token (else PromptError, the sentence users see); max_tokens is
    capped to the room that is left. Prints nothing: front ends decide how to tell the user."""
    if prompt_tokens >= context_length:
        raise PromptError(
            f"the prompt has {prompt_tokens} tokens but the model's context is "
            f"{context_length} tokens."
        )
    room = context_length - prompt_tokens
    return TokenBudget(min(max_tokens, room), max_tokens > room)


def check_context(pair: Pair, ids: list[int], max_tokens: int) -> int:
    """`max_tokens` capped to the pair's context (see `fit_max_tokens`)."""
    return fit_max_tokens(pair.context_length, len(ids), max_tokens).max_tokens


def stream_generate(
    pair: Pair,
    prompt: str | list[dict] | list[int],
    *,
    state: DecodeState | None = None,
    tuning: AutoTuning | None = None,
    max_kv_size: int | None = None,
    **kwargs: Any,
) -> Iterator[GenerationEvent]:
    """Stream DFlash generation events for a prompt (text, messages or token ids).

    `block_size`: an integer, "auto" / None, or a `BlockChoice` a front end resolved once.
    `tuning`: what `--block-size auto` learnt so far, continued (a session's); without it `auto`
    starts from what is saved for the pair on this machine (`sizing.files.load_tuning`).
    `max_kv_size`: a rotating window of that many target positions, as mlx-lm's (a `state`
    brings its own)."""
    template_keys = ("system", "ignore_chat_template", "reasoning", "chat_template_args")
    tkw = {k: kwargs.pop(k) for k in template_keys if k in kwargs}
    should_stop = kwargs.pop("should_stop", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = list(prompt)
    else:
        ids = prompt_ids(pair.tokenizer, prompt, **tkw)
    cfg = make_config(**kwargs)
    if cfg.block is None:
        cfg.block = block_size_for(pair, kwargs.get("block_size"))
    if cfg.penalties is not None:
        try:
            cfg.penalties.validate(pair.drafter.config.vocab_size)
        except ValueError as e:
            raise PromptError(str(e))
    cfg.max_tokens = check_context(pair, ids, cfg.max_tokens)
    if tuning is None and cfg.block.auto:
        tuning = load_tuning(pair)
    if state is None and max_kv_size is not None:
        state = DecodeState(pair, max_kv_size)
    yield from speculative_stream(
        pair, ids, cfg, state=state, should_stop=should_stop, tuning=tuning
    )


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: DecodeStats
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked

    def as_dict(self) -> dict:
        s = self.stats
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            **s.as_dict(),
        }


def generate(pair: Pair, prompt: str | list[dict] | list[int], **kwargs: Any) -> GenerationResult:
    """Generate a whole completion; see `stream_generate` for the options."""
    text, tokens, lps, last = [], [], [], None
    for ev in stream_generate(pair, prompt, **kwargs):
        text.append(ev.text)
        tokens += ev.tokens
        lps += ev.logprobs or []
        last = ev
    n = last.stats.generation_tokens
    return GenerationResult(
        "".join(text),
        tokens[:n],
        last.finish_reason,
        last.stats,
        last.stats.prompt_tokens,
        lps[:n] if kwargs.get("logprobs") is not None else None,
    )
