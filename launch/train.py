"""Main job entry point: `torchrun ... launch/train.py [hydra overrides]`.

The only module that imports hydra. The YAML under conf/ is validated against the
dataclass schemas (a misspelled key fails composition) and turned into real dataclasses
with `OmegaConf.to_object` before anything runs.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.job import JobConfig, run_job

ConfigStore.instance().store(name="job_schema", node=JobConfig)


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # TorchRec's planner and sharding are chatty at INFO.
    for noisy in ("torchrec", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    _configure_logging()
    try:
        job = OmegaConf.to_object(cfg)
        assert isinstance(job, JobConfig)
        run_job(job)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
