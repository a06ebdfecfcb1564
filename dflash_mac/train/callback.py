"""What the training loop tells its caller: a `StepReport` per step, through a
`TrainingCallback` (no MLX here: the command imports it before it checks its options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepReport:
    """One finished optimizer step."""

    step: int
    total: int
    start: int  # the step this process started from (> 0 after --resume)
    losses: list[float]  # every step's loss so far; the last is this step's
    acc: list[float]  # acceptance per block position on this batch
    tokens_per_s: float  # target tokens per second over the last steps
    run_seconds: float  # wall time since this process started the loop


class TrainingCallback:
    """What the loop tells its caller; every hook does nothing unless overridden."""

    def log(self, message: str) -> None:
        """A one-line note (setup, time budget, saving, evaluation)."""

    def on_start(self, step: int, total: int, losses: list[float]) -> None:
        """The loop starts at `step` of `total` (`losses` of earlier steps when resumed)."""

    def on_step(self, report: StepReport) -> None:
        """A step is done (and checkpointed when due); raising here stops the run."""

    def on_end(self) -> None:
        """The loop is over, normally or by an exception."""
