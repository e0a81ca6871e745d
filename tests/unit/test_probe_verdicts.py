"""Probe verdicts: Gaussian vs planted outlier channels, distribution shift, hysteresis,
non-finite data, and the numerics of the stored statistics against the kernels' reference.

Shape legend: M rows (batch), K input features (contraction of the forward GEMM), N output
features.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch

from loka_train.kernels.formats import (
    Fp8Format,
    Scaling,
    dequantize,
    quantize,
    sqnr_db,
    underflow_fraction,
)
from loka_train.probe import Probe, ProbeConfig

M, K, N = 64, 64, 32
OUTLIER_COLS = (3, 17)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny GEMMs on a shared 2-core machine: 2 OpenMP threads make them 1000x slower.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _weight_NK(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / 8


def _gaussian_MK(gen: torch.Generator, m: int = M) -> torch.Tensor:
    return torch.randn(m, K, generator=gen)


def _with_outliers(x_MK: torch.Tensor, factor: float = 1e3) -> torch.Tensor:
    y_MK = x_MK.clone()
    y_MK[:, list(OUTLIER_COLS)] *= factor
    return y_MK


def _cfg(**overrides) -> ProbeConfig:
    base = dict(
        every_k_steps=1,
        sites_per_step=None,
        interval=4,
        window=4,
        min_samples=4,
        formats=("e4m3",),
        scalings=("tensorwise", "rowwise"),
    )
    base.update(overrides)
    return ProbeConfig(**base)


def test_gaussian_rowwise_e4m3_safe_outlier_channels_tensorwise_unsafe() -> None:
    probe = Probe(_cfg())
    probe.register_site("gauss", weight_shape=(N, K))
    probe.register_site("outlier", weight_shape=(N, K))
    probe.register_site("strict", weight_shape=(N, K), sqnr_budget_db={"forward": 35.0})
    gen = torch.Generator().manual_seed(1)
    w_NK = _weight_NK()
    for step in range(8):
        probe.begin_step(step)
        x_MK = _gaussian_MK(gen)
        dy_MN = torch.randn(M, N, generator=gen)
        probe.observe_forward("gauss", x_MK, w_NK)
        probe.observe_backward("gauss", dy_MN, x_MK, w_NK)
        probe.observe_forward("outlier", _with_outliers(x_MK), w_NK)
        probe.observe_forward("strict", x_MK, w_NK)
        if probe.should_reduce(step):
            probe.reduce()
    assert probe.num_reduces == 2

    for role in ("forward", "grad_input", "grad_weight"):
        v = probe.verdict("gauss", role, "e4m3", "rowwise")
        assert v.safe, v.reason
        assert v.reason.startswith("safe: sqnr p10")
        # E4M3 x E4M3 on Gaussian data: about 28.5 dB.
        assert 26.0 < v.sqnr_lo_db < 31.0
        assert v.underflow < 1e-3 and v.num_samples == 4

    bad = probe.verdict("outlier", "forward", Fp8Format.E4M3, Scaling.TENSORWISE)
    assert not bad.safe
    # The whole-output SQNR does not see the outlier channels (they dominate the signal);
    # the flushed small values do, and the reason says so.
    assert bad.sqnr_lo_db > 20.0
    assert bad.underflow > 5 * probe.config.max_underflow_fraction
    assert "underflow" in bad.reason and "tensorwise" in bad.reason
    assert "outlier ratio" in bad.reason and "operand a" in bad.reason
    good = probe.verdict("gauss", "forward", "e4m3", "tensorwise")
    assert bad.outlier_ratio > 4 * good.outlier_ratio

    strict = probe.verdict("strict", "forward", "e4m3", "rowwise")
    assert not strict.safe
    assert "< budget 35.0 dB" in strict.reason


def test_window_stats_match_kernel_reference() -> None:
    """The stored energies and counts reproduce the kernels' sqnr_db and underflow_fraction."""
    cfg = _cfg(formats=("e4m3", "e5m2"), scalings=("tensorwise", "rowwise", "block"), block_size=32)
    probe = Probe(cfg)
    probe.register_site("s")
    gen = torch.Generator().manual_seed(2)
    x_MK = _with_outliers(_gaussian_MK(gen), factor=30.0)
    w_NK = _weight_NK()
    dy_MN = torch.randn(M, N, generator=gen)
    probe.observe_forward("s", x_MK, w_NK)
    probe.observe_backward("s", dy_MN, x_MK, w_NK)
    probe.reduce()
    cases = {
        "forward": (x_MK, w_NK, 1, 1, lambda a, b: a @ b.T, True),
        "grad_input": (dy_MN, w_NK, 1, 0, lambda a, b: a @ b, True),
        "grad_weight": (dy_MN, x_MK, 0, 0, lambda a, b: a.T @ b, False),
    }
    for role, (a, b, ax_a, ax_b, gemm, b_is_weight) in cases.items():
        stats = probe.window_stats("s", role)
        assert stats["valid"].sum() == 1
        slot = int(stats["valid"].nonzero()[0, 0])
        ref = gemm(a, b)
        for c, cand in enumerate(probe.candidates):
            fmt_b = cand.fmt if role == "forward" else Fp8Format.E4M3
            kw_a, kw_b = {}, {}
            if cand.scaling is Scaling.BLOCK:
                kw_a = {"block_size": 32}
                kw_b = {"block_size": 32, "block_2d": b_is_weight}
            qa = dequantize(quantize(a, cand.fmt, cand.scaling, axis=ax_a, **kw_a))
            qb = dequantize(quantize(b, fmt_b, cand.scaling, axis=ax_b, **kw_b))
            expected = float(sqnr_db(ref, gemm(qa, qb)))
            got = float(stats["sqnr_db"][slot, c])
            assert got == pytest.approx(expected, abs=1e-3), (role, cand)
            und = float(underflow_fraction(a, cand.fmt, cand.scaling, axis=ax_a, **kw_a))
            assert float(stats["underflow_a"][slot, c]) == pytest.approx(und, rel=1e-6, abs=1e-9)
        assert float(stats["amax_a"][slot]) == pytest.approx(float(a.abs().max()))
        rms = float(a.square().mean().sqrt())
        assert float(stats["outlier_ratio_a"][slot]) == pytest.approx(float(a.abs().max()) / rms, rel=1e-5)
        row_amax = a.abs().amax(dim=ax_a)
        assert float(stats["row_spread_a"][slot]) == pytest.approx(
            float(row_amax.max() / row_amax.min()), rel=1e-5
        )


def _feed(probe: Probe, site: str, steps: range, make_x, w_NK: torch.Tensor) -> None:
    for step in steps:
        probe.begin_step(step)
        probe.observe_forward(site, make_x(step), w_NK)
        if probe.should_reduce(step):
            probe.reduce()


def test_distribution_shift_forgets_within_window_and_flips() -> None:
    cfg = _cfg(interval=2, scalings=("tensorwise",))
    w_NK = _weight_NK()
    data = {s: _gaussian_MK(torch.Generator().manual_seed(100 + s)) for s in range(20)}

    def x_at(step: int) -> torch.Tensor:
        return _with_outliers(data[step]) if 8 <= step < 10 else data[step]

    probe = Probe(cfg)
    probe.register_site("s")
    key = ("s", "forward", Fp8Format.E4M3, Scaling.TENSORWISE)
    _feed(probe, "s", range(0, 8), x_at, w_NK)
    assert probe.verdicts()[key].safe
    # Two outlier samples enter: unsafe at the very next reduction (no waiting).
    _feed(probe, "s", range(8, 10), x_at, w_NK)
    assert not probe.verdicts()[key].safe
    assert "underflow" in probe.verdicts()[key].reason
    # W clean samples later the window holds nothing of the outlier phase ...
    _feed(probe, "s", range(10, 14), x_at, w_NK)
    fresh = Probe(cfg)
    fresh.register_site("s")
    _feed(fresh, "s", range(10, 14), x_at, w_NK)
    fresh.reduce()
    shifted, clean = probe.window_stats("s", "forward"), fresh.window_stats("s", "forward")
    order_s, order_c = torch.argsort(shifted["step"]), torch.argsort(clean["step"])
    assert shifted["step"][order_s].tolist() == [10, 11, 12, 13]
    for name in ("sqnr_db", "underflow_a", "amax_a", "outlier_ratio_a", "row_spread_a"):
        torch.testing.assert_close(shifted[name][order_s], clean[name][order_c], rtol=0, atol=0)
    # ... and the verdict turns safe again after the hysteresis (2 intervals with new data).
    assert not probe.verdicts()[key].safe
    _feed(probe, "s", range(14, 16), x_at, w_NK)
    assert probe.verdicts()[key].safe
    changes = [(h["step"], h["safe"]) for h in probe.history]
    assert changes == [(5, True), (9, False), (15, True)]


def _changes_on_stationary(cfg: ProbeConfig, steps: int) -> tuple[int, list[float]]:
    probe = Probe(cfg)
    probe.register_site("s")
    gen = torch.Generator().manual_seed(7)
    w_NK = _weight_NK()
    _feed(probe, "s", range(steps), lambda _: torch.randn(32, K, generator=gen), w_NK)
    return probe.num_verdict_changes, [v for _, v in probe.series["s/forward/e4m3_rowwise"]]


def test_stationary_data_does_not_flap() -> None:
    base = dict(scalings=("rowwise",), interval=4, window=4)
    steps = 80  # 20 intervals, each with a fresh window
    changes, lows = _changes_on_stationary(_cfg(**base), steps)
    assert changes == 1  # unsafe (no data) -> safe once, then never again
    # A budget right in the middle of the window quantiles: the raw bound crosses it often.
    budget = sorted(lows)[len(lows) // 2]
    border = {"forward": budget, "grad_input": 16.0, "grad_weight": 16.0}
    raw_changes, _ = _changes_on_stationary(
        _cfg(**base, sqnr_budget_db=border, margin_db=0.0, hysteresis_intervals=1), steps
    )
    assert raw_changes >= 4, "the control must straddle the budget, else this test proves nothing"
    held_changes, _ = _changes_on_stationary(_cfg(**base, sqnr_budget_db=border), steps)
    assert held_changes <= 1


def test_nonfinite_activation_is_unsafe_counted_logged_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _cfg(interval=2)
    probe = Probe(cfg)
    probe.register_site("s")
    w_NK = _weight_NK()
    data = {s: _gaussian_MK(torch.Generator().manual_seed(200 + s)) for s in range(20)}

    def x_at(step: int) -> torch.Tensor:
        x_MK = data[step]
        if step == 8:
            x_MK = x_MK.clone()
            x_MK[0, 0], x_MK[5, 9], x_MK[7, 1] = float("inf"), float("nan"), float("-inf")
        return x_MK

    _feed(probe, "s", range(8), x_at, w_NK)
    assert all(v.safe for k, v in probe.verdicts().items() if k[1] == "forward")
    with caplog.at_level(logging.WARNING, logger="loka_train.probe.window"):
        _feed(probe, "s", range(8, 10), x_at, w_NK)
    for k, v in probe.verdicts().items():
        if k[1] == "forward":
            assert not v.safe and "non-finite" in v.reason and v.num_nonfinite == 3
    assert probe.num_nonfinite_events == 1
    warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    stats = probe.window_stats("s", "forward")
    for name in ("sqnr_db", "amax_a", "underflow_a", "outlier_ratio_a"):
        assert torch.isfinite(stats[name]).all(), name
    # Training goes on: no new event while the sample stays in the window, and the site
    # recovers once the window has forgotten it.
    _feed(probe, "s", range(10, 12), x_at, w_NK)
    assert probe.num_nonfinite_events == 1
    assert not probe.verdict("s", "forward", "e4m3", "rowwise").safe
    _feed(probe, "s", range(12, 16), x_at, w_NK)
    assert probe.verdict("s", "forward", "e4m3", "rowwise").safe
    assert probe.report()["events"]["nonfinite"] == 1


def test_nonfinite_gradient_through_hooks_does_not_raise() -> None:
    probe = Probe(_cfg(interval=1, min_samples=1, hysteresis_intervals=1))
    lin = torch.nn.Linear(K, N)
    probe.attach(lin, "lin")
    probe.begin_step(0)
    x_MK = _gaussian_MK(torch.Generator().manual_seed(3))
    out = lin(x_MK)
    grad = torch.ones_like(out)
    grad[0, 0] = float("nan")
    out.backward(grad)
    probe.reduce()
    assert not probe.verdict("lin", "grad_input", "e4m3", "rowwise").safe
    assert not probe.verdict("lin", "grad_weight", "e4m3", "rowwise").safe
    assert probe.verdict("lin", "forward", "e4m3", "rowwise").safe
    assert probe.num_nonfinite_events == 2  # one per backward GEMM
    assert math.isnan(float(lin.weight.grad[0, 0]))  # the probe observed, it did not touch
