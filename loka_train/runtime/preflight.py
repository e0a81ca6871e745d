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
from loka_train.runtime.checkpoint import CheckpointError, is_per_rank_format, per_rank_format_fix
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


_RESUME_SETTINGS = {"model": "model", "sharding": "trainer.sharding"}
"""Checkpoint meta that must match the run that resumes it, and the setting each one is."""


def check_resumable(path: Path, cfg: TrainerConfig, *, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise a `CheckpointError` naming the checkpoint and the fix when checkpoint `path`
    (its meta.json: `saved`) cannot continue into this run (`now`: this run's ``world_size``,
    ``model``, ``sharding`` and ``batch_size``, where known; ``trainer.steps`` from `cfg`).

    A checkpoint resumes on any number of processes (except one of the per-rank format, which
    needs the number that wrote it); with another number, ``trainer.batch_size`` may change
    too, and a run that keeps the global batch (processes x ``trainer.batch_size``) trains on
    the samples the uninterrupted run would have (they are a function of the step and the
    global batch). A global batch that changes is logged.

    Example:
        >>> check_resumable(path, cfg, saved=read_meta(path), now={"world_size": 2, "batch_size": 256})
    """
    fresh = "or start a new run with trainer.resume=never"
    world = now.get("world_size")
    if world is not None and saved.get("world_size") != world and is_per_rank_format(saved):
        raise CheckpointError(per_rank_format_fix(path, saved.get("world_size")))
    for key, setting in _RESUME_SETTINGS.items():
        if key in now and saved.get(key) != now[key]:
            raise CheckpointError(
                f"checkpoint {path} was written with {setting}={saved.get(key)}, this run has "
                f"{setting}={now[key]}: resume it with {setting}={saved.get(key)}, {fresh}"
            )
    saved_batch, saved_world = saved.get("batch_size"), saved.get("world_size")
    if "batch_size" in now and (world is None or world == saved_world) and saved_batch != now["batch_size"]:
        raise CheckpointError(
            f"checkpoint {path} was written with trainer.batch_size={saved_batch}, this run has "
            f"trainer.batch_size={now['batch_size']}: resume it with trainer.batch_size={saved_batch}, {fresh}"
        )
    if "batch_size" in now and world is not None and world != saved_world and isinstance(saved_batch, int):
        _log_global_batch(path, saved_world, saved_batch, world, now["batch_size"])
    step = saved.get("step")
    if isinstance(step, int) and step > cfg.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, past trainer.steps={cfg.steps}: "
            "this run has nothing to train and would report steps it did not run. Set "
            f"trainer.steps to {step} or more to continue that run, {fresh}"
        )


def _log_global_batch(path: Path, saved_world: Any, saved_batch: int, world: int, batch: int) -> None:
    """Log what a resume on another number of processes does to the global batch."""
    before, after = saved_world * saved_batch, world * batch
    if before == after:
        logger.info("resuming %s on %d processes x trainer.batch_size=%d: the same global batch of %d as "
                    "the %d x %d that wrote it", path, world, batch, after, saved_world, saved_batch)
        return
    per_rank = before // world if before % world == 0 else None
    keep = f" (trainer.batch_size={per_rank} keeps it)" if per_rank else ""
    logger.warning(
        "resuming %s on %d processes x trainer.batch_size=%d changes the global batch from %d to %d%s: "
        "each step from here trains on other samples than the run that wrote it would have, so "
        "the losses do not continue that run's", path, world, batch, before, after, keep,
    )
