"""The training loop, the callback seam, checkpoints, metrics and the LoKA callback."""

from loka_train.runtime.callbacks import Callback, CallbackList
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager
from loka_train.runtime.config import TrainerConfig
from loka_train.runtime.context import RunContext
from loka_train.runtime.loka_config import LokaConfig

__all__ = [
    "Callback",
    "CallbackList",
    "CheckpointError",
    "CheckpointManager",
    "LokaConfig",
    "RunContext",
    "TrainerConfig",
]
