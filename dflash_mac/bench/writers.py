"""The bench report as JSON (number arrays on one line), JSONL and CSV (one flat row per summary
row, header fields included), and the append-only JSONL results file."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path


def flat_rows(doc: dict) -> list[dict]:
    """One flat dict per summary row with the header fields (JSONL / CSV)."""
    h, c = doc["header"], doc["config"]
    keep = (
        "machine",
        "cpu",
        "cpu_count",
        "os",
        "mlx",
        "mlx_lm",
        "device",
        "blas",
        "blas_threads",
        "target",
        "draft",
        "drafter_kind",
        "target_quantization",
        "draft_quantization",
        "dtype",
        "date",
        "dflash_mac",
        "load_avg",
        "auto_prior",
    )
    out = []
    for r in doc["rows"]:
        flat = {k: h.get(k) for k in keep}
        flat.update(max_tokens=c["max_tokens"], temp=c["temp"], seed=c["seed"])
        for k, v in r.items():
            if k in ("baseline_tps", "dflash_tps", "speedup", "tau"):
                flat[f"{k}_mean"], flat[f"{k}_std"] = v
            elif k == "speedup_ci":
                flat["speedup_ci_low"], flat["speedup_ci_high"] = v
            else:
                flat[k] = v
        out.append(flat)
    return out


_NUMBER_LIST = re.compile(r"\[\s*(?:-?[\d.eE+-]+\s*,\s*)*-?[\d.eE+-]+\s*\]")


def to_json(doc: dict) -> str:
    """Indented JSON with number arrays (tokens, acceptance lengths) kept on one line."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    inline = lambda m: "[" + ", ".join(x.strip() for x in m.group(0)[1:-1].split(",")) + "]"  # noqa: E731
    return _NUMBER_LIST.sub(inline, text) + "\n"


def to_jsonl(doc: dict) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in flat_rows(doc))


def to_csv(doc: dict) -> str:
    rows = flat_rows(doc)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()})
    return buf.getvalue()


def append_jsonl(path: str | Path, doc: dict) -> None:
    """Append the whole report as one JSON line (results accumulate across runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(doc, ensure_ascii=False) + "\n")
