"""Run directories: one per run, `latest` pointing at the newest, resume finding its checkpoint,
old runs pruned up to `keep`, nothing changed on disk by planning."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.rundirs import RunDirs, RunStart, find_checkpoint

NOON = time.mktime((2026, 11, 25, 12, 0, 0, 0, 0, -1))


def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint as CheckpointManager leaves it (meta.json and the `latest` pointer)."""
    path = run / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 1}))
    (run / "checkpoints" / "latest").write_text(path.name)
    return path


def _new_run(runs: RunDirs, at: float = NOON) -> Path:
    return runs.open(runs.plan("never"), now=at)


def test_each_run_gets_its_own_directory_and_latest_points_at_it(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path / "runs", keep=10)
    first = _new_run(runs)
    assert first == tmp_path / "runs" / "20261125-120000" and first.is_dir()
    assert (tmp_path / "runs" / "latest").is_symlink()
    assert os.readlink(tmp_path / "runs" / "latest") == first.name  # relative: the root can move
    second = _new_run(runs)  # the same second: a suffix, never the first run's directory
    assert second.name == "20261125-120000-1"
    assert runs.latest() == second
    assert list(second.iterdir()) == [], "a new run starts empty: nothing of an earlier run in it"


def test_planning_changes_nothing_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for resume in ("never", "auto"):
        assert RunDirs(root, keep=1).plan(resume) == RunStart(run_dir=None, checkpoint=None)
    assert not root.exists()


def test_resume_auto_continues_the_latest_run_in_its_directory(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path, keep=10)
    run = _new_run(runs)
    assert runs.plan("auto") == RunStart(run_dir=None, checkpoint=None)  # no checkpoint yet
    checkpoint = _checkpoint(run, 40)
    start = runs.plan("auto")
    assert start == RunStart(run_dir=run, checkpoint=checkpoint)
    assert runs.open(start, now=NOON + 60) == run
    assert [p.name for p in runs.runs()] == [run.name], "continuing made no new directory"
    assert runs.plan("must") == start


def test_resume_must_without_a_checkpoint_names_the_fix(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path, keep=10)
    with pytest.raises(CheckpointError, match="trainer.resume=must.*no checkpoint.*trainer.resume=auto or never"):
        runs.plan("must")
    _new_run(runs)
    with pytest.raises(CheckpointError, match=r"the latest run \(.*20261125-120000\)"):
        runs.plan("must")


def test_resume_from_a_path_starts_a_new_run_from_that_checkpoint(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path / "runs", keep=10)
    source = _new_run(runs)
    _checkpoint(source, 10)
    newest = _checkpoint(source, 20)
    (source / "checkpoints" / "latest").write_text(newest.name)
    for given in (newest, source / "checkpoints", source, tmp_path / "runs"):
        assert find_checkpoint(given) == newest, given
    older = source / "checkpoints" / "step_00000010"
    start = runs.plan(str(older))
    assert start == RunStart(run_dir=None, checkpoint=older)
    new = runs.open(start, now=NOON + 60)
    assert new != source and runs.latest() == new


def test_a_resume_path_without_a_checkpoint_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for given in (tmp_path / "empty", tmp_path / "nowhere", "atuo"):
        with pytest.raises(CheckpointError, match=r"trainer.resume='.*': no checkpoint at .*auto, never or must"):
            RunDirs(tmp_path, keep=10).plan(str(given))


def test_old_runs_beyond_keep_are_deleted_oldest_first(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path, keep=3)
    made = [_new_run(runs, NOON + 60 * i) for i in range(5)]
    (tmp_path / "notes").mkdir()  # not named like a run: never counted, never deleted
    (tmp_path / "gpu").mkdir()
    assert runs.runs() == made[-3:]
    assert not made[0].exists() and not made[1].exists()
    assert (tmp_path / "notes").is_dir() and (tmp_path / "gpu").is_dir()
    everything = RunDirs(tmp_path, keep=0)
    for i in range(3):
        _new_run(everything, NOON + 3600 + i)
    assert len(everything.runs()) == 6


def test_the_run_a_checkpoint_is_resumed_from_is_never_deleted(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path, keep=2)
    oldest = _new_run(runs, NOON)
    checkpoint = _checkpoint(oldest, 5)
    _new_run(runs, NOON + 60)
    new = runs.open(runs.plan(str(oldest)), now=NOON + 120)
    assert checkpoint.is_dir() and new.is_dir()
    assert runs.runs() == [oldest, new], "the run between them went instead"


def test_latest_is_a_file_where_symlinks_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", refused)
    runs = RunDirs(tmp_path, keep=10)
    caplog.set_level(logging.WARNING, logger="loka_train.runtime.rundirs")
    run = _new_run(runs)
    assert "symbolic links are not allowed" in caplog.text
    pointer = tmp_path / "latest"
    assert pointer.is_file() and not pointer.is_symlink() and pointer.read_text().strip() == run.name
    checkpoint = _checkpoint(run, 3)
    assert runs.plan("auto") == RunStart(run_dir=run, checkpoint=checkpoint)
    assert find_checkpoint(tmp_path) == checkpoint
    newer = _new_run(runs, NOON + 1)
    assert pointer.read_text().strip() == newer.name
    # A fallback: counted (the trainer lists runs.fallbacks in the run's summary), logged once.
    assert len(runs.fallbacks) == 1 and "symbolic links are not allowed" in runs.fallbacks[0]
    assert caplog.text.count("symbolic links are not allowed") == 1


def test_a_run_written_into_latest_itself_is_kept_as_a_run(tmp_path: Path) -> None:
    legacy = tmp_path / "latest"
    checkpoint = _checkpoint(legacy, 7)
    runs = RunDirs(tmp_path, keep=10)
    assert runs.plan("auto") == RunStart(run_dir=legacy, checkpoint=checkpoint)  # it can continue
    new = _new_run(runs, NOON + 86400)
    [kept] = [r for r in runs.runs() if r != new]
    assert (kept / "checkpoints" / "step_00000007" / "meta.json").is_file()
    assert runs.latest() == new


def test_a_latest_naming_a_deleted_run_is_no_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runs = RunDirs(tmp_path, keep=10)
    run = _new_run(runs)
    run.rmdir()
    with caplog.at_level(logging.WARNING, logger="loka_train.runtime.rundirs"):
        assert runs.latest() is None
        assert runs.plan("auto") == RunStart(run_dir=None, checkpoint=None)
    assert "does not exist" in caplog.text
    assert _new_run(runs, NOON + 5).is_dir()
