"""2D sparse parallelism on 2 and 4 GPUs (nccl): ``trainer.sharding_group_size=1`` (every GPU holds
every table), synced by TorchRec's ``DMPCollection.sync`` and by LoKA's FP8 replica sync. After
the last sync both ranks hold identical embedding weights and fused optimizer state
(momentum / accumulators), and the loss is finite.

Run on a 2-GPU machine: `pytest -m multigpu tests/gpu/test_multigpu_sparse2d.py`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.sparse2d import run_variant

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("variant", ["2d_fp32", "2d_loka_fp8"])
def test_replicas_identical_after_sync(variant: str, tmp_path: Path) -> None:
    r = run_variant(tmp_path, variant, steps=20, batch=1024, tables=8, dim=64, rows=10_000)
    assert r["replica_max_abs_diff"] == 0.0, r
    assert r["replica_state_max_abs_diff"] == 0.0, r  # the fused optimizer's state, synced too
    # The shards compared (and synced by LoKA) are the model's own tensors, not copies.
    assert r["shards_not_live"] == [], r
    assert math.isfinite(r["train_loss"]) and math.isfinite(r["eval_ne"]), r
    if variant == "2d_loka_fp8":
        assert r["replica_sync_bytes_rank0"] > 0, r
    print(f"{variant}: loss {r['train_loss']:.5f}, NE {r['eval_ne']:.5f}, fallbacks {r['fallbacks']}")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
@pytest.mark.parametrize("variant", ["2d_fp32", "2d_loka_fp8"])
def test_two_by_two_replicas_identical_after_sync(variant: str, tmp_path: Path) -> None:
    """4 GPUs in 2 sharding groups of 2: each table lives on one GPU of each group, and the
    two copies of every shard (ranks 0 and 2, 1 and 3) agree after the last sync."""
    r = run_variant(tmp_path, variant, steps=20, batch=1024, tables=8, dim=64, rows=10_000, nprocs=4, group_size=2)
    assert r["nprocs"] == 4 and r["group_size"] == 2, r
    assert r["replica_max_abs_diff"] == 0.0, r
    assert r["replica_state_max_abs_diff"] == 0.0, r
    assert math.isfinite(r["train_loss"]) and math.isfinite(r["eval_ne"]), r
    if variant == "2d_loka_fp8":
        assert r["replica_sync_bytes_rank0"] > 0, r
    print(f"2x2 {variant}: loss {r['train_loss']:.5f}, NE {r['eval_ne']:.5f}, fallbacks {r['fallbacks']}")


_SIZES = {"batch": 1024, "tables": 8, "dim": 64, "rows": 10_000}


def _resuming_a_dmp_checkpoint(tmp_path: Path) -> dict:
    """`run_variant`'s arguments for a small run resuming a 4-step fully sharded DMP run's
    checkpoint (trained here, under `tmp_path`)."""
    base = run_variant(tmp_path / "base", "dmp", 4, **_SIZES, cache_batches=0, checkpoint_at_end=True,
                       time_syncs=False)
    return {**_SIZES, "cache_batches": 0, "resume": base["run_dir"], "warmup": 4, "time_syncs": False}


@pytest.mark.parametrize("variant", ["2d_fp32", "2d_loka_fp8"])
def test_resumes_a_fully_sharded_checkpoint(variant: str, tmp_path: Path) -> None:
    """A 2D run started from a fully sharded DMP run's checkpoint (its tables copied into the
    replicated shards by their offsets) computes, on its first step, the loss the DMP run
    computes from the same checkpoint on the same batch: the weights it starts from are the
    checkpoint's."""
    more = _resuming_a_dmp_checkpoint(tmp_path)
    dmp = run_variant(tmp_path / "dmp", "dmp", 5, **more)
    two_d = run_variant(tmp_path / variant, variant, 5, **more)
    assert dmp["start_step"] == two_d["start_step"] == 4, (dmp, two_d)
    # Far tighter than a fresh or misplaced table would give (the base trained 4 steps).
    assert two_d["train_loss"] == pytest.approx(dmp["train_loss"], rel=1e-3), (dmp, two_d)
    assert two_d["replica_max_abs_diff"] == 0.0, two_d


def test_dcp_loads_a_2d_run_in_place(tmp_path: Path) -> None:
    """Whether DCP loads a fully sharded checkpoint straight into DMPCollection's tensors (DTensors
    of TorchRec's LocalShardsWrapper) on this stack, as it does on the CPU stack: then a 2D resume
    would need no host copy of the whole tables. The first loss after the resume is the DMP
    run's, as for the resume by copy."""
    more = _resuming_a_dmp_checkpoint(tmp_path)
    dmp = run_variant(tmp_path / "dmp", "dmp", 5, **more)
    in_place = run_variant(tmp_path / "2d", "2d_fp32", 5, **more, resume_in_place=True)
    assert in_place["start_step"] == 4, in_place
    assert in_place["train_loss"] == pytest.approx(dmp["train_loss"], rel=1e-3), (dmp, in_place)


def test_an_in_place_2d_resume_trains_as_the_copying_resume(tmp_path: Path) -> None:
    """Whether DCP's in-place load also restores the optimizer state (row-wise Adagrad's
    accumulators) of a 2D run: resumed both ways from one fully sharded checkpoint, the two runs
    train the same steps on the same batches, so their losses after several updates agree
    (an accumulator loaded as zeros would make the first updates far larger)."""
    more = _resuming_a_dmp_checkpoint(tmp_path)
    by_copy = run_variant(tmp_path / "copy", "2d_fp32", 12, **more)
    in_place = run_variant(tmp_path / "in_place", "2d_fp32", 12, **more, resume_in_place=True)
    assert by_copy["start_step"] == in_place["start_step"] == 4, (by_copy, in_place)
    assert in_place["train_loss"] == pytest.approx(by_copy["train_loss"], rel=1e-3), (by_copy, in_place)
    assert in_place["eval_ne"] == pytest.approx(by_copy["eval_ne"], rel=1e-3), (by_copy, in_place)
