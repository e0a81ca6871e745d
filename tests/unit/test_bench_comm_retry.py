"""bench.comm runs a job once more when a worker aborted before writing its result, and says so;
keeps a result written before a worker aborted at exit, and says so; any other failure is not
retried."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import comm


def _fake_runs(monkeypatch: pytest.MonkeyPatch, outcomes: list[tuple[int, str]], result: Path,
               written: bool = False) -> list[list[str]]:
    """Jobs ending as `outcomes` say (exit status, stderr); a job that exits 0, or any job when
    `written`, writes its result first."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        rc, stderr = outcomes[len(calls) - 1]
        if rc == 0 or written:
            result.write_text(json.dumps({"precision": "fp32", "samples_per_s": 1.0}))
        return subprocess.CompletedProcess(cmd, rc, "", stderr)

    monkeypatch.setattr(comm.subprocess, "run", run)
    return calls


def test_an_aborted_worker_runs_the_job_again_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aborted = "terminate called without an active exception\n  traceback : Signal 6 (SIGABRT) received by PID 1"
    calls = _fake_runs(monkeypatch, [(1, aborted), (0, "")], tmp_path / "result.json")
    result = comm.run_job({"out": str(tmp_path)})
    assert len(calls) == 2 and result is not None and "aborted" in result["retried"]


def test_other_failures_and_a_second_abort_are_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_runs(monkeypatch, [(1, "ValueError: bad config")], tmp_path / "result.json")
    assert comm.run_job({"out": str(tmp_path)}) is None and len(calls) == 1
    aborted = "Signal 6 (SIGABRT)"
    calls = _fake_runs(monkeypatch, [(1, aborted), (1, aborted)], tmp_path / "result.json")
    assert comm.run_job({"out": str(tmp_path)}) is None and len(calls) == 2


def test_a_result_written_before_a_worker_aborted_at_exit_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aborted = "terminate called without an active exception\n  traceback : Signal 6 (SIGABRT) received by PID 1"
    calls = _fake_runs(monkeypatch, [(1, aborted)], tmp_path / "result.json", written=True)
    result = comm.run_job({"out": str(tmp_path)})
    assert len(calls) == 1 and result is not None and result["samples_per_s"] == 1.0
    assert "after the result was written" in result["aborted_at_exit"] and "retried" not in result
    # Any other failure with a result on disk is still a failure.
    calls = _fake_runs(monkeypatch, [(1, "ValueError: bad config")], tmp_path / "result.json", written=True)
    assert comm.run_job({"out": str(tmp_path)}) is None and len(calls) == 1


def test_a_stale_result_does_not_pass_for_a_failed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "result.json").write_text(json.dumps({"precision": "fp32", "samples_per_s": 9.0}))
    aborted = "Signal 6 (SIGABRT)"
    calls = _fake_runs(monkeypatch, [(1, aborted), (0, "")], tmp_path / "result.json")
    result = comm.run_job({"out": str(tmp_path)})
    assert len(calls) == 2 and result is not None and result["samples_per_s"] == 1.0 and "retried" in result
