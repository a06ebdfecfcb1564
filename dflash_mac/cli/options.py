"""Options every model-running command shares (generate, chat, serve, bench): one wording,
one set of short flags."""

from __future__ import annotations

import typer

MODEL_HELP = (
    "Target model: local folder, Hugging Face id or pair name from `dflash-mac models` "
    "(default: the bundled pair)."
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
