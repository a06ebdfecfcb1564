"""`dflash-mac` command line (Typer). Each front end registers its command below."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from dflash_mac import __version__
from dflash_mac.engine.think import REASONING_CHOICES
from dflash_mac.errors import INTERRUPTED, is_user_error

from . import options

# Commands imported only when they run (as mlx-lm's CLI does), so `--help`, `models` and
# `pull` never import MLX. name -> (module, function, the docstring's first line for the list).
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": (
        "dflash_mac.bench.command",
        "bench_command",
        "Benchmark DFlash against plain decoding of the same target, in one process.",
    ),
    "chat": (
        "dflash_mac.app.command",
        "chat",
        "Chat in the terminal: streamed answers, a live acceptance histogram, saved chats.",
    ),
    "convert": (
        "dflash_mac.cli.convert",
        "convert",
        "Quantize a target model or a DFlash drafter to 4 or 8 bits (group 64 by default).",
    ),
    "train": (
        "dflash_mac.train.command",
        "train",
        "Train a DFlash drafter for TARGET on the target's own answers to --data prompts.",
    ),
    "models": (
        "dflash_mac.cli.models",
        "models_command",
        "List the known target/drafter pairs and what is already downloaded.",
    ),
    "pull": (
        "dflash_mac.cli.models",
        "pull_command",
        "Download a target and its DFlash drafter (resumable; progress bars).",
    ),
    "doctor": (
        "dflash_mac.cli.doctor",
        "doctor_command",
        "Check this machine: platform, MLX, Metal, kernels, BLAS, memory, cache, self-test.",
    ),
    "launch": (
        "dflash_mac.cli.launch",
        "launch",
        "Run generate, serve, chat or bench over several ranks (MLX distributed, sharded target).",
    ),
    "serve": (
        "dflash_mac.serve.command",
        "serve",
        "Serve the pair as an OpenAI-compatible API (for Continue, Cline, Aider, Zed, ...).",
    ),
    "cache": (
        "dflash_mac.cli.cache",
        "cache_command",
        "List or clear the prompt cache on disk (kept by `serve` across restarts).",
    ),
    "ps": (
        "dflash_mac.serve.servers",
        "ps_command",
        "List the running servers: port, PID, URL, model and uptime.",
    ),
    "stop": (
        "dflash_mac.serve.servers",
        "stop_command",
        "Stop the server on PORT, or every running server with --all.",
    ),
}


def plain_flags(params: list[Any]) -> list[Any]:
    """Show on/off flags without a `<bool>` type placeholder in help."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    """A command whose help shows flags as flags (no `<bool>`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_flags(super().get_params(ctx))


class LazyGroup(TyperGroup):
    """A Typer group that imports a command's module only when that command runs (or shows
    its own help); the command list in `--help` uses the short help lines above."""

    _listing = False

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_flags(super().get_params(ctx))

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *LAZY_COMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, attr, short = LAZY_COMMANDS[cmd_name]
        if self._listing:
            return TyperCommand(cmd_name, help=short)
        sub = typer.Typer(add_completion=False)
        sub.command(cmd_name, cls=Command)(getattr(importlib.import_module(module), attr))
        return typer.main.get_command(sub)

    def invoke(self, ctx: Any) -> object:
        if needs_blas(sys.argv[1:]):  # a command that runs MLX: its native module is loaded
            # while Ctrl-C still exits at once (entry.py): a KeyboardInterrupt raised inside
            # its init ("Critical nanobind error") aborts the process with a traceback
            importlib.import_module("mlx.core")
        # From here Ctrl-C raises KeyboardInterrupt (commands may clean up), reported below.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Typer would exit 130 without a word
            err.print(INTERRUPTED, highlight=False)
            raise typer.Exit(130)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


err = Console(stderr=True, soft_wrap=True)
app = typer.Typer(
    name="dflash-mac",
    cls=LazyGroup,
    help="Fast local LLM generation with DFlash / DFlash 2 speculative decoding on MLX.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    """PROMPT, or stdin for -; an empty one is refused (a model answers it with filler)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        where = "stdin was empty" if prompt == "-" else "the prompt is empty"
        raise prompt_error(f"{where}; give the text to answer, or - to read it from stdin.")
    return text


def prompt_error(message: str) -> Exception:
    from dflash_mac.errors import PromptError

    return PromptError(message)


def check_reasoning(value: str | None) -> str | None:
    """Refuse a bad --reasoning before the slow load (and before any thinking warning)."""
    if value is not None and value not in REASONING_CHOICES:
        raise prompt_error(f"--reasoning must be one of {', '.join(REASONING_CHOICES)}.")
    return value


def json_object(text: str | None, flag: str, example: str = "") -> dict:
    """A flag's JSON object value ({} when absent); one sentence when it is not one."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise prompt_error(f"{flag} is not valid JSON ({e.msg}).")
    if not isinstance(value, dict):
        raise prompt_error(f"{flag} must be a JSON object{example}.")
    return value


def parse_template_args(text: str | None) -> dict:
    return json_object(text, "--chat-template-args")


def parse_logit_bias(text: str | None) -> dict[int, float]:
    """`--logit-bias '{"123": -100}'` as {token id: bias}."""
    value = json_object(text, "--logit-bias", ' like {"123": -100}')
    try:
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise prompt_error("--logit-bias maps token ids (integers) to numbers.")


@app.command(cls=Command)
def generate(
    prompt: str = typer.Argument(..., help="The prompt, or - to read it from stdin."),
    model: str | None = options.MODEL,
    draft: str | None = options.DRAFT,
    block_size: str | None = options.BLOCK_SIZE,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Tokens to generate at most."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (sampling)."),
    presence_penalty: float = typer.Option(
        0.0, "--presence-penalty", help="Subtract this from tokens seen in the last 20."
    ),
    frequency_penalty: float = typer.Option(
        0.0, "--frequency-penalty", help="Subtract this per occurrence in the last 20 tokens."
    ),
    repetition_penalty: float | None = typer.Option(
        None, "--repetition-penalty", help="Scale down tokens seen in the last 20 (e.g. 1.1)."
    ),
    logit_bias: str | None = typer.Option(
        None, "--logit-bias", help='Add to token logits, JSON like {"123": -100}.'
    ),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    reasoning: str | None = typer.Option(
        None,
        "--reasoning",
        help=f"Thinking mode: {', '.join(REASONING_CHOICES)}.",
        callback=lambda value: check_reasoning(value),
    ),
    chat_template_args: str | None = typer.Option(
        None, "--chat-template-args", help="Extra chat-template arguments as a JSON object."
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as raw text."
    ),
    chat_template: str | None = options.CHAT_TEMPLATE,  # the file's text
    max_kv_size: int | None = options.MAX_KV_SIZE,
    draft_bits: int | None = options.DRAFT_BITS,
    draft_vocab: int | None = options.DRAFT_VOCAB,
    copy: bool | None = options.COPY,
    suffix: str | None = options.SUFFIX,  # parsed: bool | None
    tree_budget: str = options.TREE_BUDGET,  # parsed: int | None
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print statistics after the text."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate text for PROMPT with DFlash speculative decoding."""
    text = read_prompt(prompt)
    template = dict(
        system=system,
        reasoning=reasoning,
        chat_template_args=parse_template_args(chat_template_args),
        ignore_chat_template=ignore_chat_template,
    )
    settings = dict(
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=parse_logit_bias(logit_bias),
        copy=copy,
        suffix=suffix,
        tree=tree_budget,
    )
    check_settings(max_tokens, block_size, settings)  # before the slow imports and load
    check_pair_names(model, draft)
    from .terminal import calibrate_auto, load_pair

    prepared = load_pair(
        model,
        draft,
        block_size=block_size,
        draft_bits=draft_bits,
        draft_vocab=draft_vocab,
        reasoning=reasoning,
        chat_template=chat_template,
    )
    ids, budget = fit_prompt(prepared.pair, text, template, max_tokens)
    tuning = calibrate_auto(prepared)
    result = run_generation(
        prepared, ids, tuning, budget, stop, settings, echo=not as_json, max_kv_size=max_kv_size
    )
    report_generation(prepared.pair, result, as_json, verbose)


def check_settings(max_tokens: int, block_size: str | None, settings: dict) -> None:
    """Bad sampling, penalty, seed or block-size values get their one sentence now."""
    from dflash_mac.settings import check_request

    checked = {k: v for k, v in settings.items() if k not in ("copy", "suffix")}  # flags
    check_request(max_tokens=max_tokens, block_size=block_size, **checked)


def check_pair_names(model: str | None, draft: str | None) -> None:
    """A --model / --draft the registry cannot resolve (a path that does not exist, a target
    with no known drafter) gets its sentence now, before the slow imports."""
    from dflash_mac.loading.registry import resolve_pair

    resolve_pair(model, draft)


def fit_prompt(pair, text: str, template: dict, max_tokens: int) -> tuple[list[int], int]:
    """The prompt's ids and the answer's budget (capped to the context, with a warning)."""
    from dflash_mac.api import fit_max_tokens, prompt_ids

    from .terminal import warn_line

    ids = prompt_ids(pair.tokenizer, text, **template)
    budget = fit_max_tokens(pair.context_length, len(ids), max_tokens)
    if budget.capped:
        warn_line(
            f"the prompt has {len(ids)} tokens and the model's context is "
            f"{pair.context_length}: --max-tokens capped to {budget.max_tokens}."
        )
    return ids, budget.max_tokens


def run_generation(
    prepared,
    ids,
    tuning,
    max_tokens: int,
    stop,
    settings: dict,
    echo: bool,
    max_kv_size: int | None = None,
):
    """Stream the answer (to stdout unless `echo` is off), then remember what `auto` saw."""
    from dflash_mac.sizing.files import save_acceptance

    from .terminal import stream_to_terminal

    result = stream_to_terminal(
        prepared,
        ids,
        echo=echo,
        tuning=tuning,
        max_tokens=max_tokens,
        stop=stop,
        max_kv_size=max_kv_size,
        **settings,
    )
    save_acceptance(prepared.pair, tuning)  # the next process starts from what this one saw
    return result


def report_generation(pair, result, as_json: bool, verbose: bool) -> None:
    """The JSON object, the -v statistics, or the one summary line."""
    from .terminal import print_stats, summary_line

    if as_json:
        typer.echo(
            json.dumps({"model": pair.model_id, "drafter": pair.draft_id, **result.as_dict()})
        )
    elif verbose:
        print_stats(pair, result, err)
    else:
        err.print(summary_line(result), highlight=False)


NO_MATH_COMMANDS = ("models", "pull", "launch", "ps", "stop", "cache")


def needs_blas(argv: list[str]) -> bool:
    """Whether this command line runs matrix math (worth re-executing with OpenBLAS): not for
    help, --version, or the commands that only read the registry and the cache."""
    if not argv or argv[0] in NO_MATH_COMMANDS:
        return False
    return not {"-h", "--help", "--version"} & set(argv)


def main() -> None:
    """Console-script entry point: clean one-sentence errors, never a traceback."""
    # transformers' tokenizer warns about long inputs itself; our context rule says it better
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if needs_blas(sys.argv[1:]):
        from dflash_mac.host import maybe_reexec_with_openblas, slow_blas_note

        # Ctrl-C stays pending across the exec until the new process's entry.main handles it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        maybe_reexec_with_openblas(sys.argv[1:])
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if note := slow_blas_note():  # before the slow start it explains
            err.print(f"[yellow]note:[/] {note}", highlight=False)
    status = 1
    try:
        app()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except KeyboardInterrupt:
        err.print(INTERRUPTED, highlight=False)
        sys.exit(130)
    except Exception as e:
        lost = lost_peer(e)
        if lost is None and not is_user_error(e):
            raise
        err.print(f"[bold red]error:[/] {lost or e}", highlight=False)
        if lost:
            os._exit(1)  # the job is gone: no more collectives, no waiting at exit
        sys.exit(1)
    finally:
        release_workers(status)


def lost_peer(e: BaseException) -> str | None:
    """The one sentence for a distributed job that lost a rank (None for other errors)."""
    if "MLX_RANK" not in os.environ:
        return None
    from dflash_mac.distributed.group import lost_peer_message

    return lost_peer_message(e)


def release_workers(status: int) -> None:
    """Rank 0 of a distributed job: tell the workers to exit with our status."""
    if "MLX_RANK" in os.environ and "dflash_mac.distributed.leader" in sys.modules:
        from dflash_mac.distributed.leader import stop_all

        try:
            stop_all(status)
        except RuntimeError:  # the workers are gone already
            pass


if __name__ == "__main__":
    main()
