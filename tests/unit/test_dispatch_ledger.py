"""The per-GEMM ledger: its arithmetic (savings, quantization share, Amdahl predictions) and its
measurement on the CPU with the emulated backend (what is timed, what the site reuses)."""

from __future__ import annotations

import math

import pytest
import torch

from loka_train.dispatch.ledger import (
    Fp8Times,
    Ledger,
    LedgerGemm,
    LedgerRow,
    measure_ledger,
    site_table,
)
from loka_train.dispatch.planning import reused_operands
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan

CPU = torch.device("cpu")


def _row(plan: str, high: float, *fp8: Fp8Times) -> LedgerRow:
    return LedgerRow(site="s", role="forward", shape=(8, 8, 8), plan=plan, high_ms=high, fp8=fp8)


def test_row_savings_as_planned_best_and_ceiling():
    slow = Fp8Times(plan="a", gemm_ms=0.5, quant_a_ms=0.4, quant_b_ms=0.3)  # total 1.2
    fast = Fp8Times(plan="b", gemm_ms=0.6, quant_a_ms=0.1, quant_b_ms=0.0)  # total 0.7
    row = _row("a", 1.0, slow, fast)
    assert row.saved_as_planned_ms == pytest.approx(-0.2)  # the chosen plan loses
    assert row.best is fast
    assert row.saved_best_ms == pytest.approx(0.3)
    assert row.fastest_gemm is slow
    assert row.saved_ceiling_ms == pytest.approx(0.5)
    assert row.quant_over_saved == pytest.approx(0.7 / 0.5)
    high = _row("high", 1.0, slow, fast)
    assert high.saved_as_planned_ms == 0.0
    losing = _row("high", 0.4, slow)
    assert losing.saved_best_ms == 0.0 and losing.saved_ceiling_ms == 0.0
    assert math.isinf(losing.quant_over_saved)
    assert math.isnan(_row("high", 1.0).quant_over_saved)


def test_prediction_from_a_planned_step_and_from_a_high_step():
    fp8 = Fp8Times(plan="p", gemm_ms=1.0, quant_a_ms=0.5, quant_b_ms=0.5)
    ledger = Ledger(rows=[_row("p", 4.0, fp8), _row("high", 1.0)], device="cpu", timing="custom")
    t = ledger.totals()
    assert t["high_ms"] == 5.0 and t["saved_as_planned_ms"] == 2.0
    assert t["saved_best_ms"] == 2.0 and t["saved_ceiling_ms"] == 3.0
    # A step of 8 ms that ran the plan: all-high would take 10 ms.
    p = ledger.predict(8.0)
    assert p["high_step_ms"] == 10.0
    assert p["as_planned"] == pytest.approx(10 / 8)
    assert p["quant_free"] == pytest.approx(10 / 7)
    assert p["gemm_ceiling"] == pytest.approx(10 / 7.5)  # 5 ms of GEMMs at 2x
    # The same 10 ms measured on an all-high step.
    assert ledger.predict(10.0, planned_step=False)["as_planned"] == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="step_ms"):
        ledger.predict(0.0)
    md = ledger.markdown(step_ms=8.0)
    assert "as planned 1.25x" in md and "| s | forward | 8x8x8 | p | 4.000 |" in md


def test_a_plan_taken_on_a_timing_the_ledger_does_not_confirm_shows():
    """Dispatch chose the plan at 1.04x; the ledger measures it at 0.96x: both are in the row."""
    fp8 = Fp8Times(plan="p", gemm_ms=0.7, quant_a_ms=0.2, quant_b_ms=0.14)  # 1.04 ms
    row = LedgerRow(site="s", role="grad_weight", shape=(8, 8, 8), plan="p", high_ms=1.0, fp8=(fp8,),
                    planned_speedup=1.04)
    md = Ledger(rows=[row, _row("high", 1.0)], device="cpu", timing="custom").markdown()
    assert "| 1.040 | 0.96x | 1.04x |" in md
    assert "| high | 1.000 | - | - | - | - | - | - | - |" in md
    assert row.to_dict()["planned_speedup"] == 1.04
    # The chosen plan's timing failed: no other candidate's speed-up stands next to Dispatch's.
    failed = LedgerRow(site="s", role="forward", shape=(8, 8, 8), plan="p", high_ms=1.0,
                       fp8=(Fp8Times(plan="q", gemm_ms=0.5, quant_a_ms=0.1, quant_b_ms=0.1),),
                       failures=("p: RuntimeError: boom",), planned_speedup=1.3)
    md = Ledger(rows=[failed], device="cpu", timing="custom").markdown()
    assert "| p | 1.000 | - | - | - | - | - | 1.30x | - |" in md
    gemm = LedgerGemm("s", "forward", (8, 8, 8), GemmPlan(), (), planned_speedup=1.2)
    ledger = measure_ledger([gemm], device=CPU, timer=lambda run: 1.0)
    assert ledger.rows[0].planned_speedup == 1.2  # carried from Dispatch into the row


def _emulated(scaling: Scaling) -> LinearPlan:
    return LinearPlan.fp8(scaling=scaling, backend="emulated")


@pytest.mark.parametrize("scaling", [Scaling.ROWWISE, Scaling.TENSORWISE])
def test_measure_on_cpu_times_every_part_and_skips_reused_operands(scaling):
    plan = _emulated(scaling)
    gemms = [
        LedgerGemm(site="mlp.0", role=role, shape=(32, 16, 24), plan=getattr(plan, role),
                   candidates=(getattr(plan, role),), site_plan=plan)
        for role in ("forward", "grad_input", "grad_weight")
    ]
    ledger = measure_ledger(gemms, device=CPU, high_dtype=torch.float32)
    assert [r.role for r in ledger.rows] == ["forward", "grad_input", "grad_weight"]
    assert ledger.timing == "host_clock" and "emulated" in ledger.notes[0]
    for row in ledger.rows:
        assert row.high_ms > 0 and not row.failures
        (t,) = row.fp8
        assert t.plan == row.plan and t.gemm_ms > 0
        reuse_a, reuse_b = reused_operands(row.role, getattr(plan, row.role), plan)
        assert reuse_a or reuse_b or row.role != "grad_weight" or scaling is not Scaling.TENSORWISE
        assert (t.quant_a_ms == 0) == reuse_a and (t.quant_b_ms == 0) == reuse_b
    gw = ledger.rows[2].fp8[0]
    assert (gw.quant_ms == 0) == (scaling is Scaling.TENSORWISE)


def test_measure_keeps_the_ledger_when_a_backend_cannot_run():
    bad = GemmPlan(precision="fp8", scaling=Scaling.ROWWISE, backend="fbgemm_rowwise")
    good = _emulated(Scaling.ROWWISE).forward
    ledger = measure_ledger(
        [LedgerGemm("s", "forward", (16, 16, 16), GemmPlan(), (bad, good))],
        device=CPU, high_dtype=torch.float32,
    )
    (row,) = ledger.rows
    assert [t.plan for t in row.fp8] == [str(good)]
    assert len(row.failures) == 1 and "fbgemm_rowwise" in row.failures[0]


def test_measure_times_each_distinct_gemm_once():
    calls = []

    def timer(run):
        calls.append(run)
        run()
        return 1.0

    plan = _emulated(Scaling.ROWWISE).forward
    gemms = [LedgerGemm(f"tower.{i}", "forward", (16, 32, 32), plan, (plan,)) for i in range(3)]
    ledger = measure_ledger(gemms, device=CPU, timer=timer, high_dtype=torch.float32)
    assert len(calls) == 4  # high, FP8 GEMM, quant a, quant b: once for the three sites
    assert ledger.timing == "custom" and len(ledger.rows) == 3
    assert all(r.saved_as_planned_ms == pytest.approx(-2.0) for r in ledger.rows)


@pytest.mark.parametrize("static_scales", [False, True])
def test_a_reused_operand_is_charged_its_transposed_write(monkeypatch, static_scales):
    """grad-weight's dY^T and X^T: each charged the transposed write of the pass that casts it,
    timed in the static-scale form the site runs under ``static_scales``; grad-input's W^T in the
    weight's dynamic form either way."""
    from loka_train.dispatch import ledger as ledger_mod

    writes = []

    def write_s(t, fmt, plan, time, static=None):  # type: ignore[no-untyped-def]
        writes.append((tuple(t.shape), static is not None))
        return 0.25

    monkeypatch.setattr(ledger_mod, "transposed_write_s", write_s)
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
    gemms = [LedgerGemm(site="mlp.0", role=role, shape=(32, 16, 24), plan=getattr(plan, role),
                        candidates=(getattr(plan, role),), site_plan=plan) for role in ("grad_weight", "grad_input")]
    rows = measure_ledger(gemms, device=CPU, high_dtype=torch.float32, static_scales=static_scales).rows
    (t,) = rows[0].fp8
    assert t.quant_a_ms == 0.25 and t.quant_b_ms == 0.25
    # dY^T and X^T as static as the sites' casts; W^T (the weight) never.
    assert writes == [((32, 16), static_scales), ((24, 16), static_scales), ((24, 16), False)]


def test_zero_half_operands_are_half_zeros_in_the_activations_only(monkeypatch):
    from loka_train.dispatch import ledger as ledger_mod
    from loka_train.dispatch.timing import role_operands

    for role, (act_a, act_b) in {"forward": (True, False), "grad_input": (True, False),
                                 "grad_weight": (True, True)}.items():
        a, b, _, _ = role_operands(role, (512, 256, 128), device=CPU, dtype=torch.float32, zero_half=True)
        for t, is_act in ((a, act_a), (b, act_b)):
            zeros = float((t == 0).float().mean())
            assert (0.45 < zeros < 0.55) if is_act else zeros == 0.0
        dense, _, _, _ = role_operands(role, (512, 256, 128), device=CPU, dtype=torch.float32)
        assert float((dense == 0).float().mean()) == 0.0
    seen = []
    real = ledger_mod.role_operands
    monkeypatch.setattr(ledger_mod, "role_operands", lambda *a, **k: seen.append(k.get("zero_half")) or real(*a, **k))
    plan = LinearPlan.fp8(backend="emulated")
    gemm = LedgerGemm(site="s", role="forward", shape=(16, 16, 16), plan=plan.forward, candidates=(plan.forward,))
    measure_ledger([gemm], device=CPU, high_dtype=torch.float32, zero_half=True, timer=lambda run: 1.0)
    assert seen and all(seen)


def test_the_ledger_times_static_scales_when_the_sites_take_them(monkeypatch):
    """With static_scales, a tensor-wise forward's x is quantized with a slot (the emulated
    oracle's reference path here): the ledger says so, and its quantization is timed."""
    import loka_train.dispatch.ledger as ledger_mod

    seen = []
    original = ledger_mod.quantize_operand

    def spy(t, fmt, plan, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("static") is not None)
        return original(t, fmt, plan, **kwargs)

    monkeypatch.setattr(ledger_mod, "quantize_operand", spy)  # the ledger imported it by name
    plan = _emulated(Scaling.TENSORWISE).forward
    gemms = [LedgerGemm("s", "forward", (16, 32, 32), plan, (plan,))]
    on = measure_ledger(gemms, device=CPU, high_dtype=torch.float32, static_scales=True)
    assert any(seen) and any("static scales" in n for n in on.notes)
    seen.clear()
    off = measure_ledger(gemms, device=CPU, high_dtype=torch.float32)
    assert seen and not any(seen) and not any("static scales" in n for n in off.notes)


def test_a_cast_that_takes_over_a_relu_pass_pays_only_what_it_costs_beyond_the_pass():
    """High precision runs a 0.2 ms ReLU pass before its 1.0 ms GEMM; a folded cast (0.25 ms)
    pays 0.05 ms of quantization, a cast of relu(x) (0.15 ms) pays 0.15 ms and the pass."""
    folded = Fp8Times(plan="tw", gemm_ms=0.5, quant_a_ms=0.25, quant_b_ms=0.0)
    unfolded = Fp8Times(plan="rw", gemm_ms=0.6, quant_a_ms=0.15, quant_b_ms=0.0, relu_ms=0.2)
    row = LedgerRow(site="s", role="forward", shape=(8, 8, 8), plan="tw", high_ms=1.0, fp8=(folded, unfolded),
                    relu_ms=0.2)
    assert row.high_total_ms == pytest.approx(1.2)
    assert row.quant_paid_ms(folded) == pytest.approx(0.05)
    assert row.quant_paid_ms(unfolded) == pytest.approx(0.15)
    assert unfolded.total_ms == pytest.approx(0.95) and folded.total_ms == pytest.approx(0.75)
    assert row.saved_as_planned_ms == pytest.approx(1.2 - 0.75)
    assert row.best is folded and row.saved_best_ms == pytest.approx(0.45)
    assert row.fastest_gemm is folded and row.quant_over_saved == pytest.approx(0.05 / 0.5)
    # With quantization free the folded candidate saves its GEMM's lead and the pass: never
    # less than the best as paid.
    assert row.saved_ceiling_ms == pytest.approx(1.2 - 0.5) and row.saved_ceiling_ms >= row.saved_best_ms
    p = Ledger(rows=[row], device="cpu", timing="custom").predict(10.0)
    assert p["quant_free"] >= p["best_as_paid"]
    assert p["gemm_ceiling"] == pytest.approx(p["high_step_ms"] / (p["high_step_ms"] - 0.5 - 0.2))
    md = Ledger(rows=[row], device="cpu", timing="custom").markdown()
    assert "| 0.200, 0.000 |" in md and "1.60x" in md  # 1.2 / 0.75


def test_per_site_the_quantization_paid_over_what_the_fp8_gemms_save():
    fwd = LedgerRow(site="a", role="forward", shape=(8, 8, 8), plan="p", high_ms=1.0, relu_ms=0.2,
                    fp8=(Fp8Times(plan="p", gemm_ms=0.5, quant_a_ms=0.3, quant_b_ms=0.02),))
    gi = LedgerRow(site="a", role="grad_input", shape=(8, 8, 8), plan="p", high_ms=1.0,
                   fp8=(Fp8Times(plan="p", gemm_ms=0.6, quant_a_ms=0.1, quant_b_ms=0.0),))
    gw = LedgerRow(site="a", role="grad_weight", shape=(8, 8, 8), plan="high", high_ms=1.0,
                   fp8=(Fp8Times(plan="q", gemm_ms=0.1, quant_a_ms=0.0, quant_b_ms=0.0),))
    small = LedgerRow(site="b", role="forward", shape=(8, 8, 8), plan="p", high_ms=0.3,
                      fp8=(Fp8Times(plan="p", gemm_ms=0.2, quant_a_ms=0.2, quant_b_ms=0.0),))
    lost = LedgerRow(site="b", role="grad_input", shape=(8, 8, 8), plan="p", high_ms=0.3, fp8=(),
                     failures=("p: RuntimeError: boom",))
    ledger = Ledger(rows=[small, lost, gw, gi, fwd, _row("high", 5.0)], device="cpu", timing="custom")
    a, b = ledger.sites()  # largest saving first; the all-high site "s" has no line
    assert a["site"] == "a" and a["roles"] == ["grad_input", "forward"] and a["untimed"] == []
    assert a["gemm_saved_ms"] == pytest.approx(0.5 + 0.4)  # the high grad-weight saves nothing
    assert a["quant_paid_ms"] == pytest.approx((0.32 - 0.2) + 0.1)
    assert a["quant_over_saved"] == pytest.approx(0.22 / 0.9)
    assert b["site"] == "b" and b["untimed"] == ["grad_input"] and b["quant_over_saved"] == pytest.approx(2.0)
    # What the site pays, operand by operand in the roles' order, sums to what it pays; the
    # folded ReLU's pass that high precision runs and the plan does not is taken off.
    assert list(a["paid_by_operand"]) == ["x", "W", "dY", "W^T", "relu"]
    assert a["paid_by_operand"] == pytest.approx({"x": 0.3, "W": 0.02, "dY": 0.1, "W^T": 0.0, "relu": -0.2})
    assert sum(a["paid_by_operand"].values()) == pytest.approx(a["quant_paid_ms"])
    assert b["paid_by_operand"] == pytest.approx({"x": 0.2, "W": 0.0})
    assert ledger.to_dict()["sites"] == ledger.sites()
    md = ledger.markdown()
    assert "| a | grad_input, forward | 0.900 | 0.220 | 0.24 | x 0.300, W 0.020, dY 0.100, W^T 0.000, relu -0.200 |" in md
    assert "| b | forward (untimed: grad_input) | 0.100 | 0.200 | 2.00 | x 0.200, W 0.000 |" in md
    # A ledger's JSON from before the split renders with the column empty.
    old = [{k: v for k, v in site.items() if k != "paid_by_operand"} for site in ledger.sites()]
    assert "| a | grad_input, forward | 0.900 | 0.220 | 0.24 |  |" in "\n".join(site_table(old))


def test_grad_weights_operands_are_dy_t_and_x_t():
    gw = LedgerRow(site="a", role="grad_weight", shape=(8, 8, 8), plan="p", high_ms=1.0,
                   fp8=(Fp8Times(plan="p", gemm_ms=0.5, quant_a_ms=0.01, quant_b_ms=0.07),))
    (a,) = Ledger(rows=[gw], device="cpu", timing="custom").sites()
    assert a["paid_by_operand"] == pytest.approx({"dY^T": 0.01, "x^T": 0.07})


def test_a_folded_relu_is_timed_as_the_site_runs_it(monkeypatch):
    """A forward with input_relu: high precision gets the ReLU pass; a candidate whose cast does
    not apply it (the emulated backend) casts relu(x) and pays the pass; one whose cast applies
    it casts x with relu=True and pays none. Other roles and sites time no ReLU."""
    import loka_train.dispatch.ledger as ledger_mod
    from loka_train.dispatch.timing import GemmTimer

    seen = []
    original = ledger_mod.quantize_operand

    def spy(t, fmt, plan, **kwargs):  # type: ignore[no-untyped-def]
        if not kwargs.get("is_weight"):
            seen.append((kwargs.get("relu", False), bool((t < 0).any())))
        return original(t, fmt, plan, **kwargs)

    monkeypatch.setattr(ledger_mod, "quantize_operand", spy)
    timed = []

    def timer(run):  # type: ignore[no-untyped-def]
        timed.append(run)
        run()
        return 0.125 * len(timed)

    plan = _emulated(Scaling.TENSORWISE)
    gemms = [LedgerGemm("s", role, (32, 16, 24), getattr(plan, role), (getattr(plan, role),), input_relu=True)
             for role in ("forward", "grad_input")]
    gemms.append(LedgerGemm("t", "forward", (32, 16, 24), plan.forward, (plan.forward,)))
    fwd, gi, other = measure_ledger(gemms, device=CPU, high_dtype=torch.float32, timer=timer).rows
    assert fwd.relu_ms == 0.25 and gi.relu_ms == 0.0 and other.relu_ms == 0.0  # the second timing
    (t,) = fwd.fp8
    assert t.relu_ms == fwd.relu_ms and seen[0] == (False, False)  # relu(x) cast, the pass paid
    assert all(r.fp8[0].relu_ms == 0.0 for r in (gi, other))
    seen.clear()
    monkeypatch.setattr(GemmTimer, "folds_relu", lambda self, p: p is not None and p.is_fp8)
    fwd = measure_ledger(gemms[:1], device=CPU, high_dtype=torch.float32, timer=timer).rows[0]
    assert fwd.fp8[0].relu_ms == 0.0 and fwd.relu_ms > 0 and seen[0] == (True, True)  # x cast with relu=True
    # The same fold where grad-weight does not take x over (high precision, row-wise): the
    # backward runs the ReLU again and the candidate pays it; a tensor-wise one takes x over.
    rw = _emulated(Scaling.ROWWISE).grad_weight
    for gw_plan, again in ((GemmPlan(), True), (rw, True), (plan.grad_weight, False)):
        seen.clear()
        g = LedgerGemm("s", "forward", (32, 16, 24), plan.forward, (plan.forward,), input_relu=True,
                       grad_weight_plan=gw_plan)
        fwd = measure_ledger([g], device=CPU, high_dtype=torch.float32, timer=timer).rows[0]
        assert seen[0] == (True, True) and (fwd.fp8[0].relu_ms == fwd.relu_ms > 0) == again
        assert fwd.quant_paid_ms(fwd.fp8[0]) == pytest.approx(fwd.fp8[0].quant_ms - (0 if again else fwd.relu_ms))


def test_a_row_reads_back_from_its_json_and_from_one_written_before_the_relu_pass():
    row = LedgerRow(site="s", role="forward", shape=(8, 8, 8), plan="tw", high_ms=1.0, relu_ms=0.2,
                    fp8=(Fp8Times(plan="tw", gemm_ms=0.5, quant_a_ms=0.25, quant_b_ms=0.01, relu_ms=0.2),),
                    failures=("rw: RuntimeError: boom",), planned_speedup=1.3)
    assert LedgerRow.from_dict(row.to_dict()) == row
    old = row.to_dict()
    del old["relu_ms"], old["fp8"][0]["relu_ms"]
    back = LedgerRow.from_dict(old)
    assert back.relu_ms == 0.0 and back.fp8[0].relu_ms == 0.0 and back.shown == back.chosen
    assert back.quant_paid_ms(back.fp8[0]) == pytest.approx(0.26)
