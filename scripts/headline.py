"""Write README.md's headline table from bench reports (what `dflash-mac bench --out FILE` appends).

    python scripts/headline.py bench/results/A.jsonl [B.jsonl ...]  # rewrite the README section
    python scripts/headline.py                        # again, from the files the README names
    python scripts/headline.py --check                # exit 1 when the README is stale

Each line of a JSONL file is one whole report (schema `dflash-mac-bench/1` or `/2`, in
dflash_mac/bench/); a `.json` file holds one report or a list. Of several reports of the
same suite and sampling setting the last one counts. The table gets the `auto` row of each report
and the fixed size it was compared with (else the best size), at most 8 rows, and is written
between `<!-- headline:start -->` and `<!-- headline:end -->` with the files and the machine named.
Standard library only, so it runs without MLX.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_mac.bench.command import display_id

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- headline:start -->"
END = "<!-- headline:end -->"
SOURCES = "<!-- headline sources: "
SCHEMAS = ("dflash-mac-bench/1", "dflash-mac-bench/2")
AUTO = "auto"  # the block size of `auto` (schema /2; /1 wrote 0, read as "auto")
MAX_ROWS = 8


class HeadlineError(Exception):
    """A file or README the headline cannot be made from; one sentence."""


# -- reading -------------------------------------------------------------------------------


def read_reports(path: Path) -> list[dict]:
    """The bench reports in one file (JSONL: one per line; JSON: one or a list)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise HeadlineError(f"cannot read {path}: {e.strerror}") from None
    if path.suffix == ".json":
        data = json.loads(text)
        docs = data if isinstance(data, list) else [data]
    else:
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
    reports = [upgrade(d) for d in docs if isinstance(d, dict) and d.get("schema") in SCHEMAS]
    if not reports:
        raise HeadlineError(
            f"{path} holds no bench report (write one with `dflash-mac bench --out FILE`)"
        )
    return reports


def upgrade(doc: dict) -> dict:
    """A /1 report with `auto` written as "auto", as /2 writes it (0 was auto in /1)."""
    if doc["schema"] != SCHEMAS[0]:
        return doc
    auto = lambda bs: AUTO if bs == 0 else bs  # noqa: E731
    config = {**doc["config"], "block_sizes": [auto(b) for b in doc["config"]["block_sizes"]]}
    rows = [{**r, "block_size": auto(r["block_size"])} for r in doc["rows"]]
    return {**doc, "config": config, "rows": rows}


def setting(config: dict) -> str:
    """greedy, or T = 0.7 plus the top-p / top-k / min-p that were set."""
    temp = config.get("temp") or 0.0
    if temp <= 0:
        return "greedy"
    extra = []
    if (config.get("top_p") or 1.0) < 1.0:
        extra.append(f"top-p {config['top_p']:g}")
    if config.get("top_k"):
        extra.append(f"top-k {config['top_k']}")
    if config.get("min_p"):
        extra.append(f"min-p {config['min_p']:g}")
    return ", ".join([f"T = {temp:g}", *extra])


def suite_name(config: dict) -> str:
    if config.get("prompts_file"):
        return Path(config["prompts_file"]).stem
    return str(config.get("suite", "?"))


def select(reports: list[dict]) -> tuple[list[dict], int]:
    """The last report per (suite, setting), ordered by suite (first seen), then temperature;
    and how many earlier reports of a kept (suite, setting) were left out."""
    last: dict[tuple[str, str], dict] = {}
    for doc in reports:
        last[(suite_name(doc["config"]), setting(doc["config"]))] = doc
    suites = list(dict.fromkeys(suite_name(d["config"]) for d in reports))
    kept = sorted(
        last.values(),
        key=lambda d: (suites.index(suite_name(d["config"])), d["config"].get("temp") or 0.0),
    )
    return kept, len(reports) - len(kept)


def machine(header: dict) -> str:
    """One line naming the machine: OS, CPU, cores, device, BLAS."""
    threads = header.get("blas_threads", "default")
    blas = header.get("blas", "?") + (f" ({threads} threads)" if threads != "default" else "")
    device = "Metal GPU" if header.get("device") == "gpu" else "CPU"
    return (
        f"{header.get('os', '?')} {header.get('machine', '?')}, {header.get('cpu', '?')}, "
        f"{header.get('cpu_count', '?')} cores; MLX {header.get('mlx', '?')} on the {device}, "
        f"BLAS: {blas}"
    )


# -- the table ------------------------------------------------------------------------------


def summary_row(doc: dict, block_size: int) -> dict | None:
    """The report's row for a block size: the `all` row where several suites ran."""
    rows = [r for r in doc["rows"] if r["block_size"] == block_size]
    for r in rows:
        if r["suite"] == "all":
            return r
    return rows[0] if rows else None


def chosen_rows(doc: dict) -> list[dict]:
    """`auto` and the fixed size it was compared with (the fastest one when several), else the
    report's best block size."""
    sizes = doc["config"]["block_sizes"]
    fixed = [b for b in sizes if b != AUTO]
    rows = []
    if AUTO in sizes:
        rows.append(summary_row(doc, AUTO))
    if fixed:
        best = max(fixed, key=lambda b: summary_row(doc, b)["dflash_tps"][0])
        rows.append(summary_row(doc, best))
    return [r for r in rows if r is not None]


def size_cell(row: dict) -> str:
    mix = {int(k): v for k, v in (row.get("block_mix") or {}).items()}
    if row["block_size"] == 1:
        return "1 (plain steps)"
    if row["block_size"] != AUTO:
        return str(row["block_size"])
    total = sum(mix.values())
    if not total:
        return "auto"
    drafting = 100 * (total - mix.get(1, 0)) / total
    return f"auto (drafts in {drafting:.0f} % of cycles)"


def speedup_cell(row: dict) -> str:
    cell = f"{row['speedup'][0]:.2f}×"
    ci = row.get("speedup_ci")
    return f"{cell} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci and row.get("runs", 0) > 1 else cell


def prompts_cell(doc: dict, row: dict) -> str:
    tokens = [p["prompt_tokens"] for p in doc.get("prompts", [])]
    span = f", {min(tokens):,}–{max(tokens):,} tokens" if tokens else ""
    return f"{row['prompts']} {suite_name(doc['config'])}{span} × {row['trials']} trials"


def versus_cell(doc: dict, row: dict, fixed: int | None) -> str:
    if row["block_size"] != AUTO or fixed is None:
        return ""
    for c in doc.get("auto_vs_fixed") or []:
        if c["block_size"] == fixed:
            lo, hi = c["ci"]
            return f"{c['ratio']:.3f}× [{lo:.3f}, {hi:.3f}] vs {fixed}"
    return ""


def lossless_cell(row: dict) -> str:
    if row.get("lossless_checked") is None:
        return "sampled, not compared"
    ok = row["lossless_equal"] == row["lossless_checked"]
    return f"{row['lossless_equal']}/{row['lossless_checked']} identical" + ("" if ok else " ✗")


def table(kept: list[dict]) -> tuple[list[str], int]:
    lines = [
        "| setting | prompts | block size | speedup [95 % interval] | τ "
        "| tok/s DFlash / plain | auto ÷ fixed size, same runs | output |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    count = 0
    for doc in kept:
        rows = chosen_rows(doc)
        fixed = next((r["block_size"] for r in rows if r["block_size"] != AUTO), None)
        for r in rows:
            lines.append(
                f"| {setting(doc['config'])} | {prompts_cell(doc, r)} | {size_cell(r)} | "
                f"{speedup_cell(r)} | {r['tau'][0]:.2f} | "
                f"{r['dflash_tps'][0]:.0f} / {r['baseline_tps'][0]:.0f} | "
                f"{versus_cell(doc, r, fixed)} | {lossless_cell(r)} |"
            )
            count += 1
    return lines, count


def cycle_cost(kept: list[dict]) -> tuple[int, float] | None:
    """(block size, plain steps per cycle = 1 / η) of the widest fixed greedy size measured."""
    best = None
    for doc in kept:
        if setting(doc["config"]) != "greedy":
            continue
        for r in doc["rows"]:
            bs, tau = r["block_size"], r["tau"][0]
            eta = r.get("eta") or (r["speedup"][0] / tau if tau > 0 else 0.0)
            if bs != AUTO and bs > 1 and eta > 0 and (best is None or bs > best[0]):
                best = (bs, 1 / eta)
    return best


def what_it_predicts(kept: list[dict], header: dict) -> str:
    if header.get("device") == "gpu":
        return (
            "Measured on the Metal GPU of an Apple Silicon Mac: other Macs differ in speed, not "
            "in τ or in the output, which depend on the pair and the prompts."
        )
    cost = cycle_cost(kept)
    here = (
        f"here a block-{cost[0]} cycle costs {cost[1]:.1f} plain steps (speedup ≈ τ ÷ that "
        "cost; docs/bench.md says where the time goes), "
        if cost
        else ""
    )
    return (
        "What a CPU figure predicts for a Mac: τ and the identical output depend on the pair and "
        f"the prompts and carry over, the speedup does not — {here}while on Apple Silicon's GPU "
        "a wide verify costs little more than one token, so the same τ should buy more speed "
        "there, which only a Mac run can show."
    )


def span(dates: list[str]) -> str:
    """'2026-12-02 15:27–15:38 UTC' for dates of one day, else 'first to last'."""
    first, last = dates[0], dates[-1]
    if first == last:
        return first
    a, b = first.split(), last.split()
    if len(a) == len(b) == 3 and a[0] == b[0] and a[2] == b[2]:
        return f"{a[0]} {a[1]}–{b[1]} {a[2]}"
    return f"{first} to {last}"


def render(paths: list[str], reports: list[dict], max_rows: int = MAX_ROWS) -> str:
    """The README section between the markers (markers excluded), ending in a newline."""
    kept, dropped = select(reports)
    machines = {machine(d["header"]) for d in kept}
    if len(machines) > 1:
        raise HeadlineError(
            "the reports come from different machines ("
            + "; ".join(sorted(machines))
            + "): make the headline from one machine's files"
        )
    header = kept[0]["header"]
    rows, count = table(kept)
    if count > max_rows:
        raise HeadlineError(
            f"{count} table rows from {len(kept)} reports, more than {max_rows}: pass fewer "
            "files or settings (or --max-rows)"
        )
    when = span(sorted(d["header"].get("date", "?") for d in kept))
    files = ", ".join(f"`{p}`" for p in paths)
    left_out = (
        f" ({dropped} earlier report{'s' if dropped > 1 else ''} of the same setting left out)"
        if dropped
        else ""
    )
    tq, dq = header.get("target_quantization"), header.get("draft_quantization")
    quant = "not quantized" if tq == dq == "none" else f"quantized: target {tq}, drafter {dq}"
    max_tokens = sorted({d["config"].get("max_tokens") for d in kept})
    lines = [
        SOURCES + json.dumps(paths) + " -->",
        "<!-- generated by scripts/headline.py: rerun it instead of editing this section -->",
        "",
        f"Machine: {machine(header)}. Pair: `{display_id(header.get('target'))}` with "
        f"`{display_id(header.get('draft'))}` ({header.get('drafter_kind')}), "
        f"{header.get('dtype')}, "
        f"{quant}; {'/'.join(map(str, max_tokens))} tokens per answer; "
        f"{when}, dflash-mac {header.get('dflash_mac')}. From {files}{left_out}.",
        "",
        *rows,
        "",
        "Speedup: DFlash decode tok/s ÷ plain decoding (mlx-lm's `generate_step`) in the same "
        "process on the same weights, mean over trials, [95 % bootstrap interval]; τ: tokens "
        "committed per cycle. " + what_it_predicts(kept, header),
    ]
    return "\n".join(lines) + "\n"


# -- the README -----------------------------------------------------------------------------


def split(readme: str) -> tuple[str, str, str]:
    """(before the start marker incl., the section, from the end marker on)."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise HeadlineError(f"README has no {START} … {END} section")
    head_end = start + len(START)
    return readme[:head_end], readme[head_end:end], readme[end:]


def sources(readme: str) -> list[str]:
    """The files the README's section says it was made from."""
    _, section, _ = split(readme)
    for line in section.splitlines():
        if line.startswith(SOURCES) and line.endswith("-->"):
            return json.loads(line[len(SOURCES) : -3])
    return []


def display(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def updated(readme: str, files: list[Path], root: Path, max_rows: int = MAX_ROWS) -> str:
    """The README text with its headline section made from `files`."""
    reports = [doc for f in files for doc in read_reports(f)]
    block = render([display(f, root) for f in files], reports, max_rows)
    head, _, tail = split(readme)
    return head + "\n" + block + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="bench reports (JSONL / JSON)")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    ap.add_argument("--max-rows", type=int, default=MAX_ROWS)
    args = ap.parse_args(argv)
    root = args.readme.resolve().parent
    try:
        readme = args.readme.read_text()
        files = args.files or [root / p for p in sources(readme)]
        if not files:
            raise HeadlineError("name the bench report files (the README names none yet)")
        new = updated(readme, files, root, args.max_rows)
    except HeadlineError as e:
        print(f"headline: {e}", file=sys.stderr)
        return 2
    names = " ".join(display(f, root) for f in files)
    if args.check:
        if new != readme:
            print(
                f"headline: {args.readme.name} is stale; run `python scripts/headline.py {names}`",
                file=sys.stderr,
            )
            return 1
        print(f"headline: {args.readme.name} is up to date with {names}")
        return 0
    if new != readme:
        args.readme.write_text(new)
    print(f"headline: {args.readme.name} written from {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
