"""bench.sparse2d's dry run on 2 gloo processes (the ``dmp`` variant: 2D sparse parallelism
needs CUDA): the timed job on cached batches, NE jobs per seed on fresh batches of the seed's
stream with the learning rates decaying over their second half, the paired table; and the
refusals of layouts that have no two replica groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sparse2d


def test_dry_run_times_dmp_and_pairs_ne_by_seed(tmp_path: Path) -> None:
    rc = sparse2d.main(["--dry-run", "--out", str(tmp_path), "--seeds", "2", "--ne-steps", "4"])
    assert rc == 0
    (row,) = json.loads((tmp_path / "sparse2d.json").read_text())
    assert row["variant"] == "dmp" and row["nprocs"] == 2 and row["steps"] == 8 and row["step_ms"] > 0
    assert row["shards_not_live"] == []  # TorchRec's shards (CPU, DMP) are the model's tensors
    runs = row["ne_by_seed"]
    assert [r["seed"] for r in runs] == [0, 1] and all(r["steps"] == 4 for r in runs)
    # Different seeds: different data and weights, so different NEs; each paired with itself here.
    assert runs[0]["eval_ne"] != runs[1]["eval_ne"]
    assert [r["ne_delta_vs_dmp"] for r in runs] == [0.0, 0.0]
    assert row["ne_mean"] == pytest.approx((runs[0]["eval_ne"] + runs[1]["eval_ne"]) / 2)
    md = (tmp_path / "sparse2d.md").read_text()
    assert "NE vs dmp (paired)" in md and "| dmp |" in md and "2 GPUs, 2D groups of 1" in md


def test_dry_run_continues_the_base_checkpoint_per_seed(tmp_path: Path) -> None:
    """--ne-from: a DMP base run saves a checkpoint; every NE job starts a new run from it (at
    its step, in its own run directory) and reads its seed's stretch of the train stream."""
    rc = sparse2d.main(["--dry-run", "--out", str(tmp_path), "--seeds", "2", "--ne-steps", "4", "--ne-from", "4",
                        "--eval-batches", "2"])
    assert rc == 0
    (row,) = json.loads((tmp_path / "sparse2d.json").read_text())
    runs = row["ne_by_seed"]
    base_dir = str(tmp_path / "ne_base")
    for seed, r in enumerate(runs):
        assert r["start_step"] == 4 and r["steps"] == 8  # resumed at the base's step, 4 more steps
        assert r["resumed_from"].startswith(base_dir) and not r["run_dir"].startswith(base_dir)
        assert r["data_offset"] == 4 * seed
    assert runs[0]["eval_ne"] != runs[1]["eval_ne"]  # different batches after the shared start
    md = (tmp_path / "sparse2d.md").read_text()
    assert "paired, decayed protocol" in md and "base run trains 4 steps" in md


@pytest.mark.parametrize("args", [["--nprocs", "4", "--group-size", "4"], ["--nprocs", "4", "--group-size", "3"],
                                  ["--nprocs", "1"], ["--seeds", "2", "--variants", "2d_fp32"],
                                  ["--ne-from", "4"]])
def test_refuses_layouts_without_two_replica_groups_and_ne_without_dmp(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        sparse2d.main(["--dry-run", "--out", "unused", *args])


def test_table_pairs_loka_syncs_against_the_exact_2d_sync_too() -> None:
    import argparse

    from bench.comm import paired_ne

    def row(variant: str, nes: list[float]) -> dict:
        return {"variant": variant, "step_ms": 10.0, "steps": 10, "replica_max_abs_diff": 0.0,
                "replica_sync_bytes_rank0": None, "gpu": "g", "torch": "t",
                "ne_by_seed": [{"seed": s, "eval_ne": ne} for s, ne in enumerate(nes)]}

    rows = [row("dmp", [0.5, 0.6]), row("2d_fp32", [0.51, 0.61]), row("2d_loka_fp8", [0.51, 0.62])]
    rows[2]["step_ms"] = 8.0  # 1.25x the speed of dmp's 10 ms
    paired_ne(rows, key="variant", base="dmp")
    paired_ne(rows, key="variant", base="2d_fp32")
    args = argparse.Namespace(nprocs=2, group_size=1, tables=2, dim=8, rows=10, batch=4, steps=10, seeds=2,
                              ne_steps=8, ne_from=0, eval_batches=4)
    md = "\n".join(sparse2d.table(rows, args, ["--seeds", "2"]))
    fp8 = next(line for line in md.splitlines() if line.startswith("| 2d_loka_fp8 |"))
    # Against 2d_fp32: seed 0 equal, seed 1 +1/61: mean +0.8197%.
    assert "+0.8197%" in fp8.split("|")[6] and "NE vs 2d_fp32 (paired)" in md
    assert fp8.split("|")[3].strip() == "1.25x" and "| speed vs dmp |" in md
    rows = [row("dmp", [0.5, 0.6]), row("2d_loka_fp8", [0.51, 0.62])]
    paired_ne(rows, key="variant", base="dmp")
    md = "\n".join(sparse2d.table(rows, args, []))
    assert next(line for line in md.splitlines() if line.startswith("| 2d_loka_fp8 |")).split("|")[6].strip() == "-"
