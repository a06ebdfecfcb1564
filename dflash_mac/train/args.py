"""What a training run is given (`TrainingArgs`) and what its checkpoints must agree on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_mac.errors import UserError

from .soft import LOSS_KINDS, LossSpec

ARCHS = ("dflash", "dflash2")
LAYER_INITS = ("random", "target")  # drafter layers: MLX's init, or the target's last layers


class TrainError(UserError, ValueError):
    """A training setup that cannot work."""


@dataclass
class TrainingArgs:
    """Everything `dflash-mac train` is told: paths, drafter shape, schedule, data, evaluation."""

    target: str  # target model: local folder or Hugging Face id
    prompts: Path  # prompts JSONL the target answers
    out_dir: Path  # drafter folder written at the end (z-lab format)
    # drafter
    # the defaults are the recipe of the default pair's drafter (docs/training.md)
    block_size: int = 8  # trained block size
    num_layers: int = 1  # drafter decoder layers
    target_layer_ids: list[int] | None = None  # None: uniform between layer 1 and L-3
    mask_token_id: int | None = None  # needed when the tokenizer has no <|mask|> token
    arch: str = "dflash2"  # "dflash" or "dflash2"
    intermediate_size: int | None = None  # drafter MLP width; None: the target's
    sliding_window: int | None = None  # windowed drafter attention
    layer_init: str = "random"  # "target": the drafter's layers start as the target's last ones
    # length and optimisation
    steps: int | None = None  # optimizer steps; None: `epochs` passes over the sequences
    epochs: float = 6.0
    minutes: float | None = None  # wall-clock cap, fixed from the first steps' speed
    lr: float = 6e-4  # peak AdamW learning rate (warmup, then cosine)
    batch_size: int = 4  # sequences per step
    anchors: int = 512  # random blocks per sequence, at most
    max_length: int = 3072  # sequence length cap (tokens)
    seed: int = 0
    # regeneration of the training responses by the target
    max_new_tokens: int = 256
    temp: float = 0.0
    temps: list[float] | None = None  # several regeneration temperatures (overrides temp)
    gen_batch_size: int = 32
    limit: int | None = None  # use N prompts, evenly spread over the file
    # held-out evaluation after training
    eval_prompts: Path | None = None
    eval_max_tokens: int = 256
    eval_limit: int | None = None
    # checkpoints and output
    resume: bool = False  # continue from the checkpoint in `cache_dir`
    save_every: int = 100  # checkpoint every N steps
    cache_dir: Path = Path(".cache/dflash-train")  # regenerated data and checkpoints
    save_dtype: str = "float16"  # saved weights: float16, bfloat16 or float32
    init_from: Path | None = None  # fine-tune this drafter folder (fresh schedule)
    # run the frozen target once per sequence and keep its features on disk (`features.py`)
    cache_features: bool = False
    # loss (docs/training.md, "Losses"): ce | kl | mix of both
    loss: str = "mix"
    kl_temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])
    kl_weight: float = 0.7  # mix: (1 - w)·CE + w·KL
    top_k_soft: int = 32  # soft labels: top-k of p_T + a tail bucket
    # draft over the K target ids most frequent in the target's answers (`vocab.py`); None:
    # the whole vocabulary
    draft_vocab: int | None = None
    extra_prompts: list[Path] = field(default_factory=list)  # more prompts files, answered too
    # more prompts files answered once each at `sampled_temp`, with seed 0 (whatever `seed`:
    # the answers stay cached across training seeds)
    sampled_prompts: list[Path] = field(default_factory=list)
    sampled_temp: float = 0.7
    # fixed-text files taught teacher-forced, no generation (`data.load_fixed`)
    fixed: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.target = str(self.target)
        self.prompts, self.out_dir = Path(self.prompts), Path(self.out_dir)
        self.extra_prompts = [Path(p) for p in self.extra_prompts]
        self.sampled_prompts = [Path(p) for p in self.sampled_prompts]
        self.fixed = [Path(p) for p in self.fixed]
        self.cache_dir = Path(self.cache_dir or ".cache/dflash-train")
        if self.eval_prompts is not None:
            self.eval_prompts = Path(self.eval_prompts)
        if self.init_from is not None:
            self.init_from = Path(self.init_from)

    def check(self) -> None:
        """Raise `TrainError` for settings that cannot train."""
        if self.arch not in ARCHS:
            raise TrainError(
                f"--arch {self.arch} is not supported yet (choose from {', '.join(ARCHS)})."
            )
        if self.layer_init not in LAYER_INITS:
            raise TrainError(
                f"--layer-init must be one of {', '.join(LAYER_INITS)} (got {self.layer_init})."
            )
        if self.block_size < 2:
            raise TrainError(f"--block-size must be at least 2 (got {self.block_size}).")
        if self.loss not in LOSS_KINDS:
            raise TrainError(f"--loss must be one of {', '.join(LOSS_KINDS)} (got {self.loss}).")
        if not self.kl_temperatures or min(self.kl_temperatures) <= 0:
            raise TrainError("--kl-temperature must be positive (e.g. 0.7 or 0.7,1.0).")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise TrainError(f"--kl-weight must be in [0, 1] (got {self.kl_weight}).")
        if self.top_k_soft < 1:
            raise TrainError(f"--top-k-soft must be at least 1 (got {self.top_k_soft}).")
        if self.draft_vocab is not None and self.draft_vocab < 16:
            raise TrainError(f"--draft-vocab must be at least 16 (got {self.draft_vocab}).")
        if any(t < 0 for t in self.regen_temps):
            raise TrainError("--temp must be >= 0.")

    @property
    def prompt_files(self) -> list[Path]:
        return [self.prompts, *self.extra_prompts]

    @property
    def parts(self) -> list[tuple[Path, float, int]]:
        """(prompts file, temperature, seed) of every answered part of the data."""
        parts = [(p, t, self.seed) for p in self.prompt_files for t in self.regen_temps]
        return parts + [(p, self.sampled_temp, 0) for p in self.sampled_prompts]

    @property
    def data_temps(self) -> list[float]:
        """The temperatures the data was answered at."""
        return sorted({t for _, t, _ in self.parts})

    @property
    def regen_temps(self) -> list[float]:
        """Regeneration temperatures: every prompt is answered once at each."""
        return list(self.temps) if self.temps else [self.temp]

    @property
    def loss_spec(self) -> LossSpec:
        return LossSpec(self.loss, tuple(self.kl_temperatures), self.kl_weight, self.top_k_soft)

    @property
    def checkpoint_dir(self) -> Path:
        """Resumable state; a fine-tune keeps its own so it never clobbers the base run's."""
        return self.cache_dir / ("checkpoint-finetune" if self.init_from else "checkpoint")


@dataclass
class TrainSettings:
    """Everything that determines the training run (stored in the checkpoint)."""

    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = -1
    arch: str = "dflash"
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    batch_size: int = 4
    anchors: int = 512
    max_length: int = 3072
    seed: int = 0
    intermediate_size: int | None = None
    sliding_window: int | None = None
    loss: dict = field(default_factory=lambda: {"loss": "ce"})  # LossSpec.describe()
    draft_vocab: int | None = None
    layer_init: str = "random"
