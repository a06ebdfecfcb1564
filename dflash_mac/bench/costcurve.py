"""`dflash-mac bench --cost-curve`: the table and terminal plot of a pair's cost curve on this
machine. Measuring and saving it is the engine's (`dflash_mac/calibrate.py`): the same code
measures the quick curve front ends save at the first use of `--block-size auto`."""

from __future__ import annotations

from dflash_mac.sizing.cost import ContextCost, CostCurve


def render(curve: dict, width: int = 40) -> str:
    """A table and a terminal plot of the ratios (each also the break-even τ: the tokens a
    cycle must commit on average to match plain decoding), with the drafter pass and the rest
    of the cycle (verify and host sync) in ms where the curve has them. A sampled curve adds
    its own columns."""
    ratios = {int(b): r for b, r in curve["ratios"].items()}
    secs = {int(b): s for b, s in curve["seconds"].items()}
    draft = {int(b): s for b, s in curve.get("draft_seconds", {}).items()}
    sampled = curve.get("sampled")
    s_ratios = {int(b): r for b, r in sampled["ratios"].items()} if sampled else {}
    s_secs = {int(b): s for b, s in sampled["seconds"].items()} if sampled else {}
    top = max([*ratios.values(), *s_ratios.values()])
    head = "bs   ms/cycle" + ("   draft ms  verify ms" if draft else "") + "   × plain step"
    if sampled:
        head += f"   T {sampled['temperature']:g}: ms   × plain step"

    def row(b: int, r: float) -> str:
        line = f"{b:>2} {1000 * secs[b]:>10.2f}"
        if draft:
            d = draft.get(b, 0.0)
            line += (
                f" {1000 * d:>10.2f} {1000 * (secs[b] - d):>10.2f}" if d else f" {'–':>10} {'':>10}"
            )
        line += f" {r:>14.2f}"
        if b in s_ratios:
            line += f" {1000 * s_secs[b]:>12.2f} {s_ratios[b]:>14.2f}"
        return f"{line}  {'█' * max(1, round(width * r / top))}"

    notes = ["× plain step is also the break-even τ: the tokens a cycle must commit on average"]
    notes.append("to match plain decoding.")
    if draft:
        notes.append("draft ms: the drafter pass timed alone; verify ms: the rest of the cycle")
        notes.append("(the target's pass over bs tokens and the host sync).")
    lines = [head, *(row(b, r) for b, r in sorted(ratios.items())), *notes]
    trees = {int(b): r for b, r in curve.get("trees", {}).items()}
    if trees:
        s_trees = {int(b): r for b, r in sampled.get("trees", {}).items()} if sampled else {}
        lines.append(
            f"Tree cycles (depth {curve.get('tree_depth', '?')}), × plain step by node budget:"
        )
        for b, r in sorted(trees.items()):
            t = f"   T {sampled['temperature']:g}: {s_trees[b]:.2f}" if b in s_trees else ""
            lines.append(f"{b:>3} nodes {r:>8.2f}{t}  {'█' * max(1, round(width * r / top))}")
    lines += batch_rows(curve) + context_rows(curve)
    return "\n".join(lines) + "\n"


def batch_rows(curve: dict) -> list[str]:
    """The batched cycles' table: × one-row plain step by rows (B) and block size, and per row
    (what a row's cycle costs when B share it: the batch's gain is where that is below 1)."""
    batches = curve.get("batches") or {}
    if not batches:
        return []
    sizes = sorted({int(k) for row in batches.values() for k in row})
    head = "rows " + "".join(f"{f'bs {b}':>9}" for b in sizes) + "   per row at bs " + str(sizes[0])
    lines = ["Batched cycles (serve --max-batch), × one-row plain step:", head]
    for rows in sorted(batches, key=int):
        row = batches[rows]
        cells = "".join(f"{row[str(b)]:>9.2f}" if str(b) in row else f"{'–':>9}" for b in sizes)
        first = row.get(str(sizes[0]))
        per = f"{first / int(rows):>10.2f}" if first else ""
        lines.append(f"{rows:>4} {cells}{per}")
    return lines


def context_rows(curve: dict) -> list[str]:
    """The long-context table: a plain step and a cycle of the pair's block size timed at each
    context, the cycle in that context's plain steps as timed and as `auto` prices it (the
    fit, `ContextCost`), and the fit in words."""
    long = curve.get("long_context")
    if not long or not long.get("points"):
        return []
    bs, fit = long["block_size"], ContextCost.read(long)
    first = long["points"][0]
    priced = CostCurve({1: 1.0, bs: first["cycle"] / first["plain"]}, context=fit)
    lines = [
        f"Long contexts, a plain step and a cycle of bs {bs} (greedy):",
        "context   plain ms   cycle ms   × plain step   fit",
    ]
    for p in long["points"]:
        n, plain, cycle = p["context"], p["plain"], p["cycle"]
        at = priced.at_context(n).ratio(bs)
        lines.append(
            f"{n:>7} {1000 * plain:>10.2f} {1000 * cycle:>10.2f} {cycle / plain:>14.2f} {at:>5.2f}"
        )
    lines.append(f"fit: per 1,000 tokens past {fit.base}, a plain step grows by {fit.growth:.3f}")
    lines.append(f"and each extra verified token adds {fit.slope:.3f} (plain steps at {fit.base}).")
    return lines
