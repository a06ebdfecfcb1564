"""Bench reports: one JSON document, rendered as markdown, JSON, JSONL or CSV; its schema."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from dflash_mac.cli.terminal import bars

from .run import size_label

SCHEMA_ID = "dflash-mac-bench/1"

DEFINITIONS = {
    "decode_tps": "tokens after the first ÷ seconds from the first token to the last, both "
    "taken on the host by the bench for baseline and DFlash alike; per trial "
    "Σ tokens ÷ Σ seconds over the prompts, then mean ± sample std over trials",
    "speedup": "DFlash decode tok/s ÷ baseline decode tok/s, per trial, then mean ± std",
    "speedup_ci": "95 % bootstrap interval of the pooled speedup, resampling (trial, prompt) "
    "pairs of back-to-back baseline and DFlash runs (2,000 resamples, seeded)",
    "tau": "tokens committed per DFlash cycle incl. the bonus (1..block size); mean per "
    "request, then mean ± std over requests",
    "ttft": "seconds from the call to the first token on the host (prefill + first sample)",
    "prefill_tps": "prompt tokens ÷ TTFT",
    "peak_memory": "mx.get_peak_memory() after mx.reset_peak_memory(), max over runs; the "
    "baseline column excludes the drafter's resident weights",
    "lossless": "greedy only: DFlash token ids equal the baseline's, per prompt and trial",
    "baseline": "mlx_lm.generate.generate_step on the same target weights, no hooks",
}

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_PAIR = {"type": "array", "items": _NUM, "minItems": 2, "maxItems": 2}
_INTS = {"type": "array", "items": _INT}
_NUMS = {"type": "array", "items": _NUM}
_RUN = {
    "type": "object",
    "required": [
        "generation_tokens",
        "decode_tokens",
        "decode_time_s",
        "decode_tps",
        "ttft_s",
        "prefill_tps",
        "peak_memory_bytes",
        "finish_reason",
        "tokens",
    ],
    "properties": {
        "generation_tokens": _INT,
        "decode_tps": _NUM,
        "ttft_s": _NUM,
        "tokens": _INTS,
        "finish_reason": {"type": "string"},
    },
}
_DFLASH_RUN = {
    "type": "object",
    "required": [
        *_RUN["required"],
        "block_size",
        "tau",
        "cycles",
        "acceptance_lengths",
        "histogram",
        "lossless",
    ],
    "properties": {
        **_RUN["properties"],
        "block_size": _INT,
        "tau": _NUM,
        "cycles": _INT,
        "acceptance_lengths": _INTS,
        "histogram": _INTS,
        "lossless": {"type": ["boolean", "null"]},
        "first_diff": {"type": ["integer", "null"]},
    },
}
_ROW = {
    "type": "object",
    "required": [
        "block_size",
        "suite",
        "prompts",
        "trials",
        "runs",
        "baseline_tps",
        "dflash_tps",
        "speedup",
        "tau",
        "cycles",
        "histogram",
        "survival",
        "position_acceptance",
        "baseline_prefill_tps",
        "dflash_prefill_tps",
        "baseline_ttft_ms",
        "dflash_ttft_ms",
        "baseline_peak_bytes",
        "dflash_peak_bytes",
        "lossless_equal",
        "lossless_checked",
    ],
    "properties": {
        "block_size": _INT,
        "suite": {"type": "string"},
        "prompts": _INT,
        "baseline_tps": _PAIR,
        "dflash_tps": _PAIR,
        "speedup": _PAIR,
        "speedup_ci": _PAIR,
        "tau": _PAIR,
        "eta": _NUM,
        "histogram": _INTS,
        "survival": _NUMS,
        "position_acceptance": _NUMS,
        "lossless_equal": {"type": ["integer", "null"]},
        "lossless_checked": {"type": ["integer", "null"]},
    },
}
SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dflash-mac bench report",
    "type": "object",
    "required": ["schema", "header", "config", "rows", "best_block_size", "lossless", "prompts"],
    "properties": {
        "schema": {"enum": [SCHEMA_ID]},
        "header": {
            "type": "object",
            "required": [
                "machine",
                "os",
                "mlx",
                "mlx_lm",
                "device",
                "blas",
                "target",
                "draft",
                "drafter_kind",
                "target_quantization",
                "draft_quantization",
                "dtype",
                "drafter_weight_bytes",
                "date",
                "dflash_mac",
                "definitions",
            ],
            "properties": {
                "blas": {"type": "string"},
                "device": {"type": "string"},
                "drafter_weight_bytes": _INT,
                "definitions": {"type": "object"},
            },
        },
        "config": {
            "type": "object",
            "required": [
                "suite",
                "prompts_file",
                "trials",
                "max_tokens",
                "block_sizes",
                "temp",
                "seed",
                "use_eos",
                "cooldown_s",
            ],
            "properties": {"block_sizes": _INTS, "trials": _INT, "max_tokens": _INT},
        },
        "rows": {"type": "array", "items": _ROW, "minItems": 1},
        "best_block_size": {"type": ["integer", "null"]},
        "auto_vs_fixed": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["block_size", "ratio", "ci"],
                "properties": {"block_size": _INT, "ratio": {"type": "number"}, "ci": _PAIR},
            },
        },
        "lossless": {
            "type": "object",
            "required": ["checked", "equal", "mismatches"],
            "properties": {
                "checked": {"type": ["integer", "null"]},
                "equal": {"type": ["integer", "null"]},
                "mismatches": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "trial", "block_size", "first_diff"],
                    },
                },
            },
        },
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "id",
                    "suite",
                    "trial",
                    "position",
                    "prompt_tokens",
                    "baseline",
                    "dflash",
                ],
                "properties": {"baseline": _RUN, "dflash": {"type": "array", "items": _DFLASH_RUN}},
            },
        },
    },
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}


def validate(doc: Any, schema: dict = SCHEMA, path: str = "$") -> list[str]:
    """Errors of `doc` against the JSON-schema subset used by SCHEMA (type, enum, required,
    properties, items, minItems, maxItems)."""
    errors = []
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        ok = any(
            isinstance(doc, _TYPES[t])
            and not (t in ("integer", "number") and isinstance(doc, bool))
            for t in names
        )
        if not ok:
            return [f"{path}: expected {'/'.join(names)}, got {type(doc).__name__}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} not in {schema['enum']}")
    if isinstance(doc, dict):
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in doc]
        for k, sub in schema.get("properties", {}).items():
            if k in doc:
                errors += validate(doc[k], sub, f"{path}.{k}")
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if len(doc) > schema.get("maxItems", len(doc)):
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(doc):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def record_dict(rec: dict, greedy: bool) -> dict:
    """A (trial, prompt) record with its runs as plain dicts (lossless per DFlash run)."""
    from .summary import first_diff

    base = rec["baseline"]
    dflash = []
    for bs in sorted(rec["dflash"]):
        run = rec["dflash"][bs]
        diff = first_diff(run.tokens, base.tokens) if greedy else None
        dflash.append(
            {**run.as_dict(), "lossless": diff is None if greedy else None, "first_diff": diff}
        )
    return {k: rec[k] for k in ("id", "suite", "trial", "position", "prompt_tokens")} | {
        "baseline": base.as_dict(),
        "dflash": dflash,
    }


def build_report(
    header: dict, config: dict, records: list[dict], block_sizes: list[int], greedy: bool
) -> dict:
    """The whole report document (validates against SCHEMA)."""
    from .summary import auto_vs_fixed, best_block_size, length_rows, mismatches, summary_rows

    rows = summary_rows(records, block_sizes, greedy)
    by_length = length_rows(records, block_sizes)
    bad = mismatches(records) if greedy else []
    checked = sum(len(r["dflash"]) for r in records) if greedy else None
    return {
        "schema": SCHEMA_ID,
        "header": {**header, "definitions": DEFINITIONS},
        "config": config,
        "rows": rows,
        "best_block_size": best_block_size(rows),
        "auto_vs_fixed": auto_vs_fixed(records, block_sizes),
        "lossless": {
            "checked": checked,
            "equal": None if checked is None else checked - len(bad),
            "mismatches": bad,
        },
        "prompts": [record_dict(r, greedy) for r in records],
        # speedup against prompt length, when the prompts span more than one length bucket
        "by_length": by_length if len({r["min_prompt_tokens"] for r in by_length}) > 1 else [],
    }


# -- renderers ----------------------------------------------------------------------------


def _pm(pair: list[float], trials: int, digits: int = 1, unit: str = "") -> str:
    """mean ± std; the mean alone for one trial (no spread to show)."""
    mean = f"{pair[0]:.{digits}f}{unit}"
    return mean if trials < 2 else f"{mean} ± {pair[1]:.{digits}f}"


def speedup_cell(row: dict) -> str:
    """mean ± std over trials, then the 95 % interval where there is one (older reports have
    none)."""
    cell = _pm(row["speedup"], row["trials"], 2, "×")
    ci = row.get("speedup_ci")
    return cell if not ci or row["runs"] < 2 else f"{cell} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def lossless_cell(row: dict) -> str:
    if row["lossless_checked"] is None:
        return "n/a (sampling)"
    ok = row["lossless_equal"] == row["lossless_checked"]
    return f"{row['lossless_equal']}/{row['lossless_checked']}" + ("" if ok else " ✗")


def table_cells(row: dict, drafter_bytes: int) -> dict[str, str]:
    """Markdown/terminal cells of one summary row."""
    base_peak = max(row["baseline_peak_bytes"] - drafter_bytes, 0)
    return {
        "bs": size_label(row["block_size"]),
        "suite": row["suite"],
        "prompts": str(row["prompts"]),
        "baseline t/s": _pm(row["baseline_tps"], row["trials"]),
        "DFlash t/s": _pm(row["dflash_tps"], row["trials"]),
        "speedup": speedup_cell(row),
        "τ": f"{row['tau'][0]:.2f}",
        "prefill t/s (base / DFlash)": (
            f"{row['baseline_prefill_tps']:.0f} / {row['dflash_prefill_tps']:.0f}"
        ),
        "TTFT ms (base / DFlash)": f"{row['baseline_ttft_ms']:.1f} / {row['dflash_ttft_ms']:.1f}",
        "peak mem (base / DFlash)": f"{_gb(base_peak)} / {_gb(row['dflash_peak_bytes'])}",
        "lossless": lossless_cell(row),
        "blocks (size×cycles)": " ".join(f"{b}×{n}" for b, n in row.get("block_mix", {}).items()),
        "host ms/cycle": f"{row.get('host_ms_per_cycle', 0.0):.2f}",
    }


def header_lines(doc: dict) -> list[str]:
    h, c = doc["header"], doc["config"]
    load = h.get("load_avg")
    quant = f"target {h['target_quantization']}, drafter {h['draft_quantization']}"
    threads = h.get("blas_threads", "default")
    blas = h["blas"] + (f" ({threads} threads)" if threads != "default" else "")
    prompts = c["prompts_file"] or f"suite {c['suite']}"
    sampling = (
        "greedy"
        if c["temp"] <= 0
        else (
            f"temp {c['temp']}, top-p {c.get('top_p')}, top-k {c.get('top_k')}, "
            f"min-p {c.get('min_p')}"
        )
    )
    return [
        f"- machine: {h['machine']} · {h.get('cpu', '?')} · {h.get('cpu_count', '?')} CPUs · "
        f"{h['os']}" + (f" · load average {load[0]} → {load[1]}" if load else ""),
        f"- MLX {h['mlx']} · mlx-lm {h['mlx_lm']} · device {h['device']} · BLAS {blas} · "
        f"dflash-mac {h['dflash_mac']}",
        f"- target `{h['target']}` · drafter `{h['draft']}` ({h['drafter_kind']}) · "
        f"dtype {h['dtype']} · quantization: {quant}"
        + (f" · auto's cost prior: {h['auto_prior']}" if "auto_prior" in h else ""),
        f"- {prompts} · {c['trials']} trial(s) · max tokens {c['max_tokens']} · {sampling} · "
        f"EOS {'on' if c['use_eos'] else 'off'} · seed {c['seed']} · cooldown "
        f"{c['cooldown_s']} s · {h['date']}",
        f"- decode tok/s: {h['definitions']['decode_tps']}.",
        *(
            [f"- speedup: mean ± std over trials [{h['definitions']['speedup_ci']}]."]
            if "speedup_ci" in h["definitions"]
            else []
        ),
        f"- peak memory: {h['definitions']['peak_memory']} ({_gb(h['drafter_weight_bytes'])}).",
        *(
            [
                f"- distributed: {h['ranks']} ranks · {h['parallel']} parallel · "
                f"{h['collectives_per_cycle']} collectives per cycle · "
                f"~{h['collective_ms_per_cycle']:.2f} ms in collectives per cycle (start-up probe)"
            ]
            if h.get("ranks", 1) > 1
            else []
        ),
    ]


def length_table(doc: dict) -> list[str]:
    """Speedup against prompt length (markdown lines; none when one length bucket ran)."""
    rows = doc.get("by_length") or []
    if not rows:
        return []
    lines = [
        "",
        "### Speedup against prompt length",
        "",
        "| bs | prompt tokens | prompts | baseline t/s | DFlash t/s | speedup | τ | plain steps |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {size_label(r['block_size'])} | {r['min_prompt_tokens']}–{r['max_prompt_tokens']}"
            f" | {r['prompts']} | {r['baseline_tps']:.1f} | {r['dflash_tps']:.1f} | "
            f"{r['speedup']:.2f}× | {r['tau']:.2f} | {100 * r['plain_share']:.0f} % |"
        )
    return lines


def to_markdown(doc: dict) -> str:
    """llama-bench-style report: header, one table row per block size (and suite), then the
    acceptance picture per block size."""
    drafter_bytes = doc["header"]["drafter_weight_bytes"]
    cells = [table_cells(r, drafter_bytes) for r in doc["rows"]]
    cols = list(cells[0])
    setting = doc["config"].get("setting")
    lines = [
        "# dflash-mac bench" + (f" — {setting}" if setting else ""),
        "",
        *header_lines(doc),
        "",
        "| " + " | ".join(cols) + " |",
        "| " + " | ".join("---:" if c not in ("suite",) else "---" for c in cols) + " |",
    ]
    lines += ["| " + " | ".join(c[k] for k in cols) + " |" for c in cells]
    if len(doc["config"]["block_sizes"]) > 1 and doc["best_block_size"] is not None:
        lines += [
            "",
            f"Best block size on this machine: **{size_label(doc['best_block_size'])}** "
            "(highest DFlash decode tok/s).",
        ]
    for c in doc.get("auto_vs_fixed", []):
        lo, hi = c["ci"]
        lines += [
            "",
            f"auto ÷ block {c['block_size']} on the same runs: **{c['ratio']:.3f}×** "
            f"[{lo:.3f}, {hi:.3f}] (pooled decode tok/s; 95 % bootstrap over the (trial, "
            "prompt) pairs).",
        ]
    lines += length_table(doc)
    lossless = doc["lossless"]
    if lossless["mismatches"]:
        lines += [
            "",
            f"**Lossless check failed** for {len(lossless['mismatches'])} of "
            f"{lossless['checked']} runs:",
        ]
        lines += [
            f"- `{m['id']}` trial {m['trial']} block {m['block_size']}: first "
            f"difference at token {m['first_diff']}"
            for m in lossless["mismatches"][:20]
        ]
    for row in doc["rows"]:
        if (
            row["suite"] != "all"
            and sum(r["block_size"] == row["block_size"] for r in doc["rows"]) > 1
        ):
            continue
        lines += [
            "",
            f"### Acceptance, block size {size_label(row['block_size'])} "
            f"({row['cycles']} cycles{plain_note(row)}, τ {row['tau'][0]:.2f}{eta_note(row)})",
            "",
            "```",
            "tokens per drafting cycle",
        ]
        lines += bars(row["histogram"])
        lines += ["", "k  P(A ≥ k)  P(pos k accepted | 1..k-1)"]
        for k, s in enumerate(row["survival"], 1):
            pos = row["position_acceptance"]
            pa = pos[k - 1] if k <= len(pos) else None
            lines.append(f"{k:<2} {s:8.3f}  {'' if pa is None else f'{pa:8.3f}'}".rstrip())
        lines.append("```")
    return "\n".join(lines) + "\n"


def eta_note(row: dict, sep: str = ", ") -> str:
    """ ", η 0.45: a cycle costs 2.23 baseline steps" where the row has η (speedup ÷ τ)."""
    eta = row.get("eta") or 0.0
    return f"{sep}η {eta:.2f}: a cycle costs {1 / eta:.2f} baseline steps" if eta > 0 else ""


def plain_note(row: dict) -> str:
    """ ", 214 of them plain steps" when a row's cycles include plain steps (the acceptance
    pictures are over the drafting cycles alone)."""
    plain = row["cycles"] - row.get("draft_cycles", row["cycles"])
    return f", {plain} of them plain steps" if plain else ""


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


RENDERERS = {"md": to_markdown, "json": to_json, "jsonl": to_jsonl, "csv": to_csv}


def render(doc: dict, fmt: str) -> str:
    return RENDERERS[fmt](doc)


def append_jsonl(path: str | Path, doc: dict) -> None:
    """Append the whole report as one JSON line (results accumulate across runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(doc, ensure_ascii=False) + "\n")


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
