"""bench.comm's dry run with the paired NE protocol (``--ne-from``) on 2 gloo processes: the
base job's checkpoint, the continuations that start from its step, and the NE deltas against
FP32 paired by seed next to the timed jobs' throughput and bytes."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench import comm


def test_ne_protocol_pairs_continuations_of_the_base_checkpoint_by_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU codec is the reference one
    rc = comm.main(["--dry-run", "--out", str(tmp_path), "--precisions", "fp32,fp8",
                    "--ne-from", "4", "--ne-steps", "4", "--seeds", "2"])
    assert rc == 0
    rows = json.loads((tmp_path / "comm.json").read_text())
    base = json.loads((tmp_path / "ne_base.json").read_text())
    assert [r["precision"] for r in rows] == ["fp32", "fp8"]
    assert base["precision"] is None and base["start_step"] == 0 and base["steps"] == 4

    for row in rows:
        # The timed job as without the protocol: 8 steps from step 0.
        assert row["start_step"] == 0 and row["steps"] == 8 and row["samples_per_s"] > 0
        runs = row["ne_by_seed"]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            # A new run from the base checkpoint: it starts at the base's last step (a skipped
            # resume would start at 0) and trains the 4 decayed steps.
            assert r["start_step"] == base["steps"] and r["steps"] == 4 + 4
            assert r["resumed_from"] == base["run_dir"]
            assert r["data_offset"] == 4 * r["seed"]
            assert r["run_dir"] != base["run_dir"]
    fp32, fp8 = ({r["seed"]: r for r in row["ne_by_seed"]} for row in rows)
    # The seeds train on different batches, so their NEs differ.
    assert fp32[0]["eval_ne"] != fp32[1]["eval_ne"]
    # The codec set after the resume is the precision's own: FP8 puts fewer bytes on the wire.
    for seed in (0, 1):
        for channel in ("a2a_fwd", "a2a_bwd"):
            assert 0 < fp8[seed]["a2a_bytes_per_step_rank0"][channel] < fp32[seed]["a2a_bytes_per_step_rank0"][channel]

    # Deltas paired by seed, their mean and standard error.
    assert all(r["ne_delta_vs_fp32"] == 0.0 for r in fp32.values())
    deltas = [(fp8[s]["eval_ne"] - fp32[s]["eval_ne"]) / fp32[s]["eval_ne"] for s in (0, 1)]
    assert [fp8[s]["ne_delta_vs_fp32"] for s in (0, 1)] == pytest.approx(deltas)
    assert rows[1]["ne_mean"] == pytest.approx(statistics.fmean(r["eval_ne"] for r in fp8.values()))
    assert rows[1]["ne_delta_vs_fp32_mean"] == pytest.approx(statistics.fmean(deltas))
    assert rows[1]["ne_delta_vs_fp32_stderr"] == pytest.approx(statistics.stdev(deltas) / math.sqrt(2))
    md = (tmp_path / "comm.md").read_text()
    assert "NE vs FP32 (paired)" in md and "| fp8 |" in md and "--ne-from 4" in md


def test_ne_protocol_needs_fp32_to_pair_with() -> None:
    with pytest.raises(SystemExit):
        comm.main(["--dry-run", "--out", "unused", "--precisions", "bf16,fp8", "--ne-from", "4"])
