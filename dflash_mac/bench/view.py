"""Live terminal view of a bench run: progress, τ, tok/s and the acceptance histogram."""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dflash_mac.cli.terminal import bars
from dflash_mac.engine.stats import drafting, histogram
from dflash_mac.settings import AUTO

from .inputs import BenchPrompt, readable_id, size_label, size_order
from .report import eta_note, plain_note
from .run import Observer, Run
from .summary import trial_tps


class BenchView(Observer):
    """Rich Live panel on a terminal; one plain line per prompt otherwise (logs, CI)."""

    def __init__(
        self, console: Console, total_prompts: int, block_sizes: list[int], live: bool | None = None
    ):
        self.console = console
        self.total = total_prompts
        self.block_sizes = block_sizes
        self.live_mode = console.is_terminal if live is None else live
        self.lengths: dict[int, list[int]] = {bs: [] for bs in block_sizes}
        self.sizes: dict[int, list[int]] = {bs: [] for bs in block_sizes}
        self.runs: dict[int | None, list[Run]] = {None: [], **{bs: [] for bs in block_sizes}}
        self.n_equal = self.n_checked = 0
        self.done_prompts = 0
        self.label, self.bs = "warming up", block_sizes[0]
        self.live: Live | None = None

    # -- context --------------------------------------------------------------------------
    def __enter__(self) -> BenchView:
        if self.live_mode:
            self.live = Live(
                self.render(),
                console=self.console,
                refresh_per_second=4,
                transient=True,
                get_renderable=self.render,
            )
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.stop()
            self.live = None

    # -- observer -------------------------------------------------------------------------
    def start(self, bp: BenchPrompt, trial: int, index: int, bs: int | None) -> None:
        kind = "baseline" if bs is None else f"DFlash bs {size_label(bs)}"
        self.label = f"trial {trial + 1} · {bp.title} · {kind}"
        if bs is not None:
            self.bs = bs

    def cycle(self, bs: int, accepted: int, size: int) -> None:
        self.lengths[bs].append(accepted)
        self.sizes[bs].append(size)

    def done(self, run: Run) -> None:
        self.runs[run.block_size].append(run)

    def checked(self, record: dict, greedy: bool) -> None:
        self.done_prompts += 1
        if greedy:
            for run in record["dflash"].values():
                self.n_checked += 1
                self.n_equal += run.tokens == record["baseline"].tokens
        if not self.live_mode:
            base = record["baseline"]
            parts = [
                f"[{self.done_prompts}/{self.total}] trial {record['trial'] + 1} "
                f"{readable_id(record['id'])}: baseline {base.decode_tps:.1f} tok/s"
            ]
            for bs in sorted(record["dflash"], key=size_order):
                run = record["dflash"][bs]
                ok = "" if not greedy else (" ✓" if run.tokens == base.tokens else " ✗ MISMATCH")
                parts.append(f"bs {size_label(bs)} {run.decode_tps:.1f} tok/s τ {run.tau:.2f}{ok}")
            self.console.print(" · ".join(parts), highlight=False, soft_wrap=True)

    # -- rendering ------------------------------------------------------------------------
    def tau(self, bs: int) -> float:
        a = self.lengths[bs]
        return sum(a) / len(a) if a else 0.0

    def render(self) -> Panel:
        base = trial_tps(self.runs[None])
        stats = Table.grid(padding=(0, 2))
        stats.add_row(
            "[dim]block[/]",
            "[dim]τ[/]",
            "[dim]DFlash tok/s[/]",
            "[dim]baseline tok/s[/]",
            "[dim]speedup[/]",
        )
        for bs in self.block_sizes:
            dfl = trial_tps(self.runs[bs])
            speed = f"{dfl / base:.2f}×" if base > 0 and dfl > 0 else "–"
            mark = "▸" if bs == self.bs else " "
            stats.add_row(
                f"{mark}{size_label(bs)}", f"{self.tau(bs):.2f}", f"{dfl:.1f}", f"{base:.1f}", speed
            )
        lossless = f"lossless {self.n_equal}/{self.n_checked}" if self.n_checked else ""
        drafted = drafting(self.lengths[self.bs], self.sizes[self.bs])
        width = max(self.sizes[self.bs], default=1) if self.bs == AUTO else self.bs
        hist = histogram(drafted, width)
        bar = Table.grid()  # a bare ProgressBar ends without a newline: the next row would
        bar.add_row(
            ProgressBar(total=max(self.total, 1), completed=self.done_prompts, width=60)
        )  # start on its line
        return Panel(
            Group(
                Text.assemble(
                    ("prompts ", "dim"),
                    f"{self.done_prompts}/{self.total}  ",
                    (self.label, "cyan"),
                    f"  {lossless}",
                ),
                bar,
                stats,
                Text(
                    f"acceptance histogram, block {size_label(self.bs)} "
                    "(tokens per drafting cycle)",
                    style="dim",
                ),
                Text("\n".join(bars(hist))),
            ),
            title="dflash-mac bench",
            expand=False,
        )


def print_acceptance(console: Console, doc: dict) -> None:
    """The end-of-run picture per block size: histogram, prefix survival P(A ≥ k) and the
    per-position acceptance curve, as bars."""
    for row in doc["rows"]:
        if row["suite"] != "all" and any(r["suite"] == "all" for r in doc["rows"]):
            continue
        bs = row["block_size"]
        console.print(
            f"[bold]block size {size_label(bs)}[/] · {row['suite']} · τ {row['tau'][0]:.2f} · "
            f"{row['cycles']} cycles{plain_note(row)} · speedup {row['speedup'][0]:.2f}×"
            f"{eta_note(row, ' · ')}",
            highlight=False,
        )
        console.print("[dim]acceptance histogram (tokens per drafting cycle)[/]")
        for line in bars(row["histogram"]):
            console.print(line, highlight=False)
        console.print("[dim]prefix survival P(A ≥ k), %[/]")
        for line in bars([round(100 * s) for s in row["survival"]]):
            console.print(line, highlight=False)
        console.print("[dim]draft position k accepted given 1..k-1 accepted, %[/]")
        for line in bars([round(100 * p) for p in row["position_acceptance"]]):
            console.print(line, highlight=False)
