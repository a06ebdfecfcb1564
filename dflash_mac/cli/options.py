"""Options every model-running command shares (generate, chat, serve, bench): one wording,
one set of short flags."""

from __future__ import annotations

from pathlib import Path

import typer

MODEL_HELP = (
    "Target model: local folder, Hugging Face id or pair name from `dflash-mac models` "
    "(default: the registry's default pair, smollm2-135m, or $DFLASH_MAC_PAIR)."
)
DRAFT_HELP = (
    "DFlash drafter: local folder, Hugging Face id, or auto (default: the registry's drafter "
    "for --model; see `dflash-mac models`)."
)
BLOCK_HELP = (
    "Block size (draft tokens + 1 per cycle), or auto (the default): each cycle's size is "
    "chosen from measured costs and acceptance, 1 (plain decoding) when drafting does not pay, "
    "up to the drafter's block (the pair's quantized block size, at most 5, when quantized). "
    "A number means exactly it."
)

MODEL = typer.Option(None, "--model", "-m", help=MODEL_HELP)
DRAFT = typer.Option(None, "--draft", "-d", help=DRAFT_HELP)
BLOCK_SIZE = typer.Option(None, "--block-size", "-b", help=BLOCK_HELP)
DRAFT_BITS = typer.Option(None, "--draft-bits", help="Quantize the drafter to 4 or 8 bits.")


def check_draft_vocab(value: int | None) -> int | None:
    from dflash_mac.settings import check_draft_vocab as check

    return check(value)


DRAFT_VOCAB = typer.Option(
    None,
    "--draft-vocab",
    callback=check_draft_vocab,
    help="Draft over the K token ids the target's answers use most (a K-row drafter head; "
    "output unchanged). A drafter trained with one keeps its first K.",
)
COPY = typer.Option(
    None,
    "--copy/--no-copy",
    help="Copy drafting: where the last tokens repeat earlier text, draft what followed there "
    "(no drafter pass; edits and refactors repeat a lot). On by default, except at "
    "--block-size 1, which is plain decoding; --copy there copies without the drafter.",
    show_default=False,
)


def parse_switch(value: str | None) -> bool | None:
    """An `on|off` option (None: the default)."""
    if value is None:
        return None
    if value not in ("on", "off"):
        raise typer.BadParameter("give on or off.")
    return value == "on"


SUFFIX = typer.Option(
    None,
    "--suffix",
    metavar="on|off",
    callback=parse_switch,
    help="Suffix drafting: draft what earlier answers said after the same last tokens (agents "
    "repeat tool calls, files and plans). On wherever copies are; kept per pair by a server "
    "or chat, and by serve across restarts with its prompt-cache disk tier.",
    show_default=False,
)


def parse_tree_budget(value: str | None) -> int | None:
    """`--tree-budget`: "auto" (None: `auto` weighs trees), "off" or 0 (chains only), or N."""
    if value is None or value == "auto":
        return None
    if value == "off":
        return 0
    from dflash_mac.settings import MAX_TREE_BUDGET  # here: settings imports MLX

    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_TREE_BUDGET:
        raise typer.BadParameter(f"give auto, off or a node count 0..{MAX_TREE_BUDGET}.")
    return n


TREE_BUDGET = typer.Option(
    "auto",
    "--tree-budget",
    callback=parse_tree_budget,
    help="Tree drafting: verify a tree of the drafter's likeliest continuations in one pass. "
    "auto: with --block-size auto, trees of 4, 8 or 16 nodes run where they are expected to "
    "beat the chain; off: chains only; N: every drafting cycle is a tree of N nodes.",
)


def read_chat_template(path: str | None) -> str | None:
    """`--chat-template FILE`: the file's text, read while the options are parsed (before any
    slow work); one sentence when it cannot be used."""
    if path is None:
        return None
    from dflash_mac.errors import PromptError

    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptError(f"--chat-template {path} does not exist; pass a Jinja template file.")
    except IsADirectoryError:
        raise PromptError(f"--chat-template {path} is a folder; pass a Jinja template file.")
    except UnicodeDecodeError:
        raise PromptError(f"--chat-template {path} is not UTF-8 text; pass a Jinja template file.")
    except OSError as e:
        raise PromptError(f"--chat-template {path} cannot be read ({e.strerror}).")
    if not text.strip():
        raise PromptError(f"--chat-template {path} is empty; pass a Jinja template file.")
    return text


CHAT_TEMPLATE = typer.Option(
    None,
    "--chat-template",
    metavar="FILE",
    help="A Jinja chat template file used instead of the model's own.",
    callback=read_chat_template,
)


def check_max_kv_size(value: int | None) -> int | None:
    """`--max-kv-size N` checked while the options are parsed (before any slow work)."""
    if value is None:
        return None
    from dflash_mac.target.kvwindow import check_max_kv_size as check

    return check(value)


MAX_KV_SIZE = typer.Option(
    None,
    "--max-kv-size",
    metavar="N",
    help="Keep a rotating window of the target's last N positions (as mlx-lm's; the first 4 "
    "are always kept) and bound the drafter's context alike: memory stops growing with the "
    "conversation.",
    callback=check_max_kv_size,
)
