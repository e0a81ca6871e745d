"""What the Trainer checks and prepares before it trains: settings against the resolved device,
data that cannot last the run (errors that name the fix), an earlier run's checkpoints.

Example:
    >>> check_cuda_graphs(trainer_cfg, torch.device("cpu"))               # raises ValueError
    >>> check_eval_data(eval_data, trainer_cfg, data_cfg, world_size=2)   # raises ValueError
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torchrec.datasets.utils import Batch

from loka_train.data import DataConfig
from loka_train.runtime._paths import set_aside
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager
from loka_train.runtime.config import TrainerConfig

logger = logging.getLogger(__name__)

__all__ = ["FiniteData", "check_cuda_graphs", "check_eval_data", "check_resumable", "set_aside_earlier_checkpoints", "short_data_error"]


def check_cuda_graphs(cfg: TrainerConfig, device: torch.device) -> None:
    """``trainer.cuda_graphs`` against the device the run resolved ``trainer.device`` to (the one
    check of that setting: ``auto`` resolves to the CPU on a machine without CUDA)."""
    if cfg.cuda_graphs and device.type != "cuda":
        raise ValueError(
            f"trainer.cuda_graphs=true needs a CUDA device, this run is on {device}: "
            "set trainer.cuda_graphs=false"
        )


def set_aside_earlier_checkpoints(checkpoints: CheckpointManager, *, resume: str) -> None:
    """``resume=never`` in an out_dir that holds an earlier run's checkpoints: move them to
    ``checkpoints.before-<time>`` (logged), so this run neither mixes with nor prunes them and
    nothing is lost. The main job can be run again in the same out_dir. Call it on one rank."""
    if resume != "never":
        return
    root = checkpoints.root
    found = checkpoints.existing()
    if not found:
        return
    target = set_aside(root)
    logger.warning(
        "trainer.resume=never: %s held checkpoints of an earlier run (%s%s); moved them to %s "
        "(delete it if unneeded; trainer.resume=auto continues a run instead)",
        root, ", ".join(p.name for p in found[:4]), ", ..." if len(found) > 4 else "", target,
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


def check_resumable(path: Path, cfg: TrainerConfig, *, batch_size: object, step: int) -> None:
    """Raise a `CheckpointError` naming the fix when the checkpoint at `path` (written with
    `batch_size`, at `step`) cannot continue into this run."""
    if batch_size != cfg.batch_size:
        raise CheckpointError(
            f"checkpoint {path} used trainer.batch_size={batch_size}, this run "
            f"{cfg.batch_size}: the data position would not match. Use the same batch "
            "size or trainer.resume=never"
        )
    if step > cfg.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, past trainer.steps={cfg.steps}: "
            "this run has nothing to train and would report steps it did not run. Set "
            f"trainer.steps to {step} or more to continue that run, or start fresh with "
            "trainer.resume=never and another trainer.out_dir"
        )
