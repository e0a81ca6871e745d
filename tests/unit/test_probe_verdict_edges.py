"""Edges of the pure verdict function (:func:`loka_train.probe.verdicts.judge`), fed with
hand-built window statistics: the low-quantile bound against the budget, the margin and the
hysteresis streak, the minimum number of samples, the upper quantile of the fractions, and
non-finite values.

Shape legend: S sites (1), R roles (3), W window slots, C candidates (1).
"""

from __future__ import annotations

import pytest
import torch

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import candidates_of
from loka_train.probe.config import ProbeConfig
from loka_train.probe.verdicts import KeyState, Verdict, VerdictKey, judge

BUDGET = 20.0
KEY: VerdictKey = ("s", "forward", Fp8Format.E4M3, Scaling.ROWWISE)


def _cfg(**overrides) -> ProbeConfig:
    base = dict(
        formats=("e4m3",),
        scalings=("rowwise",),
        window=10,
        min_samples=4,
        quantile=0.1,
        margin_db=1.0,
        hysteresis_intervals=2,
        sqnr_budget_db={role: BUDGET for role in ROLES},
    )
    base.update(overrides)
    return ProbeConfig(**base)


def _stats(
    sqnr_db_W: list[float],
    *,
    valid_W: list[bool] | None = None,
    saturation_a_W: list[float] | None = None,
    underflow_b_W: list[float] | None = None,
    nonfinite_a_W: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Reduced window statistics, [1, R, W, ...], the same window for every role."""
    W = len(sqnr_db_W)

    def per_slot(values_W: list[float] | None, fill: float) -> torch.Tensor:
        v = torch.full((W,), fill, dtype=torch.float64) if values_W is None else torch.tensor(values_W, dtype=torch.float64)
        return v.expand(1, len(ROLES), W).clone()

    valid = torch.ones(W, dtype=torch.bool) if valid_W is None else torch.tensor(valid_W)
    stats = {
        "valid": valid.expand(1, len(ROLES), W).clone(),
        "sqnr_db": per_slot(sqnr_db_W, 0.0)[..., None],
        "saturation_a": per_slot(saturation_a_W, 0.0)[..., None],
        "saturation_b": per_slot(None, 0.0)[..., None],
        "underflow_a": per_slot(None, 0.0)[..., None],
        "underflow_b": per_slot(underflow_b_W, 0.0)[..., None],
        "nonfinite_a": per_slot(nonfinite_a_W, 0.0),
        "nonfinite_b": per_slot(None, 0.0),
    }
    for o in ("a", "b"):
        stats[f"amax_{o}"] = per_slot(None, 1.0)
        stats[f"outlier_ratio_{o}"] = per_slot(None, 3.0)
        stats[f"row_spread_{o}"] = per_slot(None, 2.0)
    return stats


def _judge(
    stats: dict[str, torch.Tensor],
    cfg: ProbeConfig,
    *,
    prev: KeyState | None = None,
    new_data: bool = True,
) -> tuple[Verdict, KeyState, bool]:
    """The verdict and key state of ``KEY`` (forward), and whether its verdict changed."""
    key_states = {} if prev is None else {KEY: prev}
    update = judge(
        stats,
        config=cfg,
        sites=["s"],
        budgets={"s": cfg.sqnr_budget_db},
        candidates=candidates_of(cfg),
        new_data=[[new_data] * len(ROLES)],
        key_states=key_states,
        step=7,
    )
    verdict = update.verdicts[KEY]
    return verdict, update.key_states[KEY], any(v is verdict for v in update.changes)


SAFE = KeyState(safe=True, streak=0)


# ------------------------------------------------------------------ the low quantile


def test_low_quantile_under_budget_with_median_over_is_unsafe() -> None:
    # One sample of ten under the budget: p10 (lower-interpolated) is that sample, the
    # median is far over the budget and over the margin.
    sqnr = [30.0, 31.0, 29.0, 15.0, 32.0, 30.5, 29.5, 31.5, 30.0, 28.0]
    verdict, state, changed = _judge(_stats(sqnr), _cfg(), prev=SAFE)
    assert verdict.sqnr_median_db > BUDGET + 1.0
    assert verdict.sqnr_lo_db == 15.0
    assert not verdict.safe and state == KeyState(False, 0)
    assert "sqnr p10 15.0 dB < budget 20.0 dB" in verdict.reason
    assert changed  # safe -> unsafe at once


def test_low_quantile_clearing_the_budget_is_safe() -> None:
    sqnr = [30.0, 31.0, 29.0, 22.0, 32.0, 30.5, 29.5, 31.5, 30.0, 28.0]
    verdict, state, changed = _judge(_stats(sqnr), _cfg(), prev=SAFE)
    assert verdict.sqnr_lo_db == 22.0
    assert verdict.safe and state == SAFE
    assert verdict.reason.startswith("safe: sqnr p10 22.0 dB vs budget 20.0 dB")
    assert not changed


@pytest.mark.parametrize("quantile, expected", [(0.0, 10.0), (0.1, 10.0), (0.25, 11.0), (0.3, 12.0), (0.5, 13.0)])
def test_the_bound_is_the_configured_quantile_taken_lower(quantile: float, expected: float) -> None:
    # Sorted: 10, 11, 12, 13, 14, 15, 16, 17 (W = 8): lower interpolation at q * (n - 1).
    sqnr = [17.0, 10.0, 15.0, 12.0, 16.0, 11.0, 14.0, 13.0]
    verdict, _, _ = _judge(_stats(sqnr), _cfg(window=8, quantile=quantile))
    assert verdict.sqnr_lo_db == expected
    assert verdict.sqnr_median_db == 13.0


def test_invalid_slots_are_not_part_of_the_window() -> None:
    # Empty slots hold zeros (as a fresh ring buffer does): a 0 dB "sample" must not count.
    sqnr = [0.0, 0.0, 30.0, 31.0, 29.0, 30.0, 0.0, 30.0]
    valid = [False, False, True, True, True, True, False, True]
    verdict, _, _ = _judge(_stats(sqnr, valid_W=valid), _cfg(window=8), prev=SAFE)
    assert verdict.safe and verdict.num_samples == 5 and verdict.sqnr_lo_db == 29.0


def test_budget_edges_with_and_without_margin() -> None:
    cfg = _cfg(hysteresis_intervals=1)
    at_budget = [BUDGET] * 6
    # Safe stays safe at exactly the budget (the bound is "lo < budget").
    verdict, state, _ = _judge(_stats(at_budget), cfg, prev=SAFE)
    assert verdict.safe and state == SAFE
    # Unsafe turns safe only at budget + margin_db (inclusive) ...
    verdict, state, _ = _judge(_stats(at_budget), cfg, prev=KeyState(False, 0))
    assert not verdict.safe and state == KeyState(False, 0)
    assert "within the 1 dB margin" in verdict.reason
    verdict, state, changed = _judge(_stats([BUDGET + 1.0] * 6), cfg, prev=KeyState(False, 0))
    assert verdict.safe and state == SAFE and changed
    # ... and just under it is still within the margin.
    verdict, _, _ = _judge(_stats([BUDGET + 0.99] * 6), cfg, prev=KeyState(False, 0))
    assert not verdict.safe


# ------------------------------------------------------------------ streak (hysteresis)


def test_unsafe_to_safe_needs_consecutive_clear_intervals_with_new_data() -> None:
    cfg = _cfg(hysteresis_intervals=3)
    clear, within = _stats([30.0] * 6), _stats([20.5] * 6)
    state = KeyState(False, 0)
    verdict, state, _ = _judge(clear, cfg, prev=state)
    assert not verdict.safe and state == KeyState(False, 1)
    assert "bounds clear for 1/3 intervals" in verdict.reason
    # An interval without new samples neither advances nor resets the streak.
    verdict, state, _ = _judge(clear, cfg, prev=state, new_data=False)
    assert not verdict.safe and state == KeyState(False, 1)
    verdict, state, _ = _judge(clear, cfg, prev=state)
    assert state == KeyState(False, 2)
    # Within the margin: the streak starts over.
    verdict, state, _ = _judge(within, cfg, prev=state)
    assert not verdict.safe and state == KeyState(False, 0)
    for expected in (1, 2):
        verdict, state, _ = _judge(clear, cfg, prev=state)
        assert not verdict.safe and state == KeyState(False, expected)
    verdict, state, changed = _judge(clear, cfg, prev=state)
    assert verdict.safe and state == KeyState(True, 0) and changed


def test_a_failure_resets_the_streak_and_safe_to_unsafe_is_immediate() -> None:
    cfg = _cfg(hysteresis_intervals=2)
    _, state, _ = _judge(_stats([30.0] * 5 + [10.0]), cfg, prev=KeyState(False, 1))
    assert state == KeyState(False, 0)
    # Safe and within the margin stays safe (the band only holds back unsafe -> safe) ...
    verdict, state, _ = _judge(_stats([20.5] * 6), cfg, prev=SAFE)
    assert verdict.safe and state == SAFE
    # ... a failing bound is never waited out.
    verdict, state, changed = _judge(_stats([19.9] * 6), cfg, prev=SAFE)
    assert not verdict.safe and state == KeyState(False, 0) and changed


def test_missing_key_state_starts_unsafe() -> None:
    verdict, state, changed = _judge(_stats([30.0] * 6), _cfg(hysteresis_intervals=1))
    assert verdict.safe and state == SAFE and changed
    verdict, state, changed = _judge(_stats([30.0] * 6), _cfg(hysteresis_intervals=2))
    assert not verdict.safe and state == KeyState(False, 1) and not changed


# ------------------------------------------------------------------ minimum observations


def test_fewer_valid_samples_than_min_samples_is_unsafe() -> None:
    cfg = _cfg(min_samples=4, window=6)
    valid = [True, True, True, False, False, False]
    verdict, state, _ = _judge(_stats([30.0] * 6, valid_W=valid), cfg, prev=SAFE)
    assert not verdict.safe and state == KeyState(False, 0) and verdict.num_samples == 3
    assert "3 samples < min_samples 4" in verdict.reason
    valid[3] = True
    verdict, _, _ = _judge(_stats([30.0] * 6, valid_W=valid), cfg, prev=SAFE)
    assert verdict.safe and verdict.num_samples == 4


def test_an_empty_window_is_unsafe_with_nan_bounds() -> None:
    verdict, _, _ = _judge(_stats([0.0] * 4, valid_W=[False] * 4), _cfg(window=4), prev=SAFE)
    assert not verdict.safe and verdict.num_samples == 0
    assert verdict.sqnr_lo_db != verdict.sqnr_lo_db  # NaN
    assert "0 samples < min_samples 4" in verdict.reason and "budget" not in verdict.reason


# ------------------------------------------------------------------ fractions and non-finite values


def test_saturation_and_underflow_use_the_mirrored_upper_quantile() -> None:
    cfg = _cfg(quantile=0.1, max_saturation_fraction=1e-3, max_underflow_fraction=1e-3)
    # One saturating sample of ten: the p90 taken higher is that sample.
    saturation = [0.0] * 9 + [5e-3]
    verdict, _, _ = _judge(_stats([30.0] * 10, saturation_a_W=saturation), cfg, prev=SAFE)
    assert not verdict.safe and verdict.saturation == 5e-3
    assert "saturation 0.50% > 0.10% at rowwise e4m3xe4m3 (operand a)" in verdict.reason
    underflow = [0.0] * 9 + [2e-3]
    verdict, _, _ = _judge(_stats([30.0] * 10, underflow_b_W=underflow), cfg, prev=SAFE)
    assert not verdict.safe and "underflow 0.20% > 0.10%" in verdict.reason and "(operand b)" in verdict.reason
    # Under the limit but above the margin-shrunk limit: safe stays safe, unsafe does not clear.
    near = [0.0] * 9 + [0.9e-3]
    verdict, _, _ = _judge(_stats([30.0] * 10, saturation_a_W=near), cfg, prev=SAFE)
    assert verdict.safe
    verdict, state, _ = _judge(_stats([30.0] * 10, saturation_a_W=near), cfg, prev=KeyState(False, 1))
    assert not verdict.safe and state == KeyState(False, 0)


def test_nonfinite_values_in_the_window_are_unsafe() -> None:
    nonfinite = [0.0] * 5 + [3.0]
    verdict, state, _ = _judge(_stats([30.0] * 6, nonfinite_a_W=nonfinite), _cfg(), prev=SAFE)
    assert not verdict.safe and state == KeyState(False, 0) and verdict.num_nonfinite == 3
    assert "non-finite values in the window (a 3, b 0)" in verdict.reason


def test_a_disabled_probe_never_judges_safe() -> None:
    verdict, _, _ = _judge(_stats([30.0] * 6), _cfg(enabled=False), prev=SAFE)
    assert not verdict.safe and "probe disabled" in verdict.reason


# ------------------------------------------------------------------ purity


def test_judge_leaves_its_inputs_alone_and_covers_every_key() -> None:
    stats = _stats([30.0] * 5 + [10.0])
    before = {k: v.clone() for k, v in stats.items()}
    key_states = {KEY: SAFE}
    update = judge(
        stats, config=_cfg(), sites=["s"], budgets={"s": _cfg().sqnr_budget_db},
        candidates=candidates_of(_cfg()), new_data=[[True] * 3], key_states=key_states, step=3,
    )
    assert key_states == {KEY: SAFE}
    assert all(torch.equal(before[k], stats[k]) for k in stats)
    assert list(update.verdicts) == [("s", role, Fp8Format.E4M3, Scaling.ROWWISE) for role in ROLES]
    assert list(update.key_states) == list(update.verdicts)
    assert [name for name, _ in update.series] == [f"s/{role}/e4m3_rowwise" for role in ROLES]
    assert all(v.step == 3 for v in update.verdicts.values())
