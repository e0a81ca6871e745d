"""bench.scaling's dry run: each job under torchrun with 1 and 2 gloo processes; the JSON's rows,
step times, samples/s, the efficiency computed from them and the all-to-all bytes; a job that
fails is recorded with its error while the others run, and the exit status says so; a LoKA
variant's decision job, whose checkpointed plans its timed job starts from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import scaling
from bench.e2e.variants import Variant


def test_dry_run_on_1_and_2_processes_records_a_failed_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A variant the trainer refuses on the CPU, once it has started: a job that fails in its ranks.
    monkeypatch.setitem(scaling.VARIANTS, "broken", Variant(
        name="broken", description="CUDA graphs on the CPU", loka_overrides=("trainer.cuda_graphs=true",),
    ))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU codec is the reference one
    rc = scaling.main(["--dry-run", "--out", str(tmp_path), "--configs", "dlrm",
                       "--variants", "bf16_fp8comm", "broken", "--job-timeout", "120"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "scaling.json").read_text())
    rows = {(r["variant"], r["nproc"]): r for r in report["rows"]}
    assert rc == 1, printed
    assert sorted(rows) == [("bf16_fp8comm", 1), ("bf16_fp8comm", 2), ("broken", 1), ("broken", 2)]

    one, two = rows["bf16_fp8comm", 1], rows["bf16_fp8comm", 2]
    for r in (one, two):
        assert r["status"] == "ok", r.get("error")
        assert len(r["step_ms"]) == 4 and r["step_ms_median"] > 0
        assert len(r["step_ms_median_by_rank"]) == r["nproc"]
        assert math.isclose(r["samples_per_s"], 64 * r["nproc"] * 1000.0 / r["step_ms_median"])
        # The clock's run peaks, which have no CUDA allocator to read here.
        assert r["gpu_peak_allocated_gb"] is None and r["gpu_peak_reserved_gb"] is None
    assert one["scaling_efficiency"] is None
    assert math.isclose(two["scaling_efficiency"], two["samples_per_s"] / (2 * one["samples_per_s"]))
    # 1 process: nothing to communicate (LoKA installs no codec): 0 bytes. 2: every rank sends
    # FP8 both ways, counted by the codec.
    assert one["a2a_bytes_per_step"] == 0
    assert two["a2a_bytes_per_step"] > 0
    assert all(set(p) == {"FP8"} for p in two["a2a_bytes_by_precision_rank0"].values())
    assert not two["comm_fallbacks"]

    for n in (1, 2):
        broken = rows["broken", n]
        assert broken["status"] == "error" and "cuda_graphs" in broken["error"], broken
        assert broken["scaling_efficiency"] is None
    md = (tmp_path / "scaling.md").read_text()
    assert "Failed jobs" in md and "dlrm broken x2" in md
    assert "| dlrm | bf16_fp8comm | 2 |" in md and "python -m bench.scaling --dry-run" in md
    assert "dlrm broken x1: FAILED" in printed and "dlrm bf16_fp8comm x2:" in printed


def test_loka_variant_times_the_plans_its_decision_job_checkpointed(tmp_path: Path) -> None:
    rc = scaling.main(["--dry-run", "--out", str(tmp_path), "--configs", "dlrm", "--nprocs", "2",
                       "--variants", "loka_aggressive", "--job-timeout", "120"])
    report = json.loads((tmp_path / "scaling.json").read_text())
    (row,) = report["rows"]
    assert rc == 0 and row["status"] == "ok", row.get("error")
    decision = row["decide"]
    assert decision["status"] == "ok" and decision["steps"] == 8 and decision["wall_s"] > 0
    assert "loka.probe.every_k_steps=1" in decision["overrides"]
    # aggressive on a CPU takes FP8 wherever it is safe (dispatch.cpu_objective=coverage): the
    # decided plans differ from the preset's initial ones (all high precision), so a timed job
    # that skipped the decided state would show other plans and no coverage.
    assert decision["fp8_coverage"] > 0
    assert row["loka"]["plans"] == decision["plans"]
    assert row["fp8_coverage"] == decision["fp8_coverage"]
    assert row["loka"]["plan_changes"] == decision["plan_changes"]  # the history came along
    decided = Path(row["decided_from"]["checkpoint"])
    assert decided.is_relative_to(tmp_path / "dlrm_loka_aggressive_x2_decide") and row["decided_from"]["step"] == 8
    # From fresh weights: the timed job trains its own 2 + 4 steps from step 0.
    assert len(row["step_ms"]) == 4
    md = (tmp_path / "scaling.md").read_text()
    assert "| FP8 GEMMs | decision s |" in md and f"| {row['fp8_coverage']:.0%} | {decision['wall_s']:.1f} | ok |" in md


def test_efficiency_needs_both_runs() -> None:
    def row(variant: str, nproc: int, sps: float | None) -> dict:
        if sps is None:
            return {"config": "dlrm", "variant": variant, "nproc": nproc, "status": "error"}
        return {"config": "dlrm", "variant": variant, "nproc": nproc, "status": "ok", "samples_per_s": sps}

    rows = [row("bf16", 1, 100.0), row("bf16", 2, 150.0), row("loka_safe", 1, None),
            row("loka_safe", 2, 120.0)]
    scaling.add_ratios(rows)
    assert [r["scaling_efficiency"] for r in rows] == [None, 0.75, None, None]
    assert [r["speed_vs_bf16"] for r in rows] == [1.0, 1.0, None, 0.8]


def test_profile_steps_profile_every_rank_after_the_timed_steps(tmp_path: Path) -> None:
    rc = scaling.main(["--dry-run", "--out", str(tmp_path), "--configs", "dlrm", "--nprocs", "2",
                       "--variants", "bf16", "--profile-steps", "2", "--job-timeout", "120"])
    report = json.loads((tmp_path / "scaling.json").read_text())
    (row,) = report["rows"]
    assert rc == 0 and row["status"] == "ok", row.get("error")
    assert report["settings"]["profile_steps"] == 2
    assert len(row["step_ms"]) == 4  # the profiled steps come after the timed ones, untimed
    profiles = row["profile_by_rank"]
    assert len(profiles) == 2 and all(p["steps"] == 2 for p in profiles)
    for p in profiles:  # on the CPU: operators' self time, and a step's aten calls
        assert p["kernel_ms_per_step"] > 0 and p["host_aten_calls_per_step"] > 0
    assert all(ms is not None and ms > 0 for ms in row["step_host_ms_median_by_rank"])
    assert len(row["gc_ms_per_step_by_rank"]) == 2
    assert Path(row["trace"]).is_file() and Path(row["trace"]).is_relative_to(tmp_path / "dlrm_bf16_x2")
    md = (tmp_path / "scaling.md").read_text()
    assert "Profile of 2 steps after the timed ones" in md
    assert "| dlrm | bf16 | 2 | 0 |" in md and "| dlrm | bf16 | 2 | 1 |" in md
    # Each rank's bound, from its host ms against its median step.
    for rank in range(2):
        line = next(x for x in md.splitlines() if x.startswith(f"| dlrm | bf16 | 2 | {rank} |"))
        want = scaling.bound_by(row["step_host_ms_median_by_rank"][rank], row["step_ms_median_by_rank"][rank])
        assert line.rstrip(" |").endswith(want) and want in ("host", "GPU")
