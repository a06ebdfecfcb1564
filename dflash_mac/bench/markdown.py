"""The bench report as markdown: a llama-bench-style header and table, then the acceptance
picture per block size; the cells and notes the live view shares."""

from __future__ import annotations

from dflash_mac.cli.terminal import bars

from .inputs import readable_id, size_label
from .summary import verdict


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
        "blocks (size×cycles)": " ".join(f"{b}×{n}" for b, n in row.get("block_mix", {}).items())
        + (f" · copies ×{row['copy_cycles']}" if row.get("copy_cycles") else ""),
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


BRIEF = ("bs", "suite", "prompts", "baseline t/s", "DFlash t/s", "speedup", "τ", "lossless")


def to_markdown(doc: dict, brief: bool = False) -> str:
    """llama-bench-style report: the verdict, header, one table row per block size (and
    suite), then the acceptance picture per block size. `brief`: what fits a screen (the
    verdict, the table's main columns, mismatches, one line naming the pair and machine)."""
    setting = doc["config"].get("setting")
    title = "# dflash-mac bench" + (f" — {setting}" if setting else "")
    if brief:
        h = doc["header"]
        return (
            "\n".join(
                [
                    title,
                    "",
                    verdict_line(doc),
                    "",
                    *summary_table(doc, BRIEF),
                    *mismatch_lines(doc),
                    "",
                    f"`{h['target']}` + `{h['draft']}` · {h.get('cpu', h['machine'])} · "
                    f"{h['device']} · BLAS {h['blas']}. Histograms, memory, TTFT and how each "
                    "figure is measured: `--verbose`.",
                ]
            )
            + "\n"
        )
    lines = [
        title,
        "",
        verdict_line(doc),
        "",
        *header_lines(doc),
        "",
        *summary_table(doc),
        *verdict_lines(doc),
        *length_table(doc),
        *mismatch_lines(doc),
    ]
    for row in doc["rows"]:
        lines += acceptance_lines(row, doc["rows"])
    return "\n".join(lines) + "\n"


def summary_table(doc: dict, columns: tuple[str, ...] | None = None) -> list[str]:
    """One markdown table row per summary row (`columns`: those alone)."""
    drafter_bytes = doc["header"]["drafter_weight_bytes"]
    cells = [table_cells(r, drafter_bytes) for r in doc["rows"]]
    cols = list(columns or cells[0])
    return [
        "| " + " | ".join(cols) + " |",
        "| " + " | ".join("---:" if c not in ("suite",) else "---" for c in cols) + " |",
        *("| " + " | ".join(c[k] for k in cols) + " |" for c in cells),
    ]


def verdict_line(doc: dict) -> str:
    """The first thing a reader wants: is DFlash faster than plain decoding here, and is the
    output the target's own."""
    v = verdict(doc["rows"])
    if v is None:
        return ""
    where = f"block {size_label(v['block_size'])}"
    ci = f" [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]" if v["ci"] else ""
    if v["winner"] == "dflash":
        said = f"**DFlash is {v['speedup']:.2f}× faster than plain decoding** here ({where}{ci})."
    elif v["winner"] == "plain":
        said = (
            f"**Plain decoding is fastest on this machine**: the best DFlash setting ({where}) "
            f"runs at {v['speedup']:.2f}×{ci} of its speed."
        )
    else:
        said = (
            f"**DFlash and plain decoding are even on this machine**: the best DFlash setting "
            f"({where}) runs at {v['speedup']:.2f}×{ci}, within the noise of 1×."
        )
    lossless = doc["lossless"]
    if lossless["checked"]:
        same = f"{lossless['equal']}/{lossless['checked']}"
        said += f" Greedy output identical to the target's in {same} runs."
    else:
        said += " Sampled: each token drawn from the target's own distribution."
    return said


def verdict_lines(doc: dict) -> list[str]:
    """auto against each fixed size on the same runs."""
    lines = []
    for c in doc.get("auto_vs_fixed", []):
        lo, hi = c["ci"]
        lines += [
            "",
            f"auto ÷ block {c['block_size']} on the same runs: **{c['ratio']:.3f}×** "
            f"[{lo:.3f}, {hi:.3f}] (pooled decode tok/s; 95 % bootstrap over the (trial, "
            "prompt) pairs).",
        ]
    return lines


def mismatch_lines(doc: dict) -> list[str]:
    """The runs that failed the lossless check (the first 20); none when all passed."""
    lossless = doc["lossless"]
    if not lossless["mismatches"]:
        return []
    return [
        "",
        f"**Lossless check failed** for {len(lossless['mismatches'])} of "
        f"{lossless['checked']} runs:",
        *(
            f"- `{readable_id(m['id'])}` trial {m['trial']} block {m['block_size']}: first "
            f"difference at token {m['first_diff']}"
            for m in lossless["mismatches"][:20]
        ),
    ]


def acceptance_lines(row: dict, rows: list[dict]) -> list[str]:
    """A row's histogram and survival per position; a block size's "all" row alone when it ran
    several suites."""
    if row["suite"] != "all" and sum(r["block_size"] == row["block_size"] for r in rows) > 1:
        return []
    lines = [
        "",
        f"### Acceptance, block size {size_label(row['block_size'])} "
        f"({row['cycles']} cycles{plain_note(row)}, τ {row['tau'][0]:.2f}{eta_note(row)})",
        "",
        "```",
        "tokens per drafting cycle",
        *bars(row["histogram"]),
        "",
        "k  P(A ≥ k)  P(pos k accepted | 1..k-1)",
    ]
    pos = row["position_acceptance"]
    for k, s in enumerate(row["survival"], 1):
        pa = pos[k - 1] if k <= len(pos) else None
        lines.append(f"{k:<2} {s:8.3f}  {'' if pa is None else f'{pa:8.3f}'}".rstrip())
    return [*lines, "```"]


def eta_note(row: dict, sep: str = ", ") -> str:
    """ ", η 0.45: a cycle costs 2.23 baseline steps" where the row has η (speedup ÷ τ)."""
    eta = row.get("eta") or 0.0
    return f"{sep}η {eta:.2f}: a cycle costs {1 / eta:.2f} baseline steps" if eta > 0 else ""


def plain_note(row: dict) -> str:
    """ ", 214 of them plain steps" when a row's cycles include plain steps (the acceptance
    pictures are over the drafting cycles alone)."""
    plain = row["cycles"] - row.get("draft_cycles", row["cycles"])
    return f", {plain} of them plain steps" if plain else ""
