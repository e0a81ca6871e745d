"""launch/: a config error names the key (and the nearest valid ones) or the preset; a failure is
printed once (rank 0), without a traceback, which goes to the log file; the torchrun wrapper
exits with the failing process's status and names no run log for arguments that are not train.py's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

import launch.train as train
from launch.torchrun import exit_status, run_log
from loka_train.runtime.checkpoint import CheckpointError


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.stepz=5"], "trainer.stepz is not a setting: did you mean trainer.steps?"),
        (["model=dcn", "loka.prob.interval=3"], "did you mean loka.probe.interval?"),
        (["trainr.steps=5"], "did you mean trainer.steps?"),
        (["loka=offf"], "loka=offf is not a preset: did you mean loka=off? the presets of loka are aggressive, off, safe"),
        (["trainer.steps=abc"], "trainer.steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_a_config_error_names_the_key_and_the_fix(overrides: list[str], expected: str) -> None:
    message = train.config_error(overrides)
    assert message is not None and expected in message, message
    assert "To append to your config" not in message and "search path" not in message


def test_a_valid_config_is_no_error() -> None:
    assert train.config_error(["model=dcn", "loka=off", "trainer.steps=5", "+hydra.job.name=x"]) is None


def test_a_user_error_is_printed_once_by_rank_0_with_the_traceback_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = train.LogFile(rank=0)
    log.emit(logging.LogRecord("loka_train.x", logging.INFO, __file__, 1, "held before the run dir", None, None))
    try:
        raise ValueError("trainer.eval_batches=4 needs more data: lower trainer.eval_batches")
    except ValueError as exc:
        with pytest.raises(SystemExit) as info:
            train.fail(exc, rank=0, log=log, out_dir=str(tmp_path / "runs"))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: trainer.eval_batches=4 needs more data: lower trainer.eval_batches\n"
    written = (tmp_path / "runs" / "error.log").read_text()
    assert "held before the run dir" in written and "Traceback" in written and "test_launch_errors.py" in written


def test_other_ranks_leave_the_report_to_rank_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    waited: list[float] = []
    monkeypatch.setattr(train.time, "sleep", waited.append)
    log = train.LogFile(rank=1)
    log.open(tmp_path, "train", append=True)
    with pytest.raises(SystemExit) as info:
        train.fail(CheckpointError("checkpoint x: fix it"), rank=1, log=log)
    assert info.value.code == 2
    # Printed only after the wait (torchrun stops this process once rank 0 exited).
    assert waited == [train.WAIT_FOR_RANK_0_S]
    assert capsys.readouterr().err == "error (rank 1): checkpoint x: fix it\n"
    assert "CheckpointError" in (tmp_path / "train.rank1.log").read_text()


def test_an_unexpected_error_names_its_origin_and_its_log(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log = train.LogFile(rank=0)
    log.open(tmp_path, "train", append=True)
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        with pytest.raises(SystemExit) as info:
            train.fail(exc, rank=0, log=log)
    assert info.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: RuntimeError: boom (at ") and "test_launch_errors.py" in err[0]
    assert err[1] == f"  traceback: {tmp_path / 'train.log'}"
    # A rank whose peer went away waits for the peer's report, as another rank would.
    waited: list[float] = []
    monkeypatch.setattr(train.time, "sleep", waited.append)
    with pytest.raises(SystemExit):
        train.fail(dist.DistBackendError("Connection closed by peer"), rank=0)
    assert waited == [train.WAIT_FOR_RANK_0_S]


def test_the_torchrun_wrapper_exits_with_the_failing_process_status() -> None:
    assert exit_status(2) == 2
    assert exit_status(-15) == 128 + 15  # ended by SIGTERM
    assert exit_status(0) == 1  # a failure is never a success


def test_the_torchrun_wrapper_names_no_run_log_for_arguments_it_cannot_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not launch/train.py's overrides: no log to name, and why is in the wrapper's debug log."""
    with caplog.at_level(logging.DEBUG, logger="launch.torchrun"):
        assert run_log(["trainer.no_such_key=1"], rank=0, since=0.0) is None
    (record,) = [r for r in caplog.records if r.name == "launch.torchrun"]
    assert record.levelno == logging.DEBUG and record.exc_info is not None
