"""The run summary table shows the eval figures that recommendation engineers read together."""

from __future__ import annotations

from loka_train.runtime.summary import format_summary


def test_the_summary_table_shows_eval_ne_auc_and_calibration() -> None:
    summary = {
        "steps": 10, "world_size": 2, "global_batch": 8, "train/steps_per_s": 2.0, "train/loss": 0.5,
        "eval/ne": 0.74771, "eval/auc": 0.83362, "eval/calibration": 1.02346, "fallbacks": [],
    }
    rows = [line.split() for line in format_summary(summary).splitlines()]
    assert ["eval", "NE", "0.7477"] in rows
    assert ["eval", "AUC", "0.8336"] in rows
    assert ["eval", "calibration", "1.0235"] in rows
    no_eval = {k: v for k, v in summary.items() if not k.startswith("eval/")}
    assert "eval" not in format_summary(no_eval)
