"""Bench reports: one JSON document (`document.py`, its schema in `schema.py`) rendered as
markdown (`markdown.py`), JSON, JSONL or CSV (`writers.py`). Re-render a saved one with
`python -m dflash_mac.bench.report REPORT.json [md|json|jsonl|csv]`."""

from __future__ import annotations

import json
from pathlib import Path

from .document import DEFINITIONS, build_report, record_dict
from .markdown import eta_note, plain_note, to_markdown
from .schema import SCHEMA, SCHEMA_ID, validate
from .writers import append_jsonl, flat_rows, to_csv, to_json, to_jsonl

# The names bench's command, its live view and the tests import from here.
__all__ = [
    "DEFINITIONS",
    "RENDERERS",
    "SCHEMA",
    "SCHEMA_ID",
    "append_jsonl",
    "build_report",
    "eta_note",
    "flat_rows",
    "main",
    "plain_note",
    "record_dict",
    "render",
    "to_csv",
    "to_json",
    "to_jsonl",
    "to_markdown",
    "validate",
]

RENDERERS = {"md": to_markdown, "json": to_json, "jsonl": to_jsonl, "csv": to_csv}


def render(doc: dict, fmt: str) -> str:
    return RENDERERS[fmt](doc)


def main(argv: list[str] | None = None) -> None:
    """Re-render a saved JSON report: `python -m dflash_mac.bench.report FILE.json [FORMAT]`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or (len(args) == 2 and args[1] not in RENDERERS):
        sys.exit("usage: python -m dflash_mac.bench.report REPORT.json [md|json|jsonl|csv]")
    doc = json.loads(Path(args[0]).read_text())
    if errors := validate(doc):
        sys.exit(f"{args[0]} is not a bench report: {errors[0]}")
    sys.stdout.write(render(doc, args[1] if len(args) == 2 else "md"))


if __name__ == "__main__":
    main()
