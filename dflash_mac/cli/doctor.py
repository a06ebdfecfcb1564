"""`dflash-mac doctor`: is this machine ready for DFlash? Each check passes, warns or fails with
one line of advice; the command exits non-zero when any check fails."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer
from rich.console import Console

from dflash_mac.loading.registry import load_registry

from .checks import (
    FAIL,
    PASS,
    WARN,
    Check,
    check_blas,
    check_hf_cache,
    check_kernels,
    check_memory,
    check_metal,
    check_mlx,
    check_platform,
    memory_need_gb,
    memory_per_rank_gb,
)
from .machine import Facts, gather_facts
from .selftest import check_selftest

# memory_need_gb / memory_per_rank_gb: still imported from here by tests/test_distributed.py
__all__ = ["doctor_command", "memory_need_gb", "memory_per_rank_gb", "print_checks", "run_checks"]
out = Console()


def run_checks(
    pair: str | None = None,
    context: int = 4096,
    selftest: bool = True,
    facts: Facts | None = None,
    hosts: int = 1,
) -> list[Check]:
    """All checks, in display order."""
    reg = load_registry()
    entry = reg.get(pair) if pair else reg.default_pair
    if entry is None:
        entry = reg.find_target(pair)
    f = facts or gather_facts()
    checks = [check_platform(f), check_mlx(f), check_metal(f), check_kernels(f), check_blas(f)]
    if entry is None:
        checks.append(
            Check("memory", FAIL, f"unknown pair '{pair}'", "pick a name from `dflash-mac models`.")
        )
    else:
        checks.append(check_memory(f, entry, context, hosts))
    checks.append(check_hf_cache(f, entry))
    if selftest:
        checks.append(check_selftest())
    return checks


MARK = {PASS: "[green]✓[/]", WARN: "[yellow]![/]", FAIL: "[red]✗[/]"}


def print_checks(checks: list[Check], console: Console = out) -> None:
    """One line per check (advice under each warning and failure), then the counts."""
    for c in checks:
        console.print(f"{MARK[c.status]} [bold]{c.name:<9}[/] {c.message}", highlight=False)
        if c.advice and c.status != PASS:
            console.print(f"  [dim]→ {c.advice}[/]", highlight=False)
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    console.print(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed")


def doctor_command(
    pair: str | None = typer.Option(
        None, "--pair", help="Pair to size memory for (default: the registry default)."
    ),
    context: int = typer.Option(
        4096, "--context", min=1, help="Context length (tokens) for the KV estimate."
    ),
    selftest: bool = typer.Option(
        True, "--selftest/--no-selftest", help="Run the lossless decode self-test."
    ),
    hosts: int = typer.Option(
        1, "--hosts", min=1, help="Macs the target is sharded over (memory per rank)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
) -> None:
    """Check this machine: platform, MLX, Metal, kernels, BLAS, memory, cache, self-test."""
    facts = gather_facts()
    checks = run_checks(pair, context, selftest, facts, hosts)
    if as_json:
        ok = all(c.status != FAIL for c in checks)
        report = {"ok": ok, "checks": [asdict(c) for c in checks], "facts": asdict(facts)}
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        print_checks(checks)
    if any(c.status == FAIL for c in checks):
        raise typer.Exit(1)
