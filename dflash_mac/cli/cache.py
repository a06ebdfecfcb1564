"""`dflash-mac cache ls | clear`: the prompt cache's disk tier (what `serve` keeps across
restarts, one folder per pair under the data directory)."""

from __future__ import annotations

import shutil
import time

import typer

from dflash_mac.errors import UserError
from dflash_mac.prefix.files import cache_root, summary

from .console import table

ACTIONS = ("ls", "clear")


def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def cache_command(
    action: str = typer.Argument(..., metavar="ls|clear", help="List or remove cached prefixes."),
    pair: str | None = typer.Option(
        None, "--pair", help="Only the pairs whose folder name contains this text."
    ),
) -> None:
    """List or clear the prompt cache on disk (kept by `serve` across restarts)."""
    if action not in ACTIONS:
        raise UserError(f"unknown action {action!r}: use `cache ls` or `cache clear`.")
    root = cache_root()
    folders = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
    folders = [f for f in folders if pair is None or pair in f.name]
    if not folders:
        typer.echo(f"no cached prefixes{f' for {pair!r}' if pair else ''} in {root}.")
        return
    if action == "clear":
        freed = sum(summary(f)["bytes"] for f in folders)
        for f in folders:
            shutil.rmtree(f, ignore_errors=True)
        typer.echo(f"removed {len(folders)} pair folder(s), {size_text(freed)}, from {root}.")
        return
    rows = [["PAIR", "FILES", "TOKENS", "SIZE", "LAST USED"]]
    for f in folders:
        s = summary(f)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s["used"])) if s["used"] else "-"
        rows.append([f.name, str(s["files"]), str(s["tokens"]), size_text(s["bytes"]), when])
    typer.echo(table(rows))
    typer.echo(f"in {root}")
