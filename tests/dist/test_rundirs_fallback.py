"""Where ``runs/latest`` cannot be a symbolic link it is a file naming the run: a fallback, so
the run's summary counts it with the others (not only a line in the log)."""

from __future__ import annotations

import os
from pathlib import Path

from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_data, tiny_model, tiny_trainer


def _train_without_symlinks(rank: int, world_size: int, out: str) -> list[str]:
    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(1, "Operation not permitted")

    os.symlink = refused  # this forked process only
    trainer = Trainer(model=tiny_model(), data=tiny_data(), trainer=tiny_trainer(Path(out), steps=2))
    return list(trainer.fit()["fallbacks"])


def test_latest_as_a_file_is_a_fallback_of_the_run(tmp_path: Path) -> None:
    fallbacks = run_multiprocess(_train_without_symlinks, 1, str(tmp_path), timeout=120)[0]
    assert (tmp_path / "latest").is_file() and not (tmp_path / "latest").is_symlink()
    assert [f for f in fallbacks if "symbolic links are not allowed" in f] == [
        f"run directories: symbolic links are not allowed in {tmp_path} (Operation not permitted); "
        f"{tmp_path / 'latest'} is a file naming the latest run instead"
    ], fallbacks
