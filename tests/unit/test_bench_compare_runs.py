"""bench.compare_runs: identical runs compare equal, a changed loss or plan is named."""

from __future__ import annotations

import json
from pathlib import Path

from bench.compare_runs import main


def _run(root: Path, loss: float, plan: str) -> Path:
    (root / "loka").mkdir(parents=True)
    (root / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "train/loss": 0.7}) + "\n" + json.dumps({"step": 2, "train/loss": loss}) + "\n"
        + json.dumps({"step": 2, "eval/ne": 0.9}) + "\n"
    )
    (root / "loka" / "loka_report.json").write_text(json.dumps(
        {"plan_export": {"s": plan}, "plan_changes": 1, "fp8_coverage": 0.5, "sites": {"s": {"forward": plan}}}
    ))
    return root


def test_identical_runs_pass_and_a_difference_is_named(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    a = _run(tmp_path / "a", 0.6, "fp8")
    assert main([str(a), str(_run(tmp_path / "b", 0.6, "fp8"))]) == 0
    assert main([str(a), str(_run(tmp_path / "c", 0.6000001, "fp8"))]) == 1
    assert "losses: DIFFERENT" in capsys.readouterr().out
    assert main([str(a), str(_run(tmp_path / "d", 0.6, "high"))]) == 1
    out = capsys.readouterr().out
    assert "plans: DIFFERENT" in out and "losses: identical" in out
