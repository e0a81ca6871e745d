"""launch/train.py's RunLog: a continued run (trainer.resume=auto into the same run directory)
keeps the run's first config.yaml and writes its own, when it differs, next to it as
config.resumed_<step>.yaml, logging the settings that changed."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch import train

FIRST = "trainer:\n  steps: 300\n  lr: 0.1\nloka:\n  enabled: true\n"
MORE_STEPS = "trainer:\n  steps: 600\n  lr: 0.1\nloka:\n  enabled: true\n"


def _attempt(run: Path, config_yaml: str, *, step: int) -> None:
    """One launch of the job into `run`: the trainer's hooks as it calls them (rank 0)."""
    log = train.LogFile(rank=0)
    callback = train.RunLog(log, config_yaml)
    trainer = SimpleNamespace(out_dir=run, rank=0, step=step)
    callback.on_before_shard(trainer)
    callback.on_train_start(trainer)
    log.close()


def test_a_continued_run_keeps_the_first_config_and_writes_its_own_next_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _attempt(tmp_path, FIRST, step=0)
    assert (tmp_path / "config.yaml").read_text() == FIRST
    with caplog.at_level(logging.WARNING):
        _attempt(tmp_path, MORE_STEPS, step=300)
    assert (tmp_path / "config.yaml").read_text() == FIRST
    assert (tmp_path / "config.resumed_00000300.yaml").read_text() == MORE_STEPS
    assert "trainer.steps: 300 -> 600" in caplog.text and "config.resumed_00000300.yaml" in caplog.text
    assert "trainer.lr" not in caplog.text


def test_a_continued_run_with_the_same_config_writes_nothing_new(tmp_path: Path) -> None:
    _attempt(tmp_path, FIRST, step=0)
    _attempt(tmp_path, FIRST, step=300)
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config.yaml"]


def test_changed_settings_names_added_and_removed_keys() -> None:
    assert train.changed_settings("a:\n  b: 1\n", "a:\n  c: 2\n") == ["a.b: 1 -> (unset)", "a.c: (unset) -> 2"]
