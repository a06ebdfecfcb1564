"""`dflash-mac train`: train a DFlash drafter for any mlx-lm target (docs/design.md §10)."""

from .args import TrainError, TrainingArgs
from .loop import StepReport, TrainingCallback
from .trainer import train_drafter

__all__ = ["StepReport", "TrainError", "TrainingArgs", "TrainingCallback", "train_drafter"]
