"""The terminal's error stream and its one-line warnings. Light (rich only), so a command can
warn while it checks its options, before the slow imports."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, soft_wrap=True)


def warn_line(message: str) -> None:
    """Print a warning on one line (no wrapping at the terminal width)."""
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True, highlight=False)


def table(rows: list[list[str]]) -> str:
    """Plain left-aligned columns (`ps`, `cache ls`): no box, easy to grep."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
