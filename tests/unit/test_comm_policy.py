"""CommPolicy: thresholds, hysteresis (dB band and patience), bounds, single-process update.

Thresholds used here (CommConfig defaults): forward lower 25 dB / raise 20 dB.
"""

from __future__ import annotations

import math

import torch

from loka_train.comm import (
    Action,
    CommChannel,
    CommConfig,
    CommPolicy,
    CommPrecision,
    CommState,
    PrecisionSource,
    SwitchableCodec,
)

FWD = CommChannel.A2A_FWD
FP32, BF16, FP8 = CommPrecision.FP32, CommPrecision.BF16, CommPrecision.FP8


def _policy(**overrides: object) -> tuple[CommState, CommPolicy]:
    fields: dict[str, object] = {"adaptive_channels": (FWD,), "lower_patience": 3}
    fields.update(overrides)
    state = CommState(CommConfig(**fields), backend="gloo")  # type: ignore[arg-type]
    return state, CommPolicy(state)


def _feed(policy: CommPolicy, step: int, **sqnr: float) -> list[tuple[str, str]]:
    measured = {CommPrecision[name]: value for name, value in sqnr.items()}
    return [(e.old.name, e.new.name) for e in policy.apply({FWD: measured}, step=step)]


def test_lowers_to_cheapest_acceptable_after_patience() -> None:
    state, policy = _policy()
    assert _feed(policy, 0, BF16=55.0, FP8=30.0) == []
    assert _feed(policy, 1, BF16=55.0, FP8=30.0) == []
    assert state.precision(FWD) is FP32
    assert _feed(policy, 2, BF16=55.0, FP8=30.0) == [("FP32", "FP8")]  # skips BF16
    assert state.precision(FWD) is FP8
    assert [(e.step, e.new) for e in state.stats.switches] == [(2, FP8)]


def test_interrupted_streak_restarts_patience() -> None:
    state, policy = _policy()
    _feed(policy, 0, FP8=30.0)
    _feed(policy, 1, FP8=30.0)
    assert _feed(policy, 2, FP8=24.0) == []  # in the band: stay, streak reset
    assert _feed(policy, 3, FP8=30.0) == []
    assert _feed(policy, 4, FP8=30.0) == []
    assert _feed(policy, 5, FP8=30.0) == [("FP32", "FP8")]


def test_changing_target_restarts_patience() -> None:
    state, policy = _policy()
    _feed(policy, 0, BF16=55.0, FP8=30.0)  # target FP8
    _feed(policy, 1, BF16=55.0, FP8=30.0)
    assert _feed(policy, 2, BF16=55.0, FP8=10.0) == []  # target BF16: count 1
    assert _feed(policy, 3, BF16=55.0, FP8=10.0) == []
    assert _feed(policy, 4, BF16=55.0, FP8=10.0) == [("FP32", "BF16")]


def test_raises_at_once_to_cheapest_precision_that_would_not_lower_again() -> None:
    state, policy = _policy()
    state.set_precision(FWD, FP8, source=PrecisionSource.EXPLICIT)
    assert _feed(policy, 0, BF16=50.0, FP8=15.0) == [("FP8", "BF16")]
    state.set_precision(FWD, FP8, source=PrecisionSource.EXPLICIT)
    # BF16 itself too noisy (< lower threshold 25): go to the most precise rung.
    assert _feed(policy, 1, BF16=22.0, FP8=15.0) == [("FP8", "FP32")]


def test_band_between_thresholds_holds_precision() -> None:
    state, policy = _policy(lower_patience=1)
    state.set_precision(FWD, FP8, source=PrecisionSource.EXPLICIT)
    for step in range(5):  # 22 dB: not below raise (20), not enough to lower (nothing below)
        assert _feed(policy, step, BF16=50.0, FP8=22.0) == []
    assert state.precision(FWD) is FP8
    state.set_precision(FWD, BF16, source=PrecisionSource.EXPLICIT)
    for step in range(5):  # BF16 fine, FP8 at 24 dB: below the lower threshold, stay
        assert _feed(policy, step, BF16=50.0, FP8=24.0) == []
    assert state.precision(FWD) is BF16


def test_nan_measurement_raises() -> None:
    state, policy = _policy()
    state.set_precision(FWD, FP8, source=PrecisionSource.EXPLICIT)
    assert _feed(policy, 0, BF16=50.0, FP8=math.nan) == [("FP8", "BF16")]


def test_raise_patience_and_no_data_keep_streak() -> None:
    state, policy = _policy(raise_patience=2)
    state.set_precision(FWD, FP8, source=PrecisionSource.EXPLICIT)
    assert _feed(policy, 0, BF16=50.0, FP8=15.0) == []
    assert policy.apply({}, step=1) == []  # no measurement: neither resets nor counts
    assert _feed(policy, 2, BF16=50.0, FP8=15.0) == [("FP8", "BF16")]


def test_min_and_max_precision_bound_the_ladder() -> None:
    state, policy = _policy(min_precision=BF16, lower_patience=1)
    assert state.ladder(FWD) == (FP32, BF16)
    assert _feed(policy, 0, BF16=55.0, FP8=40.0) == [("FP32", "BF16")]

    state, policy = _policy(max_precision=BF16, a2a_forward=FP8)
    assert state.ladder(FWD) == (BF16, FP8)
    assert _feed(policy, 0, BF16=22.0, FP8=10.0) == [("FP8", "BF16")]  # never FP32
    state.set_precision(FWD, BF16, source=PrecisionSource.EXPLICIT)
    proposal = policy.propose(FWD, {BF16: 10.0})
    assert proposal.action is Action.STAY and "no more precise rung" in proposal.reason


def test_backward_channels_use_backward_thresholds() -> None:
    state, policy = _policy(adaptive_channels=(CommChannel.A2A_BWD,), lower_patience=1)
    switches = policy.apply({CommChannel.A2A_BWD: {BF16: 50.0, FP8: 22.0}}, step=0)
    assert [(e.channel, e.new) for e in switches] == [(CommChannel.A2A_BWD, FP8)]  # 22 >= 20


def test_static_channels_are_left_alone() -> None:
    state, policy = _policy()
    assert policy.apply({CommChannel.A2A_BWD: {FP8: 60.0}}, step=0) == []
    assert state.precision(CommChannel.A2A_BWD) is FP32


def test_update_single_process_from_codec_measurements() -> None:
    state, policy = _policy(lower_patience=2, sample_every=1, policy_interval=2)
    codec = SwitchableCodec(state, FWD)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    switched_at = []
    for step in range(8):
        state.begin_step(step)
        codec.encode(x, codec.create_context())
        state.end_step()
        if policy.maybe_update(step):
            switched_at.append(step)
    # Updates after steps 1, 3, 5, 7; the second consecutive FP8 proposal switches (step 3).
    assert switched_at == [3]
    assert state.precision(FWD) is FP8
    assert set(policy.metrics()) == {"comm/a2a_fwd/sqnr_db/bf16", "comm/a2a_fwd/sqnr_db/fp8"}
    assert 28 < policy.last_sqnr_db[FWD][FP8] < 38
    assert state.sqnr_sums.abs().sum() == 0


def test_state_dict_restores_pending_streak() -> None:
    state, policy = _policy()
    _feed(policy, 0, FP8=30.0)
    _feed(policy, 1, FP8=30.0)
    saved = policy.state_dict()
    state2, policy2 = _policy()
    policy2.load_state_dict(saved)
    assert _feed(policy2, 2, FP8=30.0) == [("FP32", "FP8")]
