"""Main job entry point: `torchrun ... launch/train.py [hydra overrides]`.

The only module that imports hydra. The YAML under conf/ is validated against the
dataclass schemas (a misspelled key fails composition) and turned into real dataclasses
with `OmegaConf.to_object` before anything runs.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from loka_train.job import JobConfig, run_job
from loka_train.runtime.checkpoint import CheckpointError

ConfigStore.instance().store(name="job_schema", node=JobConfig)


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    # Our messages at INFO on rank 0; third-party libraries (TorchRec's planner, fbgemm's
    # TBE set-up) only from WARNING up.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("loka_train").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The planner warns about how a Topology is constructed (not actionable for users).
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    # Import-time deprecation notices of fbgemm/torchrec say nothing the user can act on.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


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
