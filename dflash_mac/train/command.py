"""The `dflash-mac train` command (registered in `dflash_mac/cli/__init__.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..prompts import STARTER_PROMPTS, read_prompt_file
from .args import TrainError, TrainingArgs
from .callback import StepReport, TrainingCallback

FEW_PROMPTS = 500  # below this a drafter stays weak (docs/training.md, "How much data")


def recipe(name: str) -> object:
    """`TrainingArgs`' default for a field: the recipe lives there, the flags show it."""
    f = TrainingArgs.__dataclass_fields__[name]
    value = f.default_factory() if callable(f.default_factory) else f.default
    return ",".join(map(str, value)) if isinstance(value, list) else value


def train(
    target: str = typer.Option(
        ...,
        "--target",
        "-m",
        help="Target model: pair name, local folder or Hugging Face id (mlx-lm).",
    ),
    data: Path = typer.Option(
        STARTER_PROMPTS,
        "--data",
        help='Prompts JSONL: {"messages": [...]} or {"text"|"prompt": ...} per line; the '
        "target answers them. Default: the 48 shipped starter prompts (a first try; a useful "
        "drafter needs thousands, docs/training.md).",
        show_default=False,
    ),
    fixed: list[Path] = typer.Option(
        [],
        "--fixed-text",
        help='Fixed text taught teacher-forced, no generation: JSONL of {"messages": [...], '
        '"answer": "..."}; the drafter learns the target\'s own predictions on the answer. '
        "Repeat for several files.",
        show_default=False,
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output drafter folder (z-lab format)."),
    force: bool = typer.Option(
        False, "--force", help="Overwrite the drafter already in --out (else refused)."
    ),
    block_size: int = typer.Option(
        recipe("block_size"), "--block-size", "-b", help="Trained block size."
    ),
    layers: int = typer.Option(recipe("num_layers"), "--layers", help="Drafter decoder layers."),
    target_layer_ids: str | None = typer.Option(
        None,
        "--target-layer-ids",
        help="Comma-separated target layers to read features from (default: uniform "
        "between layer 1 and L-3).",
    ),
    arch: str = typer.Option(
        recipe("arch"),
        "--arch",
        help="Drafter architecture: dflash or dflash2 (convs + candidate selector, selector loss).",
    ),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps (overrides --epochs)."),
    epochs: float = typer.Option(6.0, "--epochs", help="Passes over the sequences."),
    minutes: float | None = typer.Option(
        None,
        "--minutes",
        help="Wall-clock cap on training (fixes the step count from the first steps' speed).",
    ),
    lr: float = typer.Option(6e-4, "--lr", help="Peak AdamW learning rate (cosine, 4% warmup)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    anchors: int = typer.Option(
        512, "--anchors", help="Random anchors (blocks) per sequence, at most."
    ),
    max_length: int = typer.Option(3072, "--max-length", help="Sequence length cap (tokens)."),
    intermediate_size: int | None = typer.Option(
        None, "--intermediate-size", help="Drafter MLP width (default: target's)."
    ),
    mask_token_id: int | None = typer.Option(
        None, "--mask-token-id", help="Mask token id when the tokenizer has no <|mask|> token."
    ),
    gen_max_tokens: int = typer.Option(
        256, "--gen-max-tokens", help="Max tokens of each regenerated response."
    ),
    temp: str = typer.Option(
        "0",
        "--temp",
        help="Regeneration temperature(s), comma-separated: each prompt is answered once at "
        "each (0 = greedy; e.g. 0,0.7 for greedy and sampled answers).",
    ),
    loss: str = typer.Option(
        recipe("loss"),
        "--loss",
        help="ce (data tokens), kl (KL(p_T || q) to the target's soft labels) or mix.",
    ),
    kl_temperature: str = typer.Option(
        recipe("kl_temperatures"),
        "--kl-temperature",
        help="Temperature(s) T of the KL targets p_T, comma-separated (averaged).",
    ),
    kl_weight: float = typer.Option(
        recipe("kl_weight"), "--kl-weight", help="Share of the KL in --loss mix: (1-w)·CE + w·KL."
    ),
    top_k_soft: int = typer.Option(
        32, "--top-k-soft", help="Soft labels: top-k of p_T plus one tail bucket."
    ),
    draft_vocab: int | None = typer.Option(
        None,
        "--draft-vocab",
        help="Draft over the K token ids the target's answers use most (e.g. 8192): a K-row "
        "head, several times cheaper to train and to run; verification keeps the whole "
        "vocabulary, so output is unchanged.",
    ),
    gen_batch_size: int = typer.Option(
        32, "--gen-batch-size", help="Prompts decoded together while regenerating."
    ),
    limit: int | None = typer.Option(
        None, "--limit", help="Use N prompts, evenly spread over the file."
    ),
    eval_prompts: Path | None = typer.Option(
        None,
        "--eval-prompts",
        help="Held-out prompts JSONL: τ, per-position acceptance and speedup at the end.",
    ),
    eval_max_tokens: int = typer.Option(256, "--eval-max-tokens"),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue from the saved checkpoint (weights, optimizer, step, data order).",
    ),
    save_every: int = typer.Option(100, "--save-every", help="Checkpoint every N steps."),
    seed: int = typer.Option(0, "--seed"),
    cache_dir: Path = typer.Option(
        Path(".cache/dflash-train"), "--cache-dir", help="Regenerated data and checkpoints."
    ),
    dtype: str = typer.Option(
        "float16", "--dtype", help="Saved weights: float16, bfloat16, float32."
    ),
    sliding_window: int | None = typer.Option(
        None,
        "--sliding-window",
        help="Drafter attention sees only the last N positions (bidirectional inside the block).",
    ),
    layer_init: str = typer.Option(
        "random",
        "--layer-init",
        help="random, or target: the drafter's layers start as copies of the target's last "
        "ones (same shape; a head start for small drafters).",
    ),
    init_from: Path | None = typer.Option(
        None, "--init-from", help="Start from this drafter folder (fine-tune; fresh schedule)."
    ),
    cache_features: bool = typer.Option(
        False,
        "--cache-features",
        help="Run the target once per sequence and keep its features (and soft labels) on "
        "disk: later epochs skip the target (n_layers·hidden·4 bytes a token).",
    ),
) -> None:
    """Train a DFlash drafter for TARGET on the target's own answers to --data prompts."""
    check_inputs(data, eval_prompts, init_from, fixed)
    check_out(out, force)
    args = TrainingArgs(
        target=target_source(target),
        prompts=data,
        fixed=fixed,
        out_dir=out,
        block_size=block_size,
        num_layers=layers,
        target_layer_ids=layer_ids(target_layer_ids),
        mask_token_id=mask_token_id,
        arch=arch,
        steps=steps,
        epochs=epochs,
        minutes=minutes,
        lr=lr,
        batch_size=batch_size,
        anchors=anchors,
        max_length=max_length,
        intermediate_size=intermediate_size,
        max_new_tokens=gen_max_tokens,
        temps=floats(temp, "--temp"),
        loss=loss,
        kl_temperatures=floats(kl_temperature, "--kl-temperature"),
        kl_weight=kl_weight,
        top_k_soft=top_k_soft,
        draft_vocab=draft_vocab,
        gen_batch_size=gen_batch_size,
        limit=limit,
        eval_prompts=eval_prompts,
        eval_max_tokens=eval_max_tokens,
        resume=resume,
        seed=seed,
        save_every=save_every,
        cache_dir=cache_dir,
        save_dtype=dtype,
        init_from=init_from,
        sliding_window=sliding_window,
        layer_init=layer_init,
        cache_features=cache_features,
    )
    args.check()
    from .trainer import train_drafter  # mlx-lm and the training code: after the checks

    console = Console(log_path=False)  # lines without source-file tags
    console.print(data_note(data))
    train_drafter(args, ProgressReporter(console))  # user errors: one sentence (cli.main)
    console.print(try_it(target, out, block_size))


def try_it(target: str, out: Path, block_size: int) -> str:
    """The closing hint: the command that decodes with the new drafter."""
    return (
        f"\nTry it:\n  dflash-mac generate --model {target} --draft {out} "
        f'--block-size {min(block_size, 8)} -v "def fibonacci(n):"'
    )


class ProgressReporter(TrainingCallback):
    """The training loop on a terminal: a progress bar, or a log line every 10 steps when
    the output is not a terminal (logs, nohup)."""

    def __init__(self, console: Console):
        self.console = console
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def log(self, message: str) -> None:
        self.console.log(message)

    def on_start(self, step: int, total: int, losses: list[float]) -> None:
        cols = [
            TextColumn("[bold]drafter"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("acc@1 {task.fields[acc]:.2f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        ]
        self.bar = Progress(*cols, console=self.console, transient=False)
        self.bar.start()
        self.task = self.bar.add_task(
            "train",
            total=total,
            completed=step,
            loss=losses[-1] if losses else float("nan"),
            acc=0.0,
            tps=0.0,
        )

    def on_step(self, r: StepReport) -> None:
        self.bar.update(
            self.task,
            completed=r.step,
            total=r.total,
            loss=float(np.mean(r.losses[-20:])),
            tps=r.tokens_per_s,
            acc=r.acc[0],
        )
        if not self.console.is_terminal and (r.step % 10 == 0 or r.step == r.total):
            eta = r.run_seconds / max(r.step - r.start, 1) * (r.total - r.step)
            self.console.log(
                f"step {r.step}/{r.total} loss {np.mean(r.losses[-10:]):.3f} acc "
                + " ".join(f"{a:.2f}" for a in r.acc)
                + f" | {r.tokens_per_s:,.0f} tok/s | ETA {eta / 60:.1f} min"
            )

    def on_end(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def data_note(data: Path) -> str:
    """What --data holds, and whether it is enough for a drafter that pays."""
    n = len(read_prompt_file(data))  # a bad line: one sentence, before the target loads
    what = "the shipped starter prompts" if data == STARTER_PROMPTS else str(data)
    note = f"--data: {what}, {n} prompts."
    if n < FEW_PROMPTS:
        note += (
            " Enough to try the pipeline; a drafter that pays needs thousands "
            '(docs/training.md, "How much data").'
        )
    return note


def floats(text: str, flag: str) -> list[float]:
    """Comma-separated numbers of a flag, or one clear sentence."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out:
        raise TrainError(f"{flag} must be a number or comma-separated numbers, e.g. 0,0.7.")
    return out


def check_inputs(
    data: Path, eval_prompts: Path | None, init_from: Path | None, fixed: list[Path] = ()
) -> None:
    """Fail in one sentence, before the target loads, on input paths that are not there."""
    files = [("--data", data), ("--eval-prompts", eval_prompts)]
    for flag, path in files + [("--fixed-text", f) for f in fixed]:
        if path is not None and not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            kind = "fixed text" if flag == "--fixed-text" else "prompts"
            raise TrainError(f"{flag} {path} {what}; pass a JSONL file of {kind}.")
    if init_from is not None and not (init_from / "config.json").is_file():
        raise TrainError(f"--init-from {init_from} is not a drafter folder (no config.json).")


def target_source(target: str) -> str:
    """A pair name (`bundled`, `qwen3-8b`) as the target it loads, as every other command
    takes it; folders and Hub ids as given."""
    from dflash_mac.loading.registry import load_registry

    entry = load_registry().get(target)
    return entry.target_source() if entry is not None and not Path(target).exists() else target


def check_out(out: Path, force: bool) -> None:
    """Refuse to overwrite what --out already holds (a trained drafter) unless --force."""
    if out.is_file():
        raise TrainError(f"--out {out} is a file; pass a folder for the drafter.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise TrainError(
            f"--out {out} already exists and is not empty; pass --force to overwrite it, "
            "or another folder."
        )


def layer_ids(text: str | None) -> list[int] | None:
    """--target-layer-ids as integers (None: the default spread), or one clear sentence."""
    if not text:
        return None
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise TrainError("--target-layer-ids must be comma-separated integers, e.g. 1,9,17.")
    return ids
