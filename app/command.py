"""`dflash-mac chat`: the Textual chat app (registered in cli.py)."""

from __future__ import annotations

import typer

from dflash_mac.cli import options
from dflash_mac.engine.think import REASONING_CHOICES
from dflash_mac.errors import PromptError


def chat(
    model: str | None = options.MODEL,
    draft: str | None = options.DRAFT,
    system: str | None = typer.Option(None, "--system", help="System prompt for new chats."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    block_size: str | None = options.BLOCK_SIZE,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Tokens per answer at most."),
    reasoning: str | None = typer.Option(
        None, "--reasoning", help=f"Thinking mode: {', '.join(REASONING_CHOICES)} (ctrl+t toggles)."
    ),
    draft_bits: int | None = options.DRAFT_BITS,
    draft_vocab: int | None = options.DRAFT_VOCAB,
    seed: int | None = typer.Option(None, "--seed", help="Random seed (sampling)."),
    chat_template: str | None = options.CHAT_TEMPLATE,  # the file's text
    max_kv_size: int | None = options.MAX_KV_SIZE,
    resume: bool = typer.Option(False, "--resume", "-r", help="Reopen the most recent chat."),
    suffix: str | None = options.SUFFIX,  # parsed: bool | None
) -> None:
    """Chat in the terminal: streamed answers, a live acceptance histogram, saved chats."""
    from dflash_mac.cli import check_pair_names
    from dflash_mac.settings import check_request

    # bad options fail here, before the slow imports
    check_request(max_tokens, block_size, temp, top_p, top_k, min_p, seed)
    check_pair_names(model, draft)
    if reasoning is not None and reasoning not in REASONING_CHOICES:
        raise PromptError(f"--reasoning must be one of {', '.join(REASONING_CHOICES)}.")
    from .backend import ChatOptions
    from .chat_app import ChatApp

    check_pair(model, draft)
    from dflash_mac.cli.terminal import follow_if_worker

    follow_if_worker(model, draft)  # a distributed job's other ranks: no screen, follow rank 0
    opts = ChatOptions(
        model,
        draft,
        system,
        temp,
        top_p,
        top_k,
        min_p,
        block_size,
        max_tokens,
        reasoning,
        draft_bits,
        seed,
        chat_template,
        max_kv_size,
        draft_vocab,
        suffix,
    )
    app = ChatApp(opts, resume=resume)
    app.run()
    exit_now(app.return_code or 0)


def check_pair(model: str | None, draft: str | None) -> None:
    """Resolve the pair from its configs (no weights) so that a bad --model or --draft is the
    whole sentence and exit 1 on the terminal, before the screen starts."""
    from dflash_mac.loading.loader import PairSpec

    PairSpec.resolve(model, draft)


def exit_now(code: int) -> None:
    """Leave without running interpreter and C++ teardown. The app has already restored the
    terminal, saved the chats and stopped its engine thread; MLX's teardown, with a thread
    that ran compiled code still alive, can abort ("terminate called without an active
    exception", exit 134). See docs/chat.md."""
    import os
    import sys

    from dflash_mac.cli import release_workers

    release_workers(code)  # under `dflash-mac launch`: the other ranks exit with us
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
