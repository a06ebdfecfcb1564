"""`dflash-mac train`: train a DFlash drafter for any mlx-lm target (docs/design.md §10)."""

from .trainer import TrainError, train_drafter

__all__ = ["TrainError", "train_drafter"]
