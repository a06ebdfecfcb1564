"""The drafter campaign's curve: every training stage ends with the same held-out evaluation,
appended as one row to a CSV beside the model card and drawn as a PNG there.

The evaluation is the drafter's own chain (block 8, no copies, no trees) on the first prompts
of the held-out `code` and `chat` suites, greedy and at T 0.7 (seed = prompt index), 96 tokens:
what `scripts/compare_drafters.py` measured for stages 4 and 5, so the curve continues theirs.
Greedy answers are checked token for token against the target's plain decoding.
"""

from __future__ import annotations

import csv
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from dflash_mac.bench.inputs import code_suite_path

SUITES = {
    "code": (code_suite_path(), 8),
    "chat": (Path(__file__).parents[1] / "data/suites/chat.jsonl", 6),
}
TEMPS = (0.0, 0.7)
BLOCK = 8
MAX_TOKENS = 96
FIELDS = [
    "stage",
    "date",
    "host",
    "draft_vocab",
    "data_tokens",
    "stage_steps",
    "steps",
    "blocks",
    "blocks_estimated",
    "s_per_step",
    "tau_code_greedy",
    "tau_code_t0.7",
    "tau_chat_greedy",
    "tau_chat_t0.7",
    "identical",
    "note",
]


def column(suite: str, temp: float) -> str:
    return f"tau_{suite}_{'greedy' if temp == 0 else f't{temp:g}'}"


def held_out_tau(pair, log=print) -> dict:
    """τ of the drafter's block-8 chain per suite and temperature, and how many greedy
    answers equal the target's plain decoding (``identical``: ``"14/14"``)."""
    from dflash_mac.train.data import encode_prompts, read_prompts
    from dflash_mac.train.evaluate import baseline_run, dflash_run

    out: dict = {}
    same = total = 0
    for suite, (path, n) in SUITES.items():
        prompts = encode_prompts(pair.tokenizer, read_prompts(path)[:n], 4096)
        for temp in TEMPS:
            taus = []
            for i, ids in enumerate(prompts):
                seed = i if temp else None
                toks, _, lengths, _ = dflash_run(pair, ids, MAX_TOKENS, BLOCK, temp, seed)
                taus.append(sum(lengths) / len(lengths) if lengths else 1.0)
                if temp == 0:
                    ref, _ = baseline_run(pair, ids, MAX_TOKENS)
                    same += [t for t in toks if t not in pair.eos_ids] == ref
                    total += 1
            out[column(suite, temp)] = round(sum(taus) / len(taus), 4)
            log(f"{suite} T {temp:g}: τ {out[column(suite, temp)]:.3f} ({len(prompts)} prompts)")
    out["identical"] = f"{same}/{total}"
    return out


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(path: Path, row: dict) -> None:
    """Append one stage's row (the header first in a new file)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in FIELDS})


NOT_ADOPTED = "NOT ADOPTED"  # in the note of a stage whose weights were not kept


def stage_row(draft_dir: Path, curve: Path, stage: str, tau: dict, note: str = "") -> dict:
    """The row of a stage just trained: its summary (`dflash_training.json`) on top of the
    curve's last cumulative figures."""
    summary = json.loads((draft_dir / "dflash_training.json").read_text())
    cfg = json.loads((draft_dir / "config.json").read_text())
    # its cumulative figures go on from the last stage whose weights were kept (a stage not
    # adopted left the committed drafter as it was)
    kept = [r for r in read_rows(curve) if NOT_ADOPTED not in r.get("note", "")]
    last = kept[-1] if kept else {}
    steps = int(summary.get("steps", 0))
    blocks = summary.get("blocks")
    estimated = blocks is None
    if estimated:  # older summaries: batch × anchors per step, an upper bound
        s = summary["settings"]
        blocks = steps * s["batch_size"] * s["anchors"]
    train_s = float(summary.get("train_seconds") or 0.0)
    return {
        "stage": stage,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "host": host_name(),
        "draft_vocab": cfg["dflash_config"].get("draft_vocab_size") or cfg["vocab_size"],
        "data_tokens": summary.get("response_tokens", ""),
        "stage_steps": steps,
        "steps": int(last.get("steps") or 0) + steps,
        "blocks": int(last.get("blocks") or 0) + int(blocks),
        "blocks_estimated": estimated or last.get("blocks_estimated") == "True",
        "s_per_step": round(train_s / steps, 2) if steps else "",
        **tau,
        "note": note,
    }


def host_name() -> str:
    """The CPU's marketing name, shortened (`AMD EPYC`, `Intel Xeon`), else the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                return " ".join(w for w in name.replace("(R)", "").split()[:2])
    except OSError:
        pass
    return platform.machine()


def restarts(rows: list[dict]) -> list[list[dict]]:
    """The rows split where the cumulative steps fall: a drafter trained anew (another
    initialisation) starts a lineage of its own."""
    out: list[list[dict]] = []
    for r in rows:
        if not out or float(r["steps"]) < float(out[-1][-1]["steps"]):
            out.append([])
        out[-1].append(r)
    return out


def plot(curve: Path, png: Path) -> None:
    """τ against cumulative optimiser steps and training blocks, one line per suite and
    temperature (needs matplotlib: `pip install matplotlib`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_rows(curve) if r.get("tau_code_greedy")]
    lineages = restarts(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, x_key, label in (
        (axes[0], "steps", "optimiser steps"),
        (axes[1], "blocks", "training blocks"),
    ):
        colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
        for suite in SUITES:
            for temp, style in zip(TEMPS, ("-o", "--s")):
                col, color = column(suite, temp), next(colors)
                name = f"{suite}, {'greedy' if temp == 0 else f'T {temp:g}'}"
                for k, lineage in enumerate(lineages):  # earlier lineages drawn faint
                    pts = [(float(r[x_key]), float(r[col])) for r in lineage if r.get(col)]
                    if pts:
                        xs, ys = zip(*pts)
                        last = k == len(lineages) - 1
                        ax.plot(
                            xs, ys, style, color=color, alpha=1.0 if last else 0.3,
                            label=name if last else None,
                        )  # fmt: skip
        for r in rows:
            ax.annotate(
                r["stage"],
                (float(r[x_key]), float(r["tau_code_greedy"])),
                fontsize=7,
                xytext=(2, 4),
                textcoords="offset points",
            )
        ax.set_xlabel(f"cumulative {label}")
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k" if x >= 10_000 else f"{x:g}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out τ, block-{BLOCK} chain")
    axes[1].legend(fontsize=8)
    fig.suptitle("smollm2-135m DFlash 2 drafter: held-out acceptance by training stage")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def evaluate_stage(
    target: str, draft_dir: Path, curve: Path, stage: str, note: str = "", log=print
) -> dict:
    """Evaluate `draft_dir`, append its row to `curve`, redraw ``curve.png`` beside it."""
    from dflash_mac.loading.loader import load

    t0 = time.perf_counter()
    pair = load(target, draft_dir)
    row = stage_row(draft_dir, curve, stage, held_out_tau(pair, log), note)
    append_row(curve, row)
    log(f"stage {stage}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)")
    try:
        plot(curve, curve.with_suffix(".png"))
    except ImportError:
        log("matplotlib is not installed: the curve's picture was not redrawn")
    return row
