"""The one set-up path of every front end (generate, chat, serve, bench): load the pair,
quantize the drafter and cut its head to a draft vocabulary if asked, resolve the block size
once, check the thinking mode, and say what the user should know as plain sentences. Front
ends style the sentences (the terminal in yellow, the chat as toasts, the server in its log),
run `calibrate` where `needs_calibration` says so (after their own inputs are checked), then
`sizing.files.load_tuning`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import calibrate as calibration
from .api import reasoning_args
from .draft_vocab import apply_draft_vocab
from .errors import PromptError
from .loading.loader import load, quantize_drafter
from .loading.registry import pair_for, thinking_warning
from .pair import Pair
from .sizing.choice import BlockChoice, block_size_for

Loader = Callable[[str | os.PathLike | None, str | os.PathLike | None], Pair]


@dataclass
class Prepared:
    """A pair ready to decode, its block-size choice and what the user should be told."""

    pair: Pair
    block: BlockChoice
    warnings: list[str] = field(default_factory=list)  # plain sentences, no markup


def prepare(
    model: str | None,
    draft: str | None,
    *,
    block_size: int | str | None = None,
    draft_bits: int | None = None,
    draft_vocab: int | None = None,
    reasoning: str | None = None,
    chat_template: str | None = None,
    loader: Loader = load,
) -> Prepared:
    """Load and prepare a pair (see the module docstring). `loader`: how the pair is loaded
    (a distributed job's front end passes the sharded load). `chat_template`: a Jinja chat
    template that replaces the model's (`--chat-template FILE`'s text). A bad `--reasoning`
    for this model's template raises its PromptError here, before any warning about it."""
    pair = loader(model, draft)
    if chat_template is not None:
        use_chat_template(pair.tokenizer, chat_template)
    if draft_bits is not None:
        quantize_drafter(pair.drafter, draft_bits)
    said = apply_draft_vocab(pair, draft_vocab) if draft_vocab is not None else None
    block = block_size_for(pair, block_size)
    warnings = list(getattr(pair, "warnings", [])) + ([block.warning] if block.warning else [])
    warnings += [said] if said else []
    if reasoning is not None:
        reasoning_args(pair.tokenizer, reasoning)
    if said := thinking_mismatch(pair, reasoning):
        warnings.append(said)
    return Prepared(pair, block, warnings)


def use_chat_template(tokenizer, template: str) -> None:
    """Make `template` the tokenizer's chat template (every prompt, tool and thinking check
    reads it from there); a PromptError when it does not render a one-message chat."""
    if getattr(tokenizer, "_chat_template", None) is not None:
        tokenizer._chat_template = None  # mlx-lm's own renderer for the model would win
    tokenizer.chat_template = template
    tokenizer.has_chat_template = True
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # Jinja syntax or a template that raises: the user's file
        raise PromptError(f"the --chat-template file does not render a chat ({e}).")


def thinking_mismatch(pair: Pair, reasoning: str | None) -> str | None:
    """A sentence when --reasoning (or the template's default) contradicts how the drafter
    was trained (thinking on/off): acceptance collapses then (docs/design.md §8)."""
    try:
        entry = pair_for(pair.model_id, pair.draft_id)
    except Exception:  # an unreadable registry must not stop generation
        return None
    return thinking_warning(entry, reasoning, pair.tokenizer)


def needs_calibration(prepared: Prepared) -> bool:
    """Whether `auto` has no cost curve for this pair on this machine yet (calibrate.py)."""
    return calibration.needed(prepared.pair, prepared.block)


def calibrate(
    prepared: Prepared, progress: calibration.Progress | None = None
) -> tuple[Path | None, str]:
    """Measure and save the quick cost curve (`needs_calibration`): (the file, a short
    sentence), or (None, why it could not be saved: a warning, generation goes on)."""
    saved = calibration.calibrate(prepared.pair, prepared.block.size, progress)
    if isinstance(saved, str):
        return None, saved
    return saved, "measured this machine's costs for --block-size auto (once per pair)"


def calibration_title(prepared: Prepared) -> str:
    return calibration.title(prepared.block)


def calibration_steps() -> int:
    return calibration.steps()
