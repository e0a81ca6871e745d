"""Dispatch weighs a site's GEMMs together where tensor-wise plans share quantized operands:
which operands a role reuses, the joint choice's edges (faster than per-GEMM, the margin, no
tensor-wise option), the timer leaving reused operands' quantization out, and a Dispatcher
that picks a tensor-wise site over row-wise GEMMs chosen one by one."""

from __future__ import annotations

import pytest
import torch

from loka_train.dispatch import DispatchConfig, Dispatcher
from loka_train.dispatch.planning import Target, joint_targets, reused_operands, site_total
from loka_train.dispatch.timing import GemmTimer, GpuCostModel, parse_timing_key, timing_key
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan
from tests.unit.test_dispatch import _AllSafe

TW = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="emulated")
RW = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="emulated")
ROLES3 = ("forward", "grad_input", "grad_weight")


def test_reused_operands_follow_the_site_plan() -> None:
    assert reused_operands("forward", TW.forward, TW) == (False, False)
    assert reused_operands("grad_input", TW.grad_input, TW) == (False, True)
    assert reused_operands("grad_weight", TW.grad_weight, TW) == (True, True)
    assert reused_operands("grad_weight", RW.grad_weight, RW) == (False, False)
    # The forward in high precision quantizes no x or W to hand over.
    mixed = LinearPlan(grad_input=TW.grad_input, grad_weight=TW.grad_weight)
    assert reused_operands("grad_weight", mixed.grad_weight, mixed) == (True, False)
    assert reused_operands("grad_input", mixed.grad_input, mixed) == (False, False)
    # Formats must agree: an e5m2 forward W is not grad-input's e4m3 W^T.
    e5_fwd = LinearPlan(forward=GemmPlan(precision="fp8", fmt=Fp8Format.E5M2, scaling=Scaling.TENSORWISE,
                                         backend="emulated"), grad_input=TW.grad_input)
    assert reused_operands("grad_input", e5_fwd.grad_input, e5_fwd) == (False, False)


def _times(gw_reused: float) -> dict:
    """ms of each (role, plan, reuse): high 1.0; row-wise 0.80 / 0.80 / 0.95; tensor-wise
    0.82 alone, grad-input 0.80 with W^T reused, grad-weight `gw_reused` with both reused and
    half-way with one."""
    t = {}
    for role in ROLES3:
        t[(role, None, (False, False))] = 1.0
        t[(role, str(getattr(RW, role)), (False, False))] = {"grad_weight": 0.95}.get(role, 0.80)
        t[(role, str(getattr(TW, role)), (False, False))] = {"grad_weight": 0.95}.get(role, 0.82)
    t[("grad_input", str(TW.grad_input), (False, True))] = 0.80
    t[("grad_weight", str(TW.grad_weight), (True, True))] = gw_reused
    t[("grad_weight", str(TW.grad_weight), (True, False))] = (0.95 + gw_reused) / 2
    t[("grad_weight", str(TW.grad_weight), (False, True))] = (0.95 + gw_reused) / 2
    return t


def _time_fn(table: dict):
    def time(role, plan, reuse):  # type: ignore[no-untyped-def]
        return table[(role, None if plan is None else str(plan), reuse)]

    return time


def _per_gemm(urgent: bool = False) -> dict[str, Target]:
    return {r: Target(getattr(RW, r), "per-GEMM", urgent) for r in ROLES3}


OPTIONS = {r: [getattr(RW, r), getattr(TW, r)] for r in ROLES3}


def test_a_tensor_wise_site_is_taken_when_reuse_makes_it_faster() -> None:
    time = _time_fn(_times(gw_reused=0.60))
    assert site_total({r: getattr(RW, r) for r in ROLES3}, time) == pytest.approx(2.55)
    assert site_total({r: getattr(TW, r) for r in ROLES3}, time) == pytest.approx(2.22)
    out = joint_targets(targets=_per_gemm(urgent=True), options=OPTIONS, time=time, margin=0.05)
    assert {r: out[r].plan for r in ROLES3} == {r: getattr(TW, r) for r in ROLES3}
    assert all("reused across them" in out[r].reason and "1.35x over high" in out[r].reason
               for r in ROLES3)
    assert all(out[r].urgent for r in ROLES3)  # urgency is the per-GEMM verdict's


def test_per_gemm_choice_stays_when_the_joint_one_is_not_faster() -> None:
    time = _time_fn(_times(gw_reused=0.95))  # reuse saves nothing in grad-weight: 2.57 > 2.55
    targets = _per_gemm()
    assert joint_targets(targets=targets, options=OPTIONS, time=time, margin=0.05) == targets


def test_the_site_must_clear_the_margin_over_high_precision() -> None:
    table = _times(gw_reused=0.60)
    for key in table:
        table[key] = max(table[key], 0.97) if key[1] is not None else table[key]
    table[("grad_weight", str(TW.grad_weight), (True, True))] = 0.96
    # Best joint site 0.97 + 0.97 + 0.96 = 2.90 ms against 3.0 in high precision: 1.03x < 1.05.
    targets = {r: Target(GemmPlan(), "high", False) for r in ROLES3}
    out = joint_targets(targets=targets, options=OPTIONS, time=_time_fn(table), margin=0.05)
    assert out == targets
    out = joint_targets(targets=targets, options=OPTIONS, time=_time_fn(table), margin=0.02)
    assert any(t.plan.is_fp8 for t in out.values())


def test_without_a_tensor_wise_option_nothing_is_weighed() -> None:
    calls = []

    def time(role, plan, reuse):  # type: ignore[no-untyped-def]
        calls.append(role)
        return 1.0

    targets = _per_gemm()
    options = {r: [getattr(RW, r)] for r in ROLES3}
    assert joint_targets(targets=targets, options=options, time=time, margin=0.05) == targets
    assert calls == []


def test_timing_keys_name_the_reused_operands() -> None:
    plan = TW.grad_weight
    assert timing_key("grad_weight", (8, 16, 32), plan) == f"grad_weight:8x16x32:{plan}"
    key = timing_key("grad_weight", (8, 16, 32), plan, (True, True))
    assert key.endswith("|reuse=ab")
    assert parse_timing_key(key) == ("grad_weight", (8, 16, 32), str(plan), (True, True))
    assert parse_timing_key(timing_key("forward", (8, 16, 32), None)) == ("forward", (8, 16, 32), "high", (False, False))


def test_the_timer_leaves_reused_operands_quantization_out(monkeypatch) -> None:
    import loka_train.kernels.linear as linear

    calls = []
    real = linear.quantize_operand

    def counting(t, fmt, plan, **kw):  # type: ignore[no-untyped-def]
        calls.append(tuple(t.shape))
        return real(t, fmt, plan, **kw)

    monkeypatch.setattr(linear, "quantize_operand", counting)
    timer = GemmTimer(timing="measure", device="cpu", out_dtype=torch.float32, bench_iters=1)
    timer.measure_once((16, 32, 24), TW.grad_weight, "grad_weight", (True, True))
    # Both quantized once, before the timed runs (3 warm-up + 1 timed: none quantizes).
    assert len(calls) == 2
    calls.clear()
    timer.measure_once((16, 32, 24), TW.grad_weight, "grad_weight")
    assert len(calls) == 2 * 4
    cm = GpuCostModel()
    full = cm.fp8(4096, 4096, 4096, "tensorwise", "torch_scaled_mm")
    assert cm.fp8(4096, 4096, 4096, "tensorwise", "torch_scaled_mm", quant_a=False, quant_b=False) < full


def test_dispatcher_plans_a_site_jointly_under_the_speed_objective(monkeypatch) -> None:
    """Per GEMM, row-wise wins every role; with the reuse a tensor-wise forward enables, the
    whole site is faster in tensor-wise, and the Dispatcher takes it, for a site whose GEMMs
    share operands and under the speed objective only."""
    table = _times(gw_reused=0.60)

    def estimate(self, role, shape, plan, reuse=(False, False)):  # type: ignore[no-untyped-def]
        return table[(role, None if plan is None else str(plan), reuse)]

    monkeypatch.setattr(GemmTimer, "estimate", estimate)
    shape = (64, 32, 48)
    shapes = {"forward": shape, "grad_input": shape, "grad_weight": shape}
    cases = (("speed", True, TW), ("speed", False, RW), ("coverage", True, RW))
    for objective, shares, expect in cases:
        d = Dispatcher(
            DispatchConfig(objective=objective, scalings=("rowwise", "tensorwise"), cpu_backends=("emulated",),
                           hysteresis_intervals=1, margin=0.05),
            device="cpu",
        )
        d.register("s", plan=LinearPlan.high_precision(), shapes=shapes, shares_operands=shares)
        d.replan(step=0, verdicts=_AllSafe())
        assert d.plans["s"] == expect, (objective, shares)


def test_a_reuse_that_costs_more_than_it_saves_is_undone() -> None:
    """Wukong's xt_proj on an H100: each GEMM alone is faster in tensor-wise FP8, but the
    grad-weight GEMM fed the forward's and grad-input's transposed payloads (K = 4M rows) is
    many times slower than high precision. The site keeps that GEMM high."""
    table = {}
    for role in ROLES3:
        table[(role, None, (False, False))] = 1.0
        table[(role, str(getattr(TW, role)), (False, False))] = 0.9
    table[("grad_input", str(TW.grad_input), (False, True))] = 0.9
    for reuse in ((True, True), (True, False), (False, True)):
        table[("grad_weight", str(TW.grad_weight), reuse)] = 8.0
    targets = {r: Target(getattr(TW, r), "per-GEMM", False) for r in ROLES3}
    options = {r: [getattr(TW, r)] for r in ROLES3}
    out = joint_targets(targets=targets, options=options, time=_time_fn(table), margin=0.05)
    assert {r: out[r].plan for r in ROLES3} == {"forward": TW.forward, "grad_input": TW.grad_input,
                                               "grad_weight": GemmPlan()}
    assert "1.07x over high" in out["grad_weight"].reason


def test_the_timer_hands_reused_operands_over_in_the_site_s_layout(monkeypatch) -> None:
    """A reused operand is the transposed view of a payload quantized in the other GEMM's
    layout, as kernels.linear.transposed_reuse makes it: a backend that must copy such a view
    pays for it in the timing too."""
    import loka_train.kernels.linear as linear

    seen = []
    real = linear.fp8_gemm_planned

    def recording(a, b, plan, **kw):  # type: ignore[no-untyped-def]
        seen.append((kw["a_q"], kw["b_q"]))
        return real(a, b, plan, **kw)

    monkeypatch.setattr(linear, "fp8_gemm_planned", recording)
    timer = GemmTimer(timing="measure", device="cpu", out_dtype=torch.float32, bench_iters=1)
    timer.measure_once((16, 32, 24), TW.grad_weight, "grad_weight", (True, True))
    a_q, b_q = seen[-1]
    assert a_q.data.shape == (16, 32) and b_q.data.shape == (24, 32)
    assert not a_q.data.is_contiguous() and a_q.data.t().is_contiguous()
    assert not b_q.data.is_contiguous() and b_q.data.t().is_contiguous()
    timer.measure_once((16, 32, 24), TW.grad_weight, "grad_weight")
    assert seen[-1] == (None, None)


def test_planned_speedup_reads_the_times_taken_with_the_sites_reuse() -> None:
    """The report's speed-up of a planned GEMM: the time Dispatch took for it as the site runs
    it (reused operands for a jointly planned site), over high precision; nothing is timed."""
    d = Dispatcher(DispatchConfig(objective="speed", scalings=("tensorwise",), cpu_backends=("emulated",)),
                   device="cpu")
    shape, other = (64, 32, 48), (128, 32, 48)
    d.register("joint", plan=TW, shapes=dict.fromkeys(ROLES3, shape), shares_operands=True)
    d.register("alone", plan=TW, shapes=dict.fromkeys(ROLES3, shape), shares_operands=False)
    d.register("high", plan=LinearPlan.high_precision(), shapes=dict.fromkeys(ROLES3, shape))
    d.register("untimed", plan=TW, shapes=dict.fromkeys(ROLES3, other))
    for role in ROLES3:
        d.timer.timings[timing_key(role, shape, None)] = 1.0
        d.timer.timings[timing_key(role, shape, getattr(TW, role))] = 0.8
    d.timer.timings[timing_key("grad_input", shape, TW.grad_input, (False, True))] = 0.64
    d.timer.timings[timing_key("grad_weight", shape, TW.grad_weight, (True, True))] = 0.5
    taken = dict(d.timer.timings)
    assert d.planned_speedup("joint", "forward") == pytest.approx(1.25)
    assert d.planned_speedup("joint", "grad_input") == pytest.approx(1 / 0.64)
    assert d.planned_speedup("joint", "grad_weight") == pytest.approx(2.0)
    assert d.planned_speedup("alone", "grad_weight") == pytest.approx(1.25)  # no reuse planned
    assert d.planned_speedup("high", "forward") is None
    assert d.planned_speedup("untimed", "forward") is None
    assert d.timer.timings == taken  # read only: the report never benchmarks
    # The ledger's rows carry it, next to their own measurement.
    planned = {(g.site, g.role): g.planned_speedup for g in d.ledger_gemms()}
    assert planned[("joint", "grad_weight")] == pytest.approx(2.0) and planned[("high", "forward")] is None


def test_a_reused_operand_written_in_the_quantizing_pass_costs_its_transposed_write(monkeypatch) -> None:
    """Where the other GEMM's quantizer writes both layouts (the Triton tensor-wise one), the
    reused operand is its contiguous transpose and costs that write: the two-layout pass less
    the one-layout pass; a reused view (the emulated oracle's) costs nothing here."""
    from loka_train.dispatch import timing

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm").grad_weight
    a = torch.randn(48, 16).t()  # dY^T as role_operands lays it out: a transposed view
    q = timing.reused_payload(a, plan.fmt, plan, is_weight=False)
    view = timing.reused_payload(a, plan.fmt, TW.grad_weight, is_weight=False)
    assert q.data.is_contiguous() and not view.data.is_contiguous()
    assert torch.equal(q.data.view(torch.uint8), view.data.contiguous().view(torch.uint8))

    def fake_time(run):  # type: ignore[no-untyped-def]
        out = run()
        return 5.0 if len(out) == 3 else 2.0  # the two-layout pass returns three tensors

    assert timing.transposed_write_s(a, plan.fmt, plan, fake_time) == 3.0
    assert timing.transposed_write_s(a, plan.fmt, TW.grad_weight, fake_time) == 0.0

    writes = []

    def write_s(t, fmt, plan, time, static=None):  # type: ignore[no-untyped-def]
        writes.append(tuple(t.shape))
        return 7.0

    monkeypatch.setattr(timing, "transposed_write_s", write_s)
    monkeypatch.setattr(GemmTimer, "time", lambda self, run: 1.0)
    timer = GemmTimer(timing="measure", device="cpu", out_dtype=torch.float32, bench_iters=1)
    assert timer.measure_once((16, 48, 24), plan, "grad_weight", (True, True)) == 15.0
    assert timer.measure_once((16, 48, 24), plan, "grad_weight", (True, False)) == 8.0
    assert writes == [(16, 48), (24, 48)]  # each operand's write timed once
    assert timer.measure_once((16, 48, 24), plan, "grad_weight") == 1.0


def test_a_reused_activation_under_static_scales_is_charged_its_static_two_layout_write(monkeypatch) -> None:
    """Under ``static_scales`` the sites cast ``x`` and ``dY`` with a static scale in one pass:
    a reused ``dY^T`` / ``X^T`` is charged the static two-layout pass less the static one-layout
    pass (no amax pass in either), not the dynamic forms' difference; a reused weight (grad-input's
    ``W^T``) keeps its dynamic cast's."""
    from loka_train.dispatch import timing
    from loka_train.kernels import triton_tensorwise as tw

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
    forms = {"static_both": 5.0, "static_one": 4.0, "dynamic_both": 9.0, "dynamic_one": 6.0}
    a = torch.randn(48, 16).t()
    with monkeypatch.context() as m:
        m.setattr(tw, "tensorwise_quant_static", lambda x, slot, *, fmt, both: "static_" + ("both" if both else "one"))
        m.setattr(tw, "tensorwise_quant_both", lambda x, *, fmt: "dynamic_both")
        m.setattr(tw, "tensorwise_quant", lambda x, *, fmt: "dynamic_one")
        fake_time = lambda run: forms[run()]  # noqa: E731
        slot = torch.zeros(2)
        assert timing.transposed_write_s(a, plan.grad_weight.fmt, plan.grad_weight, fake_time, slot) == 1.0
        assert timing.transposed_write_s(a, plan.grad_weight.fmt, plan.grad_weight, fake_time) == 3.0

    seen = []

    def write_s(t, fmt, plan, time, static=None):  # type: ignore[no-untyped-def]
        seen.append((tuple(t.shape), static is not None))
        return 0.0

    monkeypatch.setattr(timing, "transposed_write_s", write_s)
    monkeypatch.setattr(GemmTimer, "time", lambda self, run: 1.0)
    for static_scales in (True, False):
        seen.clear()
        timer = GemmTimer(timing="measure", device="cpu", out_dtype=torch.float32, bench_iters=1,
                          static_scales=static_scales)
        timer.measure_once((16, 48, 24), plan.grad_weight, "grad_weight", (True, True))
        # grad-input's W^T has X^T's shape: under static scales it is timed apart (its own
        # dynamic write), else it takes the cached write of the same form.
        timer.measure_once((16, 48, 24), plan.grad_input, "grad_input", (False, True))
        assert seen == [((16, 48), static_scales), ((24, 48), static_scales)] + [((24, 48), False)] * static_scales


def test_what_a_site_pays_beyond_its_gemms_enters_the_joint_choice() -> None:
    """``extra`` (a folded ReLU run again in the backward) is added to every assignment: with
    0.2 ms charged wherever grad-weight does not take the forward's x over, a site whose
    grad-weight takes it wins over row-wise GEMMs it would otherwise lose to."""
    time = _time_fn(_times(gw_reused=0.95))  # reuse alone does not pay: row-wise stays
    targets = _per_gemm()
    assert joint_targets(targets=targets, options=OPTIONS, time=time, margin=0.05) == targets

    def extra(plans):  # type: ignore[no-untyped-def]
        gw = plans.get("grad_weight", GemmPlan())
        return 0.0 if reused_operands("grad_weight", gw, LinearPlan(**plans))[1] else 0.2

    assert site_total({r: getattr(RW, r) for r in ROLES3}, time, extra) == pytest.approx(2.55 + 0.2)
    assert site_total({r: getattr(TW, r) for r in ROLES3}, time, extra) == pytest.approx(2.57)
    out = joint_targets(targets=targets, options=OPTIONS, time=time, margin=0.05, extra=extra)
    # Tensor-wise forward and grad-weight (x taken over: no charge); grad-input ties at 0.80.
    assert out["forward"].plan == TW.forward and out["grad_weight"].plan == TW.grad_weight
    assert site_total({r: out[r].plan for r in ROLES3}, time, extra) == pytest.approx(2.57)
