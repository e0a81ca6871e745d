"""The LoKA plugin: one callback (Probe, Mods, Dispatch, comms) for a TorchRec training loop."""

from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import GuardConfig, LokaConfig

__all__ = ["GuardConfig", "LokaCallback", "LokaConfig"]
