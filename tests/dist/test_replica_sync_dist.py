"""LoKA's replica sync (`comm.ReplicaSync`) on gloo, on plain tensors: FP32 is the plain mean of
the replicas, lossy syncs leave the replicas identical and near the mean, error feedback
loses nothing, the policy picks the precision, and the groups come from the 2D layout.

Shape legend: N values, R rows, D embedding dim.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from loka_train.comm import (
    CommChannel,
    CommConfig,
    CommPolicy,
    CommPrecision,
    CommState,
    ReplicaSync,
)
from loka_train.kernels.formats import sqnr_db
from loka_train.runtime.sparse2d import Sparse2DLayout, replica_process_group
from tests.dist._multiprocess import run_multiprocess

CH = CommChannel.REPLICA_SYNC
FP32, BF16, FP8 = CommPrecision.FP32, CommPrecision.BF16, CommPrecision.FP8


def _table(seed: int, rows: int = 16, dim: int = 32) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def _update(seed: int, step: int) -> torch.Tensor:
    return 1e-2 * _table(1000 * seed + step)


def _gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _exact_job(rank: int, world: int) -> None:
    state = CommState(CommConfig(), backend="gloo")
    sync = ReplicaSync(state)
    w_RD, m_R = _table(rank), torch.rand(16, generator=torch.Generator().manual_seed(50 + rank))
    sync.sync({"t": w_RD}, [m_R])
    assert torch.equal(w_RD, (_table(0) + _table(1)) / 2)  # bit for bit: a plain mean
    assert torch.equal(m_R, sum(torch.rand(16, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)) / 2)
    before = [w_RD + _update(r, 0) for r in range(world)]
    w_RD += _update(rank, 0)
    sync.sync({"t": w_RD})
    assert torch.equal(w_RD, (before[0] + before[1]) / 2)
    # Every byte on the channel counted: two syncs of the 16 x 32 table, one of the 16 states.
    assert state.stats.bytes_by_precision[CH] == {FP32: 2 * 16 * 32 * 4 + 16 * 4}


def test_fp32_sync_is_the_plain_mean() -> None:
    run_multiprocess(_exact_job, 2, timeout=60)


def _lossy_job(rank: int, world: int, precision: str, feedback: bool, steps: int) -> dict[str, float]:
    state = CommState(CommConfig(replica_sync=precision, dense_error_feedback=feedback), backend="gloo")
    sync = ReplicaSync(state)
    w_RD = _table(rank)
    sync.sync({"t": w_RD})  # the first sync is FP32: anchors agree
    exact_RD = w_RD.clone()
    for step in range(steps):
        w_RD += _update(rank, step)
        exact_RD += sum(_update(r, step) for r in range(world)) / world
        sync.sync({"t": w_RD})
        replicas = _gather(w_RD)
        assert all(torch.equal(replicas[0], r) for r in replicas), "replicas differ after a sync"
    residuals = sync.residuals
    mean_residual = sum(_gather(residuals["t"])) / world if "t" in residuals else torch.zeros(w_RD.numel())
    moved = exact_RD - _table(0) / 2 - _table(1) / 2
    return {
        "sqnr_db": float(sqnr_db(moved, w_RD - _table(0) / 2 - _table(1) / 2)),
        # What was applied plus what is still held back is exactly what the replicas changed.
        "feedback_gap": float((w_RD.reshape(-1) + mean_residual - exact_RD.reshape(-1)).abs().max()),
        "bytes": float(state.stats.bytes_by_precision[CH].get(CommPrecision(precision), 0)),
        "fp32_bytes": float(state.stats.bytes_by_precision[CH].get(FP32, 0)),
    }


@pytest.mark.parametrize(("precision", "min_db"), [("bf16", 35.0), ("fp8", 20.0)])
def test_lossy_sync_keeps_replicas_identical_and_near_the_mean(precision: str, min_db: float) -> None:
    r0, r1 = run_multiprocess(_lossy_job, 2, precision, True, 1, timeout=60)
    assert r0 == r1
    assert r0["sqnr_db"] > min_db and r0["sqnr_db"] < 120, r0  # lossy, yet close
    # One FP32 sync of 16 x 32 fp32 values, then one at the precision (fewer bytes).
    assert r0["fp32_bytes"] == 16 * 32 * 4 and 0 < r0["bytes"] < r0["fp32_bytes"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_error_feedback_loses_nothing(precision: str) -> None:
    with_fb = run_multiprocess(_lossy_job, 2, precision, True, 12, timeout=60)[0]
    without = run_multiprocess(_lossy_job, 2, precision, False, 12, timeout=60)[0]
    assert with_fb["feedback_gap"] < 1e-5, with_fb
    assert with_fb["sqnr_db"] > without["sqnr_db"] + 3, (with_fb, without)


def _impl_job(rank: int, world: int, impl: str, feedback: bool, precision: str) -> dict[str, Any]:
    from loka_train.comm import triton_replica

    fused_calls = []
    name = "delta_encode" if precision == "fp8" else "delta_encode_bf16"
    encode = getattr(triton_replica, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        fused_calls.append(1)
        return encode(*args, **kwargs)

    setattr(triton_replica, name, counted)  # this worker process only
    # sample_every=2 measures every other sync: the fused path computes the change there too.
    config = CommConfig(replica_sync=precision, dense_error_feedback=feedback, codec_impl=impl, sample_every=2)
    state = CommState(config, backend="gloo")
    sync = ReplicaSync(state)
    # 20 x 30 = 600 values: not a whole number of 32-value rows (the last row is padded).
    w_RD = torch.randn(20, 30, generator=torch.Generator().manual_seed(rank))
    sync.sync({"t": w_RD})
    for step in range(4):
        w_RD += 1e-2 * torch.randn(20, 30, generator=torch.Generator().manual_seed(100 * rank + step))
        sync.sync({"t": w_RD})
    residual = sync.residuals.get("t")
    return {"w": w_RD.reshape(-1).tolist(), "residual": [] if residual is None else residual.tolist(),
            "sqnr_sums": state.sqnr_sums.reshape(-1).tolist(), "fused_calls": len(fused_calls)}


@pytest.mark.parametrize(("precision", "feedback"), [("fp8", True), ("fp8", False), ("bf16", True), ("bf16", False)])
def test_fused_sync_is_the_reference_sync(precision: str, feedback: bool) -> None:
    """The Triton kernels of the FP8 and BF16 syncs (two fused passes) leave the same weights,
    residuals and measurements as the reference path, bit for bit."""
    fused = run_multiprocess(_impl_job, 2, "triton", feedback, precision, timeout=120)
    reference = run_multiprocess(_impl_job, 2, "reference", feedback, precision, timeout=120)
    # The 4 lossy syncs went through the kernels (the first sync is FP32), the reference's not.
    assert [r.pop("fused_calls") for r in fused] == [4, 4]
    assert [r.pop("fused_calls") for r in reference] == [0, 0]
    assert fused == reference
    assert fused[0]["w"] == fused[1]["w"]  # replicas identical
    assert bool(fused[0]["residual"]) is feedback


def _policy_job(rank: int, world: int) -> list[str]:
    config = CommConfig(
        adaptive_channels=(CH,), sample_every=1, policy_interval=1, lower_patience=1,
        ladder=(FP32, BF16, FP8), backward_lower_sqnr_db=20.0, backward_raise_sqnr_db=15.0,
    )
    state = CommState(config, backend="gloo")
    policy = CommPolicy(state)
    sync = ReplicaSync(state)
    w_RD = _table(rank)
    used = []
    for step in range(3):
        state.begin_step(step)
        w_RD += _update(rank, step)
        used.append(sync.precision().value)
        sync.sync({"t": w_RD})
        state.end_step()
        policy.maybe_update(step)
    return used


def test_policy_picks_the_precision() -> None:
    used = run_multiprocess(_policy_job, 2, timeout=60)
    assert used[0] == used[1]
    # The first sync is FP32 and measures nothing; the second measures the change at every
    # rung (FP8 on these smooth updates is well above 20 dB), and the policy lowers to FP8.
    assert used[0] == ["fp32", "fp32", "fp8"], used[0]


def _sampling_job(rank: int, world: int) -> list[bool]:
    config = CommConfig(adaptive_channels=(CH,), sample_every=2, ladder=(FP32, BF16, FP8))
    state = CommState(config, backend="gloo")
    sync = ReplicaSync(state)
    w_RD = _table(rank)
    measured = []
    for step in range(12):
        state.begin_step(step)  # sampled steps: 0, 2, 4, ...
        w_RD += _update(rank, step)
        if (step + 1) % 2 == 0:  # syncs after steps 1, 3, 5, ...: never a sampled step
            before = state.sqnr_sums.clone()
            sync.sync({"t": w_RD})
            measured.append(not torch.equal(before, state.sqnr_sums))
        state.end_step()
    return measured


def test_sync_samples_on_its_own_count() -> None:
    """An adaptive channel is measured on every sample_every-th sync (the first has no change),
    whichever steps the syncs fall on."""
    measured = run_multiprocess(_sampling_job, 2, timeout=60)
    assert measured[0] == measured[1] == [False, True, False, True, False, True], measured


def _groups_job(rank: int, world: int) -> list[float]:
    layout = Sparse2DLayout(world_size=world, sharding_group_size=2)
    group = replica_process_group(torch.nn.Module(), layout, rank)
    sync = ReplicaSync(CommState(CommConfig(), backend="gloo"), group=group)
    w_N = torch.tensor([float(rank)])
    sync.sync({"t": w_N})
    return w_N.tolist()


def test_replica_groups_follow_the_layout() -> None:
    # 4 ranks, sharding groups (0, 2), (1, 3): ranks 0 and 1 hold the same shards, 2 and 3 too.
    assert run_multiprocess(_groups_job, 4, timeout=60) == [[0.5], [0.5], [2.5], [2.5]]
