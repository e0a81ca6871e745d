"""What the Trainer checks before it trains or writes anything: settings against the resolved
device, data that cannot last the run, a checkpoint that cannot continue into it (errors that
name the fix).

Example:
    >>> check_cuda_graphs(trainer_cfg, torch.device("cpu"))               # raises ValueError
    >>> check_eval_data(eval_data, trainer_cfg, data_cfg, world_size=2)   # raises ValueError
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torchrec.datasets.utils import Batch

from loka_train.data import DataConfig
from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.config import TrainerConfig

logger = logging.getLogger(__name__)

__all__ = ["FiniteData", "check_cuda_graphs", "check_eval_data", "check_resumable", "short_data_error"]


def check_cuda_graphs(cfg: TrainerConfig, device: torch.device) -> None:
    """``trainer.cuda_graphs`` against the device the run resolved ``trainer.device`` to (the one
    check of that setting: ``auto`` resolves to the CPU on a machine without CUDA)."""
    if cfg.cuda_graphs and device.type != "cuda":
        raise ValueError(
            f"trainer.cuda_graphs=true needs a CUDA device, this run is on {device}: "
            "set trainer.cuda_graphs=false"
        )


@runtime_checkable
class FiniteData(Protocol):
    """A dataset that ends (Criteo files); synthetic data is endless and has no `num_steps`."""

    def num_steps(self) -> int:
        """Full global batches in the data."""
        ...

    def batch(self, step: int) -> Batch:
        """The local batch of `step`; raises IndexError when the data ends before it."""
        ...


def short_data_error(
    cfg: TrainerConfig, world_size: int, *, needed: int, have: int, needed_key: str, source_key: str,
    source: object,
) -> ValueError:
    """The error of data (`source_key` = `source`) that holds `have` global batches where
    `needed_key` = `needed` needs more: it names the settings that fix it."""
    global_batch = cfg.batch_size * world_size
    lower = f"lower {needed_key} to {have} or less, " if have else ""
    return ValueError(
        f"{needed_key}={needed} needs {needed} full global batches of {global_batch} "
        f"samples ({world_size} ranks x trainer.batch_size={cfg.batch_size}), "
        f"but {source_key}={source!r} holds only {have}: {lower}lower "
        f"trainer.batch_size, or point {source_key} at more data"
    )


def check_eval_data(data: object, cfg: TrainerConfig, data_cfg: DataConfig, *, world_size: int) -> None:
    """Raise :func:`short_data_error` when finite eval `data` holds fewer than
    ``trainer.eval_batches`` batches (endless data passes)."""
    if not isinstance(data, FiniteData):
        return  # endless (synthetic) data
    needed = cfg.eval_batches
    try:
        data.batch(needed - 1)
    except IndexError:
        raise short_data_error(
            cfg, world_size, needed=needed, have=data.num_steps(), needed_key="trainer.eval_batches",
            source_key="data.eval_path", source=data_cfg.eval_path,
        ) from None


_RESUME_SETTINGS = {"model": "model", "sharding": "trainer.sharding", "batch_size": "trainer.batch_size"}
"""Checkpoint meta that must match the run that resumes it, and the setting each one is."""


def check_resumable(path: Path, cfg: TrainerConfig, *, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise a `CheckpointError` naming the checkpoint and the fix when checkpoint `path`
    (its meta.json: `saved`) cannot continue into this run (`now`: this run's ``world_size``,
    ``model``, ``sharding`` and ``batch_size``, where known; ``trainer.steps`` from `cfg`).

    Example:
        >>> check_resumable(path, cfg, saved=read_meta(path), now={"world_size": 2, "batch_size": 256})
    """
    fresh = "or start a new run with trainer.resume=never"
    if "world_size" in now and saved.get("world_size") != now["world_size"]:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved.get('world_size')} processes, this run has "
            f"{now['world_size']}: resume it with {saved.get('world_size')} processes, {fresh}"
        )
    for key, setting in _RESUME_SETTINGS.items():
        if key in now and saved.get(key) != now[key]:
            raise CheckpointError(
                f"checkpoint {path} was written with {setting}={saved.get(key)}, this run has "
                f"{setting}={now[key]}: resume it with {setting}={saved.get(key)}, {fresh}"
            )
    step = saved.get("step")
    if isinstance(step, int) and step > cfg.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, past trainer.steps={cfg.steps}: "
            "this run has nothing to train and would report steps it did not run. Set "
            f"trainer.steps to {step} or more to continue that run, {fresh}"
        )
