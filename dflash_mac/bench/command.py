"""`dflash-mac bench`: the command — prompts, the run with its live view, the report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from dflash_mac.cli import options
from dflash_mac.pair import Pair

from .run import (
    AUTO_BS,
    BenchConfig,
    BenchError,
    BenchPrompt,
    check_format,
    parse_block_sizes,
    read_prompts,
    run_bench,
    suite_prompts,
)


def display_id(name: str) -> str:
    """Model id for reports: bundled folders by their short name, others as given."""
    from dflash_mac.loading import PACKAGE_MODELS

    try:
        rel = Path(name).resolve().relative_to(PACKAGE_MODELS / "bundled")
        return f"bundled/{rel}"
    except ValueError:
        return str(name)


def _quant(q: dict | None) -> str:
    return f"{q.get('bits', 4)}-bit g{q.get('group_size', 64)}" if q else "none"


def header(pair: Pair) -> dict:
    """Machine, software and model facts for the report."""
    import datetime

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_mac import __version__
    from dflash_mac.distributed.leader import facts as distributed_facts
    from dflash_mac.platform import cpu_name, machine_summary

    def nbytes(model: Any) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    floats = [
        v.dtype
        for _, v in tree_flatten(pair.target.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    ]
    return {
        **machine_summary(),
        "cpu": cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dflash_mac": __version__,
        "target": display_id(pair.model_id),
        "draft": display_id(pair.draft_id),
        "drafter_kind": pair.kind,
        "target_quantization": _quant(pair.target_config.get("quantization")),
        "draft_quantization": _quant(pair.drafter.config.quantization),
        "dtype": str(floats[0]).replace("mlx.core.", "") if floats else "?",
        "target_weight_bytes": nbytes(pair.target),
        "drafter_weight_bytes": nbytes(pair.drafter),
        **distributed_facts(pair.target),  # ranks, parallel, collectives (a sharded target)
    }


def load_average() -> float | None:
    """1-minute load average (None where the OS has none)."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def busy_warning(warn: Callable[[str], Any]) -> float | None:
    """Warn when other processes already keep the CPUs busy; return the load average."""
    import os

    load, cpus = load_average(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cpus:
        warn(
            f"the machine is busy (load average {load:.1f} on {cpus} CPUs); timings will be "
            "slower and noisier than on an idle machine."
        )
    return load


def limit_per_suite(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first `limit` prompts of each suite (all when None)."""
    if not limit:
        return prompts
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p.suite] = seen.get(p.suite, 0) + 1
        if seen[p.suite] <= limit:
            out.append(p)
    return out


def cost_curve_command(
    model: str | None, draft: str | None, draft_bits, err, shape=None, shape_dtype="bf16"
) -> None:
    """`bench --cost-curve`: measure, print, save where `auto` finds it."""
    from dflash_mac.cli.terminal import load_pair
    from dflash_mac.policy import cost_curve_path

    from .costcurve import measure, render, save
    from .shapes import random_pair

    if shape:
        with err.status(f"Building a random {shape} ({shape_dtype})…", spinner="dots"):
            pair = random_pair(shape, shape_dtype)
    else:
        pair = load_pair(model, draft, draft_bits=draft_bits)
    with err.status("Timing cycles at block size 1..16…", spinner="dots"):
        curve = measure(pair)
    curve |= {"header": header(pair) | {"load_avg": [load_average()]}}
    typer.echo(render(curve), nl=False)
    path = save(curve, cost_curve_path(pair))
    err.print(f"saved to {path} (the prior of --block-size auto for this pair)", highlight=False)


def bench_command(
    model: str | None = options.MODEL,
    draft: str | None = options.DRAFT,
    suite: str = typer.Option(
        "code", "--suite", "-s", help="Prompt suite: code, math, chat or all."
    ),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help='JSONL prompts ({"id", "messages"|"prompt"}) instead of a suite.'
    ),
    limit: int | None = typer.Option(
        None, "--limit", help="Use the first K prompts of each suite."
    ),
    trials: int = typer.Option(2, "--trials", "-t", help="Measured passes over the prompts."),
    max_tokens: int = typer.Option(
        128, "--max-tokens", "-n", help="Tokens per generation at most."
    ),
    block_size: str | None = typer.Option(
        None,
        "--block-size",
        "-b",
        help="Block size, auto, or a comma-separated sweep such as auto,2,5,8 "
        "(default: auto and the pair's default size side by side).",
    ),
    temp: float = typer.Option(
        0.0, "--temp", help="Sampling temperature (0 = greedy, lossless-checked)."
    ),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p * max prob."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt shuffle and sampling."),
    draft_bits: int | None = options.DRAFT_BITS,
    reasoning: str | None = typer.Option(
        None,
        "--reasoning",
        help="Thinking mode for chat templates: on, off, low, medium, high, xhigh.",
    ),
    no_eos: bool = typer.Option(
        False, "--no-eos", help="Ignore EOS: always generate --max-tokens tokens."
    ),
    fmt: str = typer.Option(
        "md", "--format", "-f", help="Report format on stdout: md, json, jsonl or csv."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Append the full report as one JSON line to FILE."
    ),
    cooldown: float = typer.Option(
        0.0, "--cooldown", help="Seconds to sleep before each measured run."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Exit non-zero if any greedy DFlash output differs from the baseline.",
    ),
    cost_curve: bool = typer.Option(
        False,
        "--cost-curve",
        help="Measure the cost of a cycle at block size 1..16 against a plain step on this "
        "machine, print it and save it as the prior of --block-size auto.",
    ),
    shape: str | None = typer.Option(
        None,
        "--shape",
        help="With --cost-curve: a model shape with random weights instead of a model "
        "(qwen3-4b, qwen3-8b; no download).",
    ),
    shape_dtype: str = typer.Option("bf16", "--shape-dtype", help="bf16 or 4bit (--shape)."),
    live: bool | None = typer.Option(
        None, "--live/--no-live", help="Live view (default: when stderr is a terminal)."
    ),
) -> None:
    """Benchmark DFlash against plain decoding of the same target, in one process."""
    from rich.console import Console

    from dflash_mac.cli.terminal import block_size_policy, follow_if_worker, load_pair
    from dflash_mac.generate import check_context, make_config, prompt_ids

    follow_if_worker(model, draft)  # a distributed job's other ranks follow rank 0

    from .report import append_jsonl, build_report, render
    from .view import BenchView, print_acceptance

    err = Console(stderr=True)
    if shape and not cost_curve:
        raise BenchError("--shape works with --cost-curve only.")
    if cost_curve:
        return cost_curve_command(model, draft, draft_bits, err, shape, shape_dtype)
    check_format(fmt)
    sizes = parse_block_sizes(block_size)
    if trials < 1:
        raise BenchError(f"--trials must be at least 1 (got {trials}).")
    if cooldown < 0:
        raise BenchError(f"--cooldown must be >= 0 (got {cooldown}).")
    make_config(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    warn = lambda m: err.print(f"[yellow]warning:[/] {m}", highlight=False)  # noqa: E731
    prompts = read_prompts(prompts_file) if prompts_file else suite_prompts(suite, warn)
    prompts = limit_per_suite(prompts, limit)
    pair = load_pair(model, draft, draft_bits=draft_bits, reasoning=reasoning)
    fixed = [s for s in sizes or [] if s != AUTO_BS]
    fixed = [block_size_policy(pair, s, warn=err.print) for s in fixed]
    auto = [AUTO_BS] if sizes is None or AUTO_BS in sizes else []
    sizes = list(dict.fromkeys(auto + (fixed if sizes else [pair.block_size])))
    ids = [prompt_ids(pair.tokenizer, p.prompt, reasoning=reasoning) for p in prompts]
    for i in ids:
        check_context(pair, i, max_tokens)
    cfg = BenchConfig(
        sizes, max_tokens, trials, temp, top_p, top_k, min_p, seed, not no_eos, cooldown
    )
    load_start = busy_warning(warn)
    with BenchView(err, len(prompts) * trials, sizes, live) as view:
        records = run_bench(pair, prompts, ids, cfg, view)
    config = {
        "suite": None if prompts_file else suite,
        "prompts_file": str(prompts_file) if prompts_file else None,
        "limit": limit,
        "trials": trials,
        "max_tokens": max_tokens,
        "block_sizes": sizes,
        "temp": temp,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "use_eos": not no_eos,
        "reasoning": reasoning,
        "draft_bits": draft_bits,
        "cooldown_s": cooldown,
    }
    load = [load_start, load_average()]
    doc = build_report(header(pair) | {"load_avg": load}, config, records, sizes, cfg.greedy)
    print_acceptance(err, doc)
    typer.echo(render(doc, fmt), nl=False)
    if out:
        append_jsonl(out, doc)
    bad, checked = doc["lossless"]["mismatches"], doc["lossless"]["checked"]
    if strict and not cfg.greedy:
        warn("--strict checks greedy runs only; nothing was checked at --temp > 0.")
    if bad:
        first = bad[0]
        msg = (
            f"lossless check failed: {len(bad)} of {checked} DFlash runs differ from the "
            f"baseline (first: {first['id']}, block {first['block_size']}, at token "
            f"{first['first_diff']})."
        )
        if strict:
            err.print(f"[bold red]error:[/] {msg}", highlight=False)
            raise typer.Exit(1)
        warn(msg)
