"""The training loop, CUDA graphs, checkpoints, metrics and the callback seam (no FP8 here)."""

from loka_train.runtime.callbacks import Callback, CallbackList
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager
from loka_train.runtime.config import TrainerConfig
from loka_train.runtime.context import RunContext
from loka_train.runtime.trainer import Trainer

__all__ = [
    "Callback",
    "CallbackList",
    "CheckpointError",
    "CheckpointManager",
    "RunContext",
    "Trainer",
    "TrainerConfig",
]
