"""CommState checkpoints: what a resumed run gets back."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from loka_train.comm import CommChannel, CommConfig, CommPrecision, CommState
from loka_train.comm.state import PrecisionSource
from loka_train.comm.stats import SwitchEvent


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_keeps_interval_sums_and_statistics() -> None:
    cfg = CommConfig(adaptive_channels=(CommChannel.A2A_FWD,), sample_every=1)
    state = CommState(cfg, backend="gloo")
    state.begin_step(0)
    state.measure(CommChannel.A2A_FWD, torch.randn(4, 64))
    state.stats.record(CommChannel.A2A_FWD, CommPrecision.FP32, 1000)
    state.set_precision(CommChannel.A2A_FWD, CommPrecision.BF16, source=PrecisionSource.POLICY)
    state.stats.switches.append(
        SwitchEvent(step=0, channel=CommChannel.A2A_FWD, old=CommPrecision.FP32,
                    new=CommPrecision.BF16, reason="test")
    )
    state.end_step()
    saved = _roundtrip(state.state_dict())

    resumed = CommState(cfg, backend="gloo")
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.sqnr_sums, state.sqnr_sums)
    assert resumed.sqnr_sums.abs().sum() > 0  # a policy interval in progress
    assert resumed.precision(CommChannel.A2A_FWD) is CommPrecision.BF16
    assert resumed.report()["channels"] == state.report()["channels"]
    assert resumed.report()["switches"] == state.report()["switches"] != []
    assert resumed.stats.total_bytes[CommChannel.A2A_FWD] == 1000


def test_static_channel_keeps_the_configured_precision(caplog: pytest.LogCaptureFixture) -> None:
    """A user who resumes with dense_grads=FP32 to get rid of FP8 gets FP32."""
    saved = CommState(CommConfig(dense_grads=CommPrecision.FP8), backend="gloo").state_dict()
    resumed = CommState(CommConfig(dense_grads=CommPrecision.FP32), backend="gloo")
    with caplog.at_level(logging.WARNING, logger="loka_train.comm.state"):
        resumed.load_state_dict(_roundtrip(saved))
    assert resumed.precision(CommChannel.DENSE_GRAD) is CommPrecision.FP32
    assert "dense_grad ran at FP8 in the checkpoint" in caplog.text


def test_precision_only_checkpoints_still_load() -> None:
    saved = {"precisions": {CommChannel.A2A_FWD.value: CommPrecision.FP16.value}}
    cfg = CommConfig(adaptive_channels=(CommChannel.A2A_FWD,))
    resumed = CommState(cfg, backend="gloo")
    resumed.load_state_dict(saved)
    assert resumed.precision(CommChannel.A2A_FWD) is CommPrecision.FP16


def test_evaluation_collectives_are_counted_apart_and_not_measured() -> None:
    cfg = CommConfig(adaptive_channels=(CommChannel.A2A_FWD,), sample_every=1)
    state = CommState(cfg, backend="gloo")
    state.begin_step(0)  # a sampled step
    state.stats.record(CommChannel.A2A_FWD, CommPrecision.FP32, 1000)
    state.begin_eval()
    assert not state.sampling
    state.stats.record(CommChannel.A2A_FWD, CommPrecision.FP32, 500)
    state.end_eval()
    assert state.sampling  # the rest of the training step is still sampled
    metrics = state.end_step()
    assert metrics["comm/a2a_fwd/bytes"] == 1000.0
    assert metrics["comm/a2a_fwd/calls"] == 1.0
    channel = state.report()["channels"]["a2a_fwd"]
    assert (channel["total_bytes"], channel["eval_bytes"]) == (1000, 500)
