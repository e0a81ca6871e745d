"""The whole job's configuration and the function that runs it (no hydra here).

`launch/train.py` turns the hydra YAML into a `JobConfig` and calls `run_job`; a user's
own script can build a `JobConfig` in Python and call `run_job` the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.runtime.callbacks import Callback
from loka_train.runtime.config import TrainerConfig
from loka_train.runtime.loka_config import LokaConfig

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class JobConfig:
    """Everything a training job needs: model, data, trainer and the LoKA plugin.

    Example:
        >>> run_job(JobConfig(trainer=TrainerConfig(steps=20)))
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    """The DLRM-family model (conf/model/*.yaml)."""

    data: DataConfig = field(default_factory=DataConfig)
    """The dataset (conf/data/*.yaml)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop (conf/trainer/*.yaml)."""

    loka: LokaConfig = field(default_factory=LokaConfig)
    """The LoKA plugin (conf/loka/*.yaml); the library default changes no numerics."""


def make_callbacks(job: JobConfig) -> list[Callback]:
    """The callbacks a job runs with: the LoKA callback when `loka.enabled`."""
    if not job.loka.enabled:
        return []
    from loka_train.runtime.loka import LokaCallback

    return [LokaCallback(job.loka)]


def run_job(job: JobConfig) -> dict[str, Any]:
    """Train as `job` says; returns the run summary (printed on rank 0)."""
    from loka_train.runtime.trainer import Trainer, format_summary

    trainer = Trainer(
        model=job.model, data=job.data, trainer=job.trainer, callbacks=make_callbacks(job)
    )
    try:
        summary = trainer.fit()
        if trainer.rank == 0:
            print(f"\nrun summary ({trainer.out_dir}/summary.json)\n{format_summary(summary)}")
        return summary
    finally:
        trainer.close()
