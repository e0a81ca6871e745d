"""The whole job: its configuration and the function that runs it (no hydra here).

The composition root above the runtime and the plugin: it wires the LoKA callback into a
`Trainer`. `launch/train.py` turns the hydra YAML into a `JobConfig` and calls `run_job`; a
user's own script can build a `JobConfig` in Python and call `run_job` the same way.

Example:
    >>> from loka_train.job import JobConfig, run_job
    >>> from loka_train.runtime import TrainerConfig
    >>> summary = run_job(JobConfig(trainer=TrainerConfig(steps=20)))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.plugin.config import LokaConfig
from loka_train.runtime.callbacks import Callback
from loka_train.runtime.config import TrainerConfig

logger = logging.getLogger(__name__)

__all__ = ["JobConfig", "make_callbacks", "run_job"]


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
    from loka_train.plugin.callback import LokaCallback

    return [LokaCallback(job.loka)]


def run_job(job: JobConfig, *, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Train as `job` says, with `callbacks` (a launcher's, e.g. its log file) ahead of the job's
    own; returns the run summary (printed on rank 0)."""
    from loka_train.plugin.report import summary_rows
    from loka_train.runtime.summary import format_summary
    from loka_train.runtime.trainer import Trainer

    trainer = Trainer(
        model=job.model, data=job.data, trainer=job.trainer, callbacks=[*callbacks, *make_callbacks(job)]
    )
    try:
        summary = trainer.fit()
        if trainer.rank == 0:
            table = format_summary(summary, summary_rows(summary))
            print(f"\nrun summary ({trainer.out_dir}/summary.json)\n{table}")
        return summary
    finally:
        trainer.close()
