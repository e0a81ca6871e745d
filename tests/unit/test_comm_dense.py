"""The dense-gradient comm hook in one process (a 1-rank gloo group, real DDP buckets):
measurement of every candidate precision, and error-feedback residuals across a resume."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loka_train.comm import (
    CommChannel,
    CommConfig,
    CommPrecision,
    CommState,
    install_dense_grad_hook,
)
from loka_train.comm.dense import DenseGradCompressor
from loka_train.comm.state import PrecisionSource
from tests.unit._process_group import one_rank_group as one_rank_process_group


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    with one_rank_process_group():
        yield


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def test_adaptive_channel_at_fp32_measures_its_lower_candidates() -> None:
    """At FP32 (the usual start) a sampled step must measure BF16 and FP8, or the policy can
    never lower the channel; FP8 is measured on whole rows (the bucket is not a multiple of
    row_dim here), as the row-wise path sends it, not ruled out."""
    state = CommState(
        CommConfig(dense_grads=CommPrecision.FP32, adaptive_channels=(CommChannel.DENSE_GRAD,),
                   row_dim=32, sample_every=1),
        backend="gloo",
    )
    compressor = DenseGradCompressor(state)
    grad_N = torch.randn(1000)  # 1000 % 32 != 0
    state.begin_step(0)
    compressor.reduce(grad_N.clone(), 0).wait()
    sqnr = CommState.sqnr_db_from_sums(state.take_sqnr_sums())[CommChannel.DENSE_GRAD]
    assert set(sqnr) >= {CommPrecision.BF16, CommPrecision.FP8}
    assert 40 < sqnr[CommPrecision.BF16] < 70
    assert 20 < sqnr[CommPrecision.FP8] < 45


def test_restored_residuals_land_on_their_own_parameters() -> None:
    """Residuals saved after DDP rebuilt its buckets (gradient order) must be added to the
    same parameters in a resumed run, whose first iteration uses the registration order."""
    x = torch.randn(8, 64)
    state = CommState(CommConfig(dense_grads=CommPrecision.FP8, row_dim=32), backend="gloo")
    ddp = DistributedDataParallel(_mlp())
    [compressor] = install_dense_grad_hook(ddp, state)
    for _ in range(3):
        ddp.zero_grad()
        ddp(x).sum().backward()
    saved = compressor.state_dict()
    residuals = saved["residuals_by_param"]
    assert isinstance(residuals, dict)
    assert set(residuals) == {n for n, _ in ddp.module.named_parameters()}
    assert max(float(r.abs().max()) for r in residuals.values()) > 0

    # Resume at FP32: the first step sends gradient + residual exactly.
    resumed, ref = DistributedDataParallel(_mlp()), _mlp()
    [compressor2] = install_dense_grad_hook(
        resumed, CommState(CommConfig(dense_grads=CommPrecision.FP32, row_dim=32), backend="gloo")
    )
    compressor2.load_state_dict(saved)
    resumed(x).sum().backward()
    ref(x).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, p in resumed.module.named_parameters():
        delta = (p.grad - ref_params[name].grad).reshape(-1)
        torch.testing.assert_close(delta, residuals[name].reshape(-1), rtol=0, atol=1e-5)
    # The residuals were consumed (flushed at FP32): nothing is added a second time.
    assert compressor2.state_dict()["residuals_by_param"] == {}


def test_checkpointing_a_residual_needs_parameter_names() -> None:
    state = CommState(CommConfig(dense_grads=CommPrecision.FP8, row_dim=32), backend="gloo")
    compressor = DenseGradCompressor(state)
    compressor.reduce(torch.randn(64), 0, (1, 2), (32, 32)).wait()
    with pytest.raises(ValueError, match="param_names"):
        compressor.state_dict()


def test_a_bucket_dropped_by_ddps_rebuild_leaves_no_residual_in_the_checkpoint() -> None:
    """Step 0 with two buckets at BF16 leaves a residual in bucket 1; DDP then rebuilds into one
    bucket and the channel runs at FP32 (flushing bucket 0's residual). Bucket 1's old
    residual is never used again, so a resumed run must not get it back."""
    state = CommState(CommConfig(dense_grads=CommPrecision.BF16, row_dim=32), backend="gloo")
    compressor = DenseGradCompressor(state, param_names={1: "a", 2: "b"})
    ga, gb = torch.randn(10) * 1.001, torch.randn(20) * 1.001
    state.begin_step(0)
    compressor.reduce(ga.clone(), 0, (1,), (10,)).wait()
    compressor.reduce(gb.clone(), 1, (2,), (20,)).wait()
    assert set(compressor.residuals) == {0, 1}
    state.set_precision(CommChannel.DENSE_GRAD, CommPrecision.FP32, source=PrecisionSource.POLICY)
    for step in (1, 2):
        state.begin_step(step)
        compressor.reduce(torch.cat([gb, ga]), 0, (2, 1), (20, 10)).wait()
    assert compressor.state_dict()["residuals_by_param"] == {}


def test_restored_residuals_that_cannot_be_used_are_counted() -> None:
    """An older checkpoint (residuals per bucket) and a residual whose parameter changed size
    are dropped: logged and counted (the run report lists the count), never silently."""
    state = CommState(CommConfig(dense_grads=CommPrecision.FP32, row_dim=32), backend="gloo")
    compressor = DenseGradCompressor(state, param_names={1: "a", 2: "b"})
    compressor.load_state_dict({"residuals": {0: torch.ones(30)}})
    assert compressor.num_dropped_residuals == 1
    compressor.load_state_dict({"residuals_by_param": {"a": torch.ones(10), "b": torch.ones(7)}})
    state.begin_step(0)
    ga, gb = torch.randn(10), torch.randn(20)
    sent = compressor.reduce(torch.cat([ga, gb]), 0, (1, 2), (10, 20)).wait()
    assert compressor.num_dropped_residuals == 2  # "b" had 7 values, the parameter 20
    torch.testing.assert_close(sent, torch.cat([ga + 1, gb]))  # "a" fed back, "b" from zero
