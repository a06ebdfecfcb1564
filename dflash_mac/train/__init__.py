"""`dflash-mac train`: train a DFlash drafter for any mlx-lm target (docs/design.md §10).

The names below load on first use: `dflash-mac train` checks its options before the training
code (MLX, mlx-lm, the target's model code) is imported."""

from importlib import import_module

_HOME = {
    "StepReport": ".callback",
    "TrainError": ".args",
    "TrainingArgs": ".args",
    "TrainingCallback": ".callback",
    "train_drafter": ".trainer",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOME[name], __name__), name)
