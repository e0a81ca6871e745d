"""The README's main job, as a user runs it: torchrun, 2 CPU processes, hydra config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(*overrides: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [*TORCHRUN, str(ROOT / "launch" / "train.py"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_main_job_learns(tmp_path: Path) -> None:
    """Default config (300 steps, 2 x 256): eval NE clearly below 1.0, artifacts written."""
    proc = _run(f"trainer.out_dir={tmp_path}", "trainer.tensorboard=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "run summary" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["world_size"] == 2
    assert summary["eval/ne"] < 0.95, summary
    assert summary["eval/auc"] > 0.65, summary
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert any("train/loss" in json.loads(line) for line in lines)
    assert (tmp_path / "checkpoints" / "latest").exists()
    # The main job runs with LoKA on: it put GEMMs in FP8 and wrote its report.
    assert summary["loka/fp8_coverage"] > 0.5, summary
    assert (tmp_path / "loka" / "loka_report.md").exists()
    assert "LoKA plan" in proc.stdout
    report_line = next(line for line in proc.stdout.splitlines() if "LoKA report" in line)
    assert report_line.split()[-1] == str(tmp_path / "loka" / "loka_report.md")


def test_bad_config_value_fails_clearly(tmp_path: Path) -> None:
    proc = _run(f"trainer.out_dir={tmp_path}", "trainer.sharding=diagonal", timeout=120)
    assert proc.returncode != 0
    assert "trainer.sharding='diagonal'" in proc.stderr


def test_missing_data_path_fails_clearly(tmp_path: Path) -> None:
    proc = _run(
        f"trainer.out_dir={tmp_path}", "data=criteo", f"data.path={tmp_path}/none.tsv",
        f"data.eval_path={tmp_path}/none.tsv", timeout=120,
    )
    assert proc.returncode != 0
    assert "data.path" in proc.stderr
