"""`dflash-mac` command line (Typer). Each front end registers its command below."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console

from . import __version__
from .bench import bench_command
from .chat_cmd import chat
from .convert import convert as convert_command
from .doctor import doctor_command
from .generate import REASONING_CHOICES, PromptError
from .loading import LoadError
from .manage import models_command, pull_command
from .models.config import ConfigError
from .rollback import RollbackError
from .serve_cmd import serve as serve_command
from .train.command import train as train_command

USER_ERRORS: tuple[type[Exception], ...] = (
    LoadError,
    PromptError,
    ConfigError,
    RollbackError,
)
err = Console(stderr=True, soft_wrap=True)
app = typer.Typer(
    name="dflash-mac",
    help="Fast local LLM generation with DFlash / DFlash 2 speculative decoding on MLX.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODEL_HELP = (
    "Target model: local folder, Hugging Face id or pair name from `dflash-mac models` "
    "(default: the bundled pair)."
)
DRAFT_HELP = (
    "DFlash drafter: local folder, Hugging Face id, or auto (default: the registry's drafter "
    "for --model; see `dflash-mac models`)."
)
BLOCK_HELP = (
    "Block size (draft tokens + 1 per cycle). Default: the drafter's block size, or "
    "min(5, drafter block) when the target or drafter is quantized (quantized matmuls lose "
    "efficiency at wide verify widths)."
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mac {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Fast local LLM generation with DFlash / DFlash 2 speculative decoding on MLX."""


def read_prompt(prompt: str) -> str:
    if prompt == "-":
        return sys.stdin.read()
    return prompt


def parse_template_args(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptError(f"--chat-template-args is not valid JSON ({e.msg}).")
    if not isinstance(value, dict):
        raise PromptError("--chat-template-args must be a JSON object.")
    return value


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt, or - to read it from stdin."),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    draft: str | None = typer.Option(None, "--draft", "-d", help=DRAFT_HELP),
    block_size: int | None = typer.Option(None, "--block-size", "-b", help=BLOCK_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Tokens to generate at most."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (sampling)."),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    reasoning: str | None = typer.Option(
        None, "--reasoning", help=f"Thinking mode: {', '.join(REASONING_CHOICES)}."
    ),
    chat_template_args: str | None = typer.Option(
        None, "--chat-template-args", help="Extra chat-template arguments as a JSON object."
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as raw text."
    ),
    draft_bits: int | None = typer.Option(
        None, "--draft-bits", help="Quantize the drafter to 4 or 8 bits (group 64)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print statistics after the text."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate text for PROMPT with DFlash speculative decoding."""
    from .frontends import load_pair, print_stats, stream_to_terminal, warn_line
    from .generate import fit_max_tokens, prompt_ids

    text = read_prompt(prompt)
    template_args = parse_template_args(chat_template_args)
    pair = load_pair(model, draft, block_size=block_size, draft_bits=draft_bits,
                     reasoning=reasoning)
    ids = prompt_ids(pair.tokenizer, text, system=system, reasoning=reasoning,
                     chat_template_args=template_args, ignore_chat_template=ignore_chat_template)
    budget = fit_max_tokens(pair.context_length, len(ids), max_tokens)
    if budget.capped:
        warn_line(f"[yellow]warning:[/] the prompt has {len(ids)} tokens and the model's "
                  f"context is {pair.context_length}: --max-tokens capped to {budget.max_tokens}.")
    result = stream_to_terminal(
        pair,
        ids,
        echo=not as_json,
        max_tokens=budget.max_tokens,
        block_size=block_size,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=stop,
    )
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
    elif verbose:
        print_stats(pair, result, err)


app.command("bench")(bench_command)


app.command("chat")(chat)


app.command("convert")(convert_command)


app.command("train")(train_command)


app.command("models")(models_command)
app.command("pull")(pull_command)
app.command("doctor")(doctor_command)


app.command("serve")(serve_command)


def main() -> None:
    """Console-script entry point: clean one-sentence errors, never a traceback."""
    from .platform import maybe_reexec_with_openblas

    maybe_reexec_with_openblas(sys.argv[1:])
    try:
        app()
    except USER_ERRORS as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
