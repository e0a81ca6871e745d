"""loka_train.plugin: the LoKA callback, its config and presets, and the run report."""

from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import GuardConfig, LokaConfig

__all__ = ["GuardConfig", "LokaCallback", "LokaConfig"]
