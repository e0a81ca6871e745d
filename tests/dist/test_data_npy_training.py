"""A 1-process training run through the Trainer on preprocessed Criteo day files
(day_{i}_{dense,sparse,labels}.npy, or the multi-hot day_{i}_sparse_multi_hot.npz) written
into tmp_path."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from loka_train.data import DataConfig
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, tiny_model, tiny_trainer
from tests.unit.test_data_criteo_npy import write_days


def _train_on_days(rank: int, world_size: int, root: str, multi_hot: bool) -> tuple[list[float], dict[str, Any]]:
    data = DataConfig(
        kind="criteo_npy", path=root, train_days=[0, 1], eval_day=2, num_sparse=4, num_embeddings=50,
        multi_hot=multi_hot,
    )
    recorder = LossRecorder()
    trainer = Trainer(
        model=tiny_model(), data=data,
        trainer=tiny_trainer(Path(root) / "run", steps=5, batch_size=16, eval_batches=2),
        callbacks=[recorder],
    )
    return recorder.losses, trainer.fit()


@pytest.mark.parametrize("multi_hot", [False, True])
def test_trainer_runs_on_npy_days(tmp_path: Path, multi_hot: bool) -> None:
    # 5 steps of 16 rows over days 0 (50 rows) and 1 (40 rows); eval on day 2 (2 batches of 16)
    write_days(tmp_path, {0: 50, 1: 40, 2: 32}, num_sparse=4, pooling=[1, 3, 2, 4] if multi_hot else None)
    [(losses, summary)] = run_multiprocess(
        _train_on_days, world_size=1, args=(str(tmp_path), multi_hot), timeout=120
    )
    assert len(losses) == 5 and all(math.isfinite(x) and x > 0 for x in losses), losses
    assert summary["steps"] == 5
    assert math.isfinite(summary["eval/ne"]) and 0.0 <= summary["eval/auc"] <= 1.0, summary
