"""`dflash-mac bench --cost-curve`: the table and terminal plot of a pair's cost curve on this
machine. Measuring and saving it is the engine's (`dflash_mac/calibrate.py`): the same code
measures the quick curve front ends save at the first use of `--block-size auto`."""

from __future__ import annotations


def render(curve: dict, width: int = 40) -> str:
    """A table and a terminal plot of the ratios; the break-even column is the tokens a cycle
    must commit on average to match plain decoding. A sampled curve adds its own columns."""
    ratios = {int(b): r for b, r in curve["ratios"].items()}
    secs = {int(b): s for b, s in curve["seconds"].items()}
    sampled = curve.get("sampled")
    s_ratios = {int(b): r for b, r in sampled["ratios"].items()} if sampled else {}
    s_secs = {int(b): s for b, s in sampled["seconds"].items()} if sampled else {}
    top = max([*ratios.values(), *s_ratios.values()])
    head = "bs   ms/cycle   × plain step   break-even τ"
    if sampled:
        head += f"   T {sampled['temperature']:g}: ms   × plain step"

    def row(b: int, r: float) -> str:
        line = f"{b:>2} {1000 * secs[b]:>10.2f} {r:>14.2f} {r:>14.2f}"
        if b in s_ratios:
            line += f" {1000 * s_secs[b]:>12.2f} {s_ratios[b]:>14.2f}"
        return f"{line}  {'█' * max(1, round(width * r / top))}"

    lines = [head, *(row(b, r) for b, r in sorted(ratios.items()))]
    return "\n".join(lines) + "\n"
