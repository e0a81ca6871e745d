"""The README's main job, as a user runs it: torchrun, 2 CPU processes, hydra config; each run
in its own directory, and a failure reported once, without a traceback."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
QUIET_TORCHRUN = [sys.executable, str(ROOT / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
"""What scripts/train.sh runs: torchrun without its own failure report."""
TEARDOWN_ABORT = "terminate called without an active exception"
NOISE = ("Traceback", "ChildFailedError", "Connection closed", "HYDRA_FULL_ERROR", "To append", "SIGTERM")


def _run(*overrides: str, timeout: float = 240, launcher: list[str] = TORCHRUN,
         single: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable] if single else launcher
    for attempt in range(2):
        proc = subprocess.run(
            [*command, str(ROOT / "launch" / "train.py"), *overrides],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr or attempt:
            return proc
        # gloo's teardown aborts a process now and then after the run ended (../shared/stack.md:
        # about 1 torchrun run in 75 under load); said, then run once more.
        warnings.warn(f"torchrun teardown abort, run again: {proc.stderr[-500:]}", stacklevel=2)
    return proc


def _latest(out: Path) -> Path:
    return out / os.readlink(out / "latest")


def test_main_job_learns(tmp_path: Path) -> None:
    """Default config (300 steps, 2 x 256): eval NE clearly below 1.0, artifacts written into the
    run's directory, evaluations on the console; a loka=off run after it gets a directory of
    its own, without the LoKA report."""
    proc = _run(f"trainer.out_dir={tmp_path}", "trainer.tensorboard=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "run summary" in proc.stdout
    run = _latest(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["world_size"] == 2
    assert summary["eval/ne"] < 0.95, summary
    assert summary["eval/auc"] > 0.65, summary
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert any("train/loss" in json.loads(line) for line in lines)
    assert (run / "checkpoints" / "latest").exists()
    assert "run directory" in (run / "train.log").read_text() and (run / "config.yaml").exists()
    # The intermediate evaluations (trainer.eval_every=100) on the console, once each (rank 0),
    # calibration next to NE and AUC there, in metrics.jsonl, the summary and its table.
    for step in (100, 200):
        assert proc.stderr.count(f"step {step}: eval NE") == 1, proc.stderr[-3000:]
        assert re.search(rf"step {step}: eval NE [\d.]+, AUC [\d.]+, calibration [\d.]+ \(", proc.stderr)
    assert 0.5 < summary["eval/calibration"] < 2.0, summary
    assert json.loads(lines[-1])["eval/calibration"] == summary["eval/calibration"]
    assert "eval calibration" in proc.stdout
    # The main job runs with LoKA on: it put GEMMs in FP8 and wrote its report.
    assert summary["loka/fp8_coverage"] > 0.5, summary
    assert (run / "loka" / "loka_report.md").exists()
    assert "LoKA plan" in proc.stdout
    report_line = next(line for line in proc.stdout.splitlines() if "LoKA report" in line)
    assert report_line.split()[-1] == str(run / "loka" / "loka_report.md")

    off = _run(f"trainer.out_dir={tmp_path}", "loka=off", "trainer.steps=4", "trainer.eval_batches=2",
               "trainer.tensorboard=false", "trainer.progress_bar=false")
    assert off.returncode == 0, off.stdout[-3000:] + off.stderr[-3000:]
    new = _latest(tmp_path)
    assert new != run and json.loads((new / "summary.json").read_text())["steps"] == 4
    assert not (new / "loka").exists(), "the LoKA run's report leaked into the loka=off run"
    assert (run / "loka" / "loka_report.md").exists(), "the earlier run was changed"


def _write_criteo(path: Path, num_lines: int) -> None:
    rng = random.Random(0)
    rows = ["\t".join([str(rng.randint(0, 1)), *(str(rng.randint(0, 9)) for _ in range(13)),
                       *(f"{rng.getrandbits(32):08x}" for _ in range(26))]) for _ in range(num_lines)]
    path.write_text("\n".join(rows) + "\n")


def test_a_misspelled_key_prints_one_message_naming_the_nearest(tmp_path: Path) -> None:
    proc = _run(f"trainer.out_dir={tmp_path}", "trainer.stepz=5", timeout=120, launcher=QUIET_TORCHRUN)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "error: trainer.stepz is not a setting: did you mean trainer.steps?\n", proc.stderr
    assert proc.stdout == ""
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_too_small_eval_set_prints_one_message_and_changes_no_run(tmp_path: Path) -> None:
    """2 ranks fail the data check together: rank 0 alone reports it, naming the setting and the
    fix; the traceback goes to error.log; the earlier run and `latest` stay as they were."""
    _write_criteo(tmp_path / "train.tsv", 2048)
    _write_criteo(tmp_path / "eval.tsv", 600)  # one global batch of 2 x 256
    runs = tmp_path / "runs"
    earlier = runs / "20260101-000000"
    (earlier / "checkpoints").mkdir(parents=True)
    (runs / "latest").symlink_to(earlier.name)
    proc = _run(
        f"trainer.out_dir={runs}", "data=criteo", f"data.path={tmp_path}/train.tsv",
        f"data.eval_path={tmp_path}/eval.tsv", "trainer.eval_batches=4", timeout=120, launcher=QUIET_TORCHRUN,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: trainer.eval_batches=4 needs 4 full global batches"), line
    assert "holds only 1: lower trainer.eval_batches to 1 or less" in line, line
    assert not any(noise in proc.stderr for noise in NOISE), proc.stderr
    left = {p.name for p in runs.iterdir()} - {"error.rank1.log"}  # rank 1 may be stopped before it logs
    assert left == {"20260101-000000", "error.log", "latest"}, left
    assert os.readlink(runs / "latest") == earlier.name
    assert "Traceback" in (runs / "error.log").read_text()


def test_bad_config_value_fails_clearly(tmp_path: Path) -> None:
    proc = _run(f"trainer.out_dir={tmp_path}", "trainer.sharding=diagonal", timeout=120, single=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: trainer.sharding='diagonal'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_data_path_fails_clearly(tmp_path: Path) -> None:
    proc = _run(
        f"trainer.out_dir={tmp_path}", "data=criteo", f"data.path={tmp_path}/none.tsv",
        f"data.eval_path={tmp_path}/none.tsv", timeout=120, single=True,
    )
    assert proc.returncode == 2
    assert "data.path" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" in (tmp_path / "error.log").read_text()
