"""bench.scaling --merge: the reports of runs measured in separate calls joined into one, the
ratios recomputed across them, a repeated row replaced, runs with other settings refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import scaling

SETTINGS: dict[str, Any] = {
    "batch": 8192, "warmup": 20, "steps": 40, "cache_batches": 16, "device": "cuda", "timing": "CUDA events",
    "compile": True, "job_timeout_s": 180.0, "decide_steps": 30, "decide_interval": 5,
}


def _row(variant: str, nproc: int, samples_per_s: float) -> dict[str, Any]:
    """What render() and add_ratios() read of a measured row; the ratios as the run left them
    (a run with only 4 GPUs has no 1-GPU row: no efficiency)."""
    step_ms = 8192 * nproc * 1000.0 / samples_per_s
    return {"config": "dlrm", "variant": variant, "nproc": nproc, "status": "ok", "samples_per_s": samples_per_s,
            "step_ms_median": step_ms, "step_ms_p10": step_ms, "step_ms_p90": step_ms, "a2a_bytes_per_step": None,
            "dir": f"/runs/dlrm_{variant}_x{nproc}", "scaling_efficiency": None, "speed_vs_bf16": None}


def _write(out: Path, command: str, nprocs: list[int], rows: list[dict[str, Any]], **settings: Any) -> Path:
    out.mkdir(parents=True)
    report = {
        "command": command, "env": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.9"},
        "settings": {**SETTINGS, "nprocs": nprocs, **settings},
        "variants": {r["variant"]: f"{r['variant']} described" for r in rows}, "rows": rows,
    }
    (out / "scaling.json").write_text(json.dumps(report))
    return out


def test_merge_recomputes_the_ratios_across_runs_and_lists_their_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write(tmp_path / "a", "python -m bench.scaling --out a --nprocs 1 2", [1, 2],
               [_row("bf16", 1, 1000.0), _row("bf16", 2, 1800.0), _row("loka_safe", 1, 1100.0)])
    # b repeats bf16 x2 (the later row wins) and has a loka variant the first run lacks.
    b = _write(tmp_path / "b", "python -m bench.scaling --out b --nprocs 2 4", [2, 4],
               [_row("bf16", 2, 1900.0), _row("bf16", 4, 3200.0), _row("loka_safe", 4, 4000.0)],
               job_timeout_s=600.0)
    out = tmp_path / "merged"
    assert scaling.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "scaling.json").read_text())
    rows = {(r["variant"], r["nproc"]): r for r in report["rows"]}
    assert list(rows) == [("bf16", 1), ("bf16", 2), ("bf16", 4), ("loka_safe", 1), ("loka_safe", 4)]
    assert f"dlrm bf16 x2: the row of {b / 'scaling.json'} replaces the row of {a / 'scaling.json'}" in printed
    assert rows["bf16", 2]["samples_per_s"] == 1900.0
    # The 4-GPU rows of b against the 1-GPU rows of a; b's file had no efficiency for them.
    assert math.isclose(rows["bf16", 2]["scaling_efficiency"], 1900.0 / (2 * 1000.0))
    assert math.isclose(rows["bf16", 4]["scaling_efficiency"], 3200.0 / (4 * 1000.0))
    assert math.isclose(rows["loka_safe", 4]["scaling_efficiency"], 4000.0 / (4 * 1100.0))
    assert math.isclose(rows["loka_safe", 4]["speed_vs_bf16"], 4000.0 / 3200.0)
    assert rows["bf16", 1]["scaling_efficiency"] is None

    s = report["settings"]
    assert s["nprocs"] == [1, 2, 4] and s["batch"] == 8192 and s["job_timeout_s"] == 180.0
    assert list(report["variants"]) == ["bf16", "loka_safe"]
    assert [src["command"] for src in report["merged_from"]] == [
        "python -m bench.scaling --out a --nprocs 1 2", "python -m bench.scaling --out b --nprocs 2 4"]
    md = (out / "scaling.md").read_text()
    assert md == scaling.render(report)
    assert f"Command: `python -m bench.scaling --merge {a} {b} --out {out}`" in md
    assert "`python -m bench.scaling --out a --nprocs 1 2`" in md
    assert "`python -m bench.scaling --out b --nprocs 2 4`" in md
    assert "| dlrm | loka_safe | 4 | 8192.00 | 8192.00-8192.00 | 4,000 | 1.25x | 91% |" in md
    assert "# Weak scaling on 1 and 2 and 4 GPUs" in md


def test_merge_refuses_other_settings_and_missing_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write(tmp_path / "a", "run a", [1, 2], [_row("bf16", 1, 1000.0)])
    b = _write(tmp_path / "b", "run b", [4], [_row("bf16", 4, 3200.0)], batch=4096)
    out = tmp_path / "merged"
    with pytest.raises(SystemExit) as exc:
        scaling.main(["--merge", str(a), str(b), "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "setting 'batch' differs: 8192 in" in err and "4096 in" in err and str(b / "scaling.json") in err
    assert not out.exists()

    with pytest.raises(SystemExit):
        scaling.main(["--merge", str(a), str(tmp_path / "nowhere"), "--out", str(out)])
    assert f"{tmp_path / 'nowhere' / 'scaling.json'} not found" in capsys.readouterr().err

    with pytest.raises(SystemExit):  # a merge runs no job
        scaling.main(["--merge", str(a), "--out", str(out), "--variants", "bf16"])
    assert "--merge runs no job: drop --variants" in capsys.readouterr().err
