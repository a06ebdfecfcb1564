"""The bench report document: header, config, summary rows, the lossless check and every
(trial, prompt) record, built from the runner's records (validates against `schema.SCHEMA`)."""

from __future__ import annotations

from .inputs import size_order
from .schema import SCHEMA_ID

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


def record_dict(rec: dict, greedy: bool) -> dict:
    """A (trial, prompt) record with its runs as plain dicts (lossless per DFlash run)."""
    from .summary import first_diff

    base = rec["baseline"]
    dflash = []
    for bs in sorted(rec["dflash"], key=size_order):
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
