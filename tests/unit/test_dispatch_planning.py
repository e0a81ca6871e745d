"""Dispatch's pure planning functions at their edges (``loka_train.dispatch.planning``).

The speed objective takes FP8 only at a speed-up of at least ``1 + margin``; safety comes
first whatever the speed; the hysteresis moves at once only to a safer plan. These tests fail
when the margin is dropped from the speed rule (``< 1.0 + margin`` -> ``< 1.0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from loka_train.dispatch import DispatchConfig, Dispatcher
from loka_train.dispatch.planning import (
    HysteresisStep,
    Target,
    eligible,
    hysteresis,
    plan_for,
    target,
    verdict_of,
)
from loka_train.dispatch.timing import timing_key
from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.plan import GemmPlan, LinearPlan

SHAPE = (256, 64, 32)
CFG = DispatchConfig(scalings=("tensorwise", "rowwise"), backends=("emulated",))
TENSORWISE = plan_for(CFG, "forward", "tensorwise", "emulated")
ROWWISE = plan_for(CFG, "forward", "rowwise", "emulated")
HIGH = GemmPlan()


@dataclass
class _Verdict:
    safe: bool
    fmt_b: Fp8Format = Fp8Format.E4M3
    reason: str = "verdict"
    sqnr_lo_db: float = 30.0
    budget_db: float = 20.0


def _verdicts(**safe_by_scaling: bool) -> dict:
    """Forward verdicts of site "s" for the e4m3 candidates, safe or not by scaling name."""
    return {
        ("s", "forward", plan.fmt, plan.scaling): _Verdict(
            safe=safe_by_scaling[plan.scaling.value],
            reason="safe" if safe_by_scaling[plan.scaling.value] else "unsafe: SQNR too low",
        )
        for plan in (TENSORWISE, ROWWISE)
        if plan.scaling.value in safe_by_scaling
    }


def _target(
    speedup: float,
    *,
    objective: str = "speed",
    margin: float = 0.05,
    current: GemmPlan = HIGH,
    verdicts: dict | None = None,
    candidates: tuple[GemmPlan, ...] = (ROWWISE,),
) -> Target:
    """The target of forward GEMM of site "s" when every FP8 candidate takes 1 s and high
    precision ``speedup`` s."""
    verdicts = _verdicts(rowwise=True) if verdicts is None else verdicts
    times = {p: 1.0 for p in eligible(verdicts, "s", "forward", candidates)}
    return target(
        site="s", role="forward", current=current, shape=SHAPE, candidates=list(candidates),
        verdicts=verdicts, times=times, t_high=speedup, objective=objective, margin=margin,
        measured=True,
    )


# ------------------------------------------------------------------------------ speed margin


@pytest.mark.parametrize("speedup", [1.0001, 1.02, 1.049])
def test_a_speed_up_between_one_and_one_plus_margin_keeps_high_precision(speedup: float) -> None:
    t = _target(speedup, margin=0.05)
    assert t.plan == HIGH, t
    assert "< 1+margin 1.05" in t.reason
    assert not t.urgent


@pytest.mark.parametrize("speedup", [1.06, 1.5, 3.0])
def test_a_speed_up_above_one_plus_margin_takes_fp8(speedup: float) -> None:
    t = _target(speedup, margin=0.05)
    assert t.plan == ROWWISE, t
    assert t.reason.startswith("safe (SQNR p-lo 30.0 dB >= 20.0)")


def test_a_speed_up_of_exactly_one_plus_margin_takes_fp8() -> None:
    """The rule is "at least 1 + margin" (powers of two: the sums are exact)."""
    assert _target(1.25, margin=0.25).plan == ROWWISE
    assert _target(1.25 - 2**-20, margin=0.25).plan == HIGH


def test_a_zero_margin_takes_fp8_at_parity_only_if_not_slower() -> None:
    assert _target(1.0, margin=0.0).plan == ROWWISE
    assert _target(0.999, margin=0.0).plan == HIGH


def test_a_larger_margin_keeps_more_gemms_high() -> None:
    assert _target(1.2, margin=0.1).plan == ROWWISE
    assert _target(1.2, margin=0.3).plan == HIGH


def test_coverage_takes_safe_fp8_whatever_its_speed() -> None:
    slower = _target(0.5, objective="coverage")
    assert slower.plan == ROWWISE
    assert "taken for coverage although slower" in slower.reason
    between = _target(1.02, objective="coverage")
    assert between.plan == ROWWISE and "although slower" not in between.reason


# ----------------------------------------------------------------------------------- safety


@pytest.mark.parametrize("objective", ["speed", "coverage"])
@pytest.mark.parametrize("speedup", [1.02, 2.0, 100.0])
def test_an_unsafe_verdict_keeps_high_precision_whatever_the_speed(objective: str, speedup: float) -> None:
    t = _target(speedup, objective=objective, verdicts=_verdicts(rowwise=False))
    assert t.plan == HIGH, t
    assert t.reason.startswith("no safe FP8: rowwise: unsafe: SQNR too low")
    assert not t.urgent


@pytest.mark.parametrize("speedup", [2.0, 100.0])
def test_a_missing_verdict_keeps_high_precision(speedup: float) -> None:
    t = _target(speedup, verdicts={})
    assert t.plan == HIGH and "no verdict" in t.reason


def test_a_verdict_for_another_operand_b_format_is_not_used() -> None:
    verdicts = {("s", "forward", ROWWISE.fmt, ROWWISE.scaling): _Verdict(safe=True, fmt_b=Fp8Format.E5M2)}
    v, why = verdict_of(verdicts, "s", "forward", ROWWISE)
    assert v is None and "operand b in e4m3" in why
    assert eligible(verdicts, "s", "forward", [ROWWISE]) == []
    assert _target(10.0, verdicts=verdicts).plan == HIGH


def test_a_current_fp8_plan_turned_unsafe_moves_to_high_urgently() -> None:
    t = _target(10.0, current=ROWWISE, verdicts=_verdicts(rowwise=False))
    assert t.plan == HIGH and t.urgent
    assert t.reason == "unsafe: SQNR too low"


@pytest.mark.parametrize(
    ("verdicts", "reason"),
    [
        ({}, "unsafe: no verdict for the current plan"),
        (
            {("s", "forward", ROWWISE.fmt, ROWWISE.scaling): _Verdict(
                safe=False, reason="unsafe (hysteresis): within the 1 dB margin")},
            "unsafe (hysteresis): within the 1 dB margin",
        ),
    ],
)
def test_an_unsafe_current_plan_names_unsafe_once(verdicts: dict, reason: str) -> None:
    """The reason reads ``unsafe: <why>`` whether the Probe's verdict already says "unsafe" or
    there is no verdict at all; never ``unsafe: unsafe: ...``."""
    t = _target(10.0, current=ROWWISE, verdicts=verdicts)
    assert t.plan == HIGH and t.urgent
    assert t.reason == reason
    assert "unsafe: unsafe" not in t.reason


def test_a_current_fp8_plan_turned_unsafe_moves_to_a_safe_one_urgently() -> None:
    t = _target(
        10.0, current=TENSORWISE, verdicts=_verdicts(tensorwise=False, rowwise=True),
        candidates=(TENSORWISE, ROWWISE),
    )
    assert t.plan == ROWWISE and t.urgent
    assert t.reason.startswith("unsafe: SQNR too low; moved to fp8:e4m3/rowwise@emulated which is safe")


def test_a_current_fp8_plan_turned_unsafe_moves_urgently_even_to_a_slow_high() -> None:
    """Safety before speed: high precision although FP8 was 10x faster, and at once."""
    t = _target(10.0, current=ROWWISE, verdicts=_verdicts(rowwise=False), objective="coverage")
    assert t.plan == HIGH and t.urgent


# ------------------------------------------------------------------------ among candidates


def test_the_fastest_safe_candidate_wins_and_a_tie_goes_to_the_config_order() -> None:
    verdicts = _verdicts(tensorwise=True, rowwise=True)
    candidates = [TENSORWISE, ROWWISE]

    def pick(t_tensorwise: float, t_rowwise: float) -> GemmPlan:
        return target(
            site="s", role="forward", current=HIGH, shape=SHAPE, candidates=candidates,
            verdicts=verdicts, times={TENSORWISE: t_tensorwise, ROWWISE: t_rowwise}, t_high=10.0,
            objective="speed", margin=0.05, measured=False,
        ).plan

    assert pick(1.0, 2.0) == TENSORWISE
    assert pick(2.0, 1.0) == ROWWISE
    assert pick(1.0, 1.0) == TENSORWISE


def test_a_candidate_whose_benchmark_failed_is_rejected_with_its_error() -> None:
    t = target(
        site="s", role="forward", current=HIGH, shape=SHAPE, candidates=[ROWWISE],
        verdicts=_verdicts(rowwise=True), times={ROWWISE: math.inf}, t_high=10.0,
        objective="coverage", margin=0.05, measured=True, failures={ROWWISE: "RuntimeError: boom"},
    )
    assert t.plan == HIGH
    assert "its benchmark failed (RuntimeError: boom)" in t.reason


def test_no_candidate_keeps_high_precision() -> None:
    t = _target(10.0, candidates=())
    assert t.plan == HIGH and t.reason == "no safe FP8: no FP8 candidate for forward"


# ------------------------------------------------------------------------------- hysteresis


def test_the_current_plan_as_target_clears_a_pending_move() -> None:
    step = hysteresis(ROWWISE, Target(ROWWISE, "same", False), (str(TENSORWISE), 1), intervals=2)
    assert step == HysteresisStep(apply=False, pending=None, held=None)


def test_an_urgent_target_moves_at_once() -> None:
    step = hysteresis(ROWWISE, Target(HIGH, "unsafe", True), (str(TENSORWISE), 1), intervals=5)
    assert step == HysteresisStep(apply=True, pending=None, held=None)


def test_a_new_target_must_hold_for_the_configured_intervals() -> None:
    new = Target(ROWWISE, "safe and faster", False)
    first = hysteresis(HIGH, new, None, intervals=3)
    assert first == HysteresisStep(apply=False, pending=(str(ROWWISE), 1), held=None)
    second = hysteresis(HIGH, new, first.pending, intervals=3)
    assert second == HysteresisStep(apply=False, pending=(str(ROWWISE), 2), held=None)
    third = hysteresis(HIGH, new, second.pending, intervals=3)
    assert third == HysteresisStep(apply=True, pending=None, held=3)


def test_another_target_restarts_the_count() -> None:
    pending = (str(TENSORWISE), 1)
    step = hysteresis(HIGH, Target(ROWWISE, "faster", False), pending, intervals=2)
    assert step == HysteresisStep(apply=False, pending=(str(ROWWISE), 1), held=None)


def test_one_interval_of_hysteresis_moves_at_the_first_interval() -> None:
    step = hysteresis(HIGH, Target(ROWWISE, "faster", False), None, intervals=1)
    assert step == HysteresisStep(apply=True, pending=None, held=1)


def test_a_non_urgent_move_to_high_precision_is_held_too() -> None:
    """Only a safety-driven move skips the hysteresis; FP8 becoming slower does not."""
    step = hysteresis(ROWWISE, Target(HIGH, "speed-up below margin", False), None, intervals=2)
    assert step == HysteresisStep(apply=False, pending=(str(HIGH), 1), held=None)


# ----------------------------------------------------------------- through the Dispatcher


@pytest.mark.parametrize(("speedup", "fp8"), [(1.03, False), (1.08, True)])
def test_the_dispatcher_applies_the_margin_to_its_timings(speedup: float, fp8: bool) -> None:
    """replan with the timings already cached: the 5% margin decides, held one interval."""
    d = Dispatcher(
        DispatchConfig(objective="speed", margin=0.05, scalings=("rowwise",), backends=("emulated",),
                       fp8_roles=("forward",), hysteresis_intervals=1),
        device="cpu",
    )
    d.register("s", plan=LinearPlan.high_precision(), shapes={"forward": SHAPE})
    d.timer.timings[timing_key("forward", SHAPE, ROWWISE)] = 1e-5
    d.timer.timings[timing_key("forward", SHAPE, None)] = speedup * 1e-5
    changes = d.replan(step=7, verdicts=_verdicts(rowwise=True))
    assert d.plans["s"].forward == (ROWWISE if fp8 else HIGH)
    assert [(c.step, c.role, c.new) for c in changes] == ([(7, "forward", str(ROWWISE))] if fp8 else [])
    if fp8:
        assert changes[0].reason.endswith("(cost model) [held 1 intervals]")
