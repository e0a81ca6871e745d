"""Dispatch re-plans from Probe verdicts: drift moves a site to a safer plan and back,
without touching other sites; decisions are deterministic and survive a state round trip."""

from __future__ import annotations

import pytest
import torch

from loka_train.dispatch import DispatchConfig, Dispatcher, GemmTimer, GpuCostModel
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.kernels.roles import ROLES
from loka_train.probe import Probe, ProbeConfig
from tests.unit._backends import Aligned16

M, K, N = 256, 64, 32
INTERVAL = 4
SITES = ("a", "b")


def _probe() -> Probe:
    probe = Probe(
        ProbeConfig(
            every_k_steps=1, interval=INTERVAL, window=4, min_samples=2, hysteresis_intervals=1,
            formats=("e4m3", "e5m2"), scalings=("tensorwise", "rowwise"),
        )
    )
    for site in SITES:
        probe.register_site(site, weight_shape=(N, K))
    return probe


def _dispatcher() -> Dispatcher:
    d = Dispatcher(
        DispatchConfig(
            objective="coverage", scalings=("tensorwise", "rowwise"), backends=("emulated",),
            hysteresis_intervals=2, fp8_roles=("forward",),
        ),
        device="cpu",
    )
    for site in SITES:
        d.register(site, plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    return d


def _x(step: int, outliers: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(M, K, generator=gen)
    if outliers:
        x[:4] *= 1e5  # a few samples with huge activations: tensor-wise scaling flushes the rest
    return x


def _run(probe: Probe, d: Dispatcher, steps: range, outliers_in_a: bool, log: list) -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(99))
    for step in steps:
        probe.begin_step(step)
        for site in SITES:
            probe.observe_forward(site, _x(step * 7 + len(site), site == "a" and outliers_in_a), w)
        if probe.should_reduce(step):
            changes = d.replan(step=step, verdicts=probe.reduce())
            log.append((step, {s: str(d.plans[s].forward) for s in SITES}, changes))


def test_outliers_move_site_to_safer_plan_and_back() -> None:
    probe, d, log = _probe(), _dispatcher(), []
    _run(probe, d, range(0, 16), False, log)
    # Stationary Gaussian data: both sites settle on the fastest safe plan (tensor-wise).
    assert log[-1][1] == {"a": "fp8:e4m3/tensorwise@emulated", "b": "fp8:e4m3/tensorwise@emulated"}
    settled = len(log)
    _run(probe, d, range(16, 24), True, log)
    # The first interval whose window holds outlier samples moves site a off tensor-wise.
    first = log[settled]
    assert first[1]["a"] == "fp8:e4m3/rowwise@emulated", first
    assert any(c.site == "a" and "tensorwise" in c.old for c in first[2])
    assert all(entry[1]["b"] == "fp8:e4m3/tensorwise@emulated" for entry in log[settled:])
    reasons = [c.reason for c in first[2] if c.site == "a"]
    assert reasons and "unsafe" in reasons[0]
    back = len(log)
    _run(probe, d, range(24, 48), False, log)
    plans_a = [entry[1]["a"] for entry in log[back:]]
    assert plans_a[-1] == "fp8:e4m3/tensorwise@emulated"
    # Not at the first clean interval: window, Probe hysteresis and Dispatch hysteresis.
    assert plans_a[0] == "fp8:e4m3/rowwise@emulated"
    # Other site never changed after settling.
    assert all(entry[1]["b"] == "fp8:e4m3/tensorwise@emulated" for entry in log[settled:])


def test_stationary_data_does_not_flap() -> None:
    probe, d, log = _probe(), _dispatcher(), []
    _run(probe, d, range(0, 60), False, log)
    changes_after_settle = [c for step, _, cs in log if step > 20 for c in cs]
    assert changes_after_settle == []


def test_speed_objective_keeps_small_gemms_high() -> None:
    """On the H100 cost model a 256x64x32 GEMM plus quantization is slower than bf16."""
    probe = _probe()
    d = Dispatcher(DispatchConfig(objective="speed", scalings=("rowwise",), backends=("emulated",)), device="cpu")
    d.register("a", plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    d.register("b", plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    log: list = []
    _run(probe, d, range(0, 16), False, log)
    assert not d.plans["a"].forward.is_fp8
    assert "margin" in d.table()


def test_cpu_objective_applies_on_cpu_only() -> None:
    """aggressive: speed on the GPU, coverage on CPU (where FP8 only serves the numerics)."""
    cfg = DispatchConfig(
        objective="speed", cpu_objective="coverage", margin=0.0, scalings=("rowwise",),
        backends=("emulated",), hysteresis_intervals=1, fp8_roles=("forward",),
    )
    probe = _probe()
    d = Dispatcher(cfg, device="cpu")
    for site in SITES:
        d.register(site, plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    _run(probe, d, range(0, 16), False, [])
    assert d.objective == "coverage" and d.plans["a"].forward.is_fp8
    assert "taken for coverage although slower" in d.table()  # the H100 cost model: small GEMM
    assert Dispatcher(cfg, device="meta").objective == "speed"
    with pytest.raises(ValueError, match="cpu_objective"):
        DispatchConfig(cpu_objective="fastest")


def test_cost_model_reproduces_measured_pattern() -> None:
    """design.md: FP8 GEMM alone gains 1.1-1.9x; separate quantization erases it when small."""
    cm = GpuCostModel()
    gain_big = cm.high(8192, 4096, 4096) / cm.fp8(8192, 4096, 4096, "rowwise", "triton")
    gain_small = cm.high(8192, 512, 512) / cm.fp8(8192, 512, 512, "rowwise", "emulated")
    assert 1.3 < gain_big < 2.0
    assert gain_small < 1.0


def test_state_round_trip_makes_same_decisions() -> None:
    probe, d, log = _probe(), _dispatcher(), []
    _run(probe, d, range(0, 12), False, log)
    probe2, d2 = _probe(), _dispatcher()
    probe2.load_state_dict(probe.state_dict())
    d2.load_state_dict(d.state_dict())
    log_a: list = []
    log_b: list = []
    _run(probe, d, range(12, 32), True, log_a)
    _run(probe2, d2, range(12, 32), True, log_b)
    assert [e[1] for e in log_a] == [e[1] for e in log_b]
    assert d.export() == d2.export()


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="objective"):
        DispatchConfig(objective="fastest")
    with pytest.raises(ValueError, match="fp8_roles"):
        DispatchConfig(fp8_roles=("sideways",))


class _AllSafe(dict):
    """Verdicts that call every candidate safe (these tests are about the speed side)."""

    class _V:
        safe, reason, sqnr_lo_db, budget_db = True, "safe", 40.0, 20.0

        def __init__(self, fmt_b: Fp8Format) -> None:
            self.fmt_b = fmt_b

    def get(self, key, default=None):  # type: ignore[no-untyped-def, override]
        # Operand b as the default Probe measures it: the candidate's format in the forward
        # GEMM, e4m3 (its backward_fmt_b, Dispatch's fmt_forward) in the backward GEMMs.
        _, role, fmt, _ = key
        return self._V(fmt if role == "forward" else Fp8Format.E4M3)


def _one_site_dispatcher(backend: str, pad: int, shape: tuple[int, int, int]) -> Dispatcher:
    d = Dispatcher(
        DispatchConfig(
            objective="coverage", scalings=("rowwise",), cpu_backends=(backend,), fp8_roles=("forward",),
            hysteresis_intervals=1,
        ),
        device="cpu",
    )
    d.register("s", plan=LinearPlan.high_precision(), shapes={"forward": shape}, pad_to_multiple=pad)
    return d


def test_padding_site_takes_a_backend_that_refuses_its_unpadded_shape() -> None:
    from loka_train.kernels.registry import register_backend

    register_backend(Aligned16(), replace=True)
    unpadded = (256, 13, 32)  # K = 13, the DLRM bottom MLP's input width
    plain = _one_site_dispatcher("aligned16", 1, unpadded)
    plain.replan(step=0, verdicts=_AllSafe())
    assert not plain.plans["s"].forward.is_fp8
    assert "multiples of 16" in plain.unsupported["aligned16/rowwise"]
    padding = _one_site_dispatcher("aligned16", 16, unpadded)
    padding.replan(step=0, verdicts=_AllSafe())
    assert padding.plans["s"].forward.is_fp8 and padding.plans["s"].forward.backend == "aligned16"


def test_a_candidate_whose_benchmark_raises_is_excluded_and_logged(caplog, monkeypatch) -> None:
    d = _one_site_dispatcher("emulated", 1, (M, K, N))
    monkeypatch.setattr(GemmTimer, "mode", "measure")  # the CUDA micro-benchmark...

    def measure_once(shape, plan, role="forward", reuse=(False, False)):  # type: ignore[no-untyped-def]
        if plan is not None:
            raise RuntimeError("cutlass cannot implement")
        return 1e-3

    monkeypatch.setattr(d.timer, "measure_once", measure_once)  # ...replaced by a failing one
    with caplog.at_level("WARNING"):
        d.replan(step=0, verdicts=_AllSafe())
    assert not d.plans["s"].forward.is_fp8  # the run goes on in high precision
    assert any("cutlass cannot implement" in v for v in d.measure_failures.values())
    assert "benchmark failed" in d.table()
    assert "timing" in caplog.text and "excluded" in caplog.text
    restored = _one_site_dispatcher("emulated", 1, (M, K, N))
    restored.load_state_dict(d.state_dict())  # the failure survives a checkpoint (for the report)
    assert restored.measure_failures == d.measure_failures


@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_timing_quantizes_the_operands_each_role_really_has(monkeypatch, role) -> None:
    """The micro-benchmark times what the backward runs: grad-weight quantizes transposed
    views of the activations (copies, rows as long as the batch) and writes fp32; timing it
    on contiguous forward-like operands made FP8 grad-weight look cheap on the GPU."""
    import loka_train.kernels.linear as linear

    seen = []
    real = linear.fp8_gemm_planned

    def recording(a, b, plan, **kw):  # type: ignore[no-untyped-def]
        seen.append((tuple(a.shape), a.is_contiguous(), tuple(b.shape), b.is_contiguous(), kw))
        return real(a, b, plan, **kw)

    monkeypatch.setattr(linear, "fp8_gemm_planned", recording)
    d = _one_site_dispatcher("emulated", 1, (M, K, N))
    plan = GemmPlan(precision=Precision.FP8, fmt=Fp8Format.E5M2, fmt_b=Fp8Format.E4M3,
                    scaling=Scaling.ROWWISE, backend="emulated")
    assert d.timer.measure_once((64, 96, 32), plan, role) > 0
    a_shape, a_contig, b_shape, b_contig, kw = seen[-1]
    assert (a_shape, b_shape) == ((64, 96), (32, 96))
    assert kw["role"] == role
    expected = {
        "forward": (True, True, True, torch.bfloat16),
        "grad_input": (True, False, True, torch.bfloat16),
        "grad_weight": (False, False, False, torch.float32),
    }[role]
    assert (a_contig, b_contig, kw["b_is_weight"], kw["out_dtype"]) == expected


class _NoFp32Out(Aligned16):
    """A CPU backend that, like block-scaled ``_scaled_mm``, writes bf16 only."""

    name = "no_fp32_out"

    def supports(self, problem):  # type: ignore[no-untyped-def]
        ok = problem.out_dtype is not torch.float32
        return ok, "" if ok else "outputs bf16 only"


def test_grad_weight_candidates_are_checked_with_its_fp32_output() -> None:
    """The backward computes FP8 weight gradients in fp32: a backend that cannot write fp32
    must not be offered for grad-weight (it would raise in the backward), only elsewhere."""
    from loka_train.kernels.registry import register_backend

    register_backend(_NoFp32Out(), replace=True)
    d = Dispatcher(
        DispatchConfig(objective="coverage", scalings=("rowwise",), cpu_backends=("no_fp32_out",),
                       hysteresis_intervals=1),
        device="cpu", out_dtype=torch.bfloat16,
    )
    shape = (64, 32, 48)
    d.register("s", plan=LinearPlan.high_precision(),
               shapes={"forward": shape, "grad_input": shape, "grad_weight": shape})
    d.replan(step=0, verdicts=_AllSafe())
    plan = d.plans["s"]
    assert plan.forward.is_fp8 and plan.grad_input.is_fp8
    assert not plan.grad_weight.is_fp8
    assert "bf16 only" in d.unsupported["no_fp32_out/rowwise"]


# ------------------------------------------------------------- restoring under another config

_TENSORWISE = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="emulated")


def _saved_fp8_state() -> dict:
    """The state of a run that planned every GEMM of site "s" in tensor-wise FP8."""
    d = Dispatcher(DispatchConfig(scalings=("tensorwise",)), device="cpu")
    d.register("s", plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    d.plans["s"] = _TENSORWISE
    d.num_changes = 3
    return d.state_dict()


@pytest.mark.parametrize(
    ("config", "reset_roles", "why"),
    [
        (DispatchConfig(enabled=False), ROLES, "enabled=false"),
        (DispatchConfig(scalings=("tensorwise",), fp8_roles=("forward",)), ("grad_input", "grad_weight"), "fp8_roles"),
        (DispatchConfig(scalings=("rowwise",)), ROLES, "dispatch.scalings"),
        (DispatchConfig(scalings=("tensorwise",), cpu_backends=("triton",)), ROLES, "cpu_backends"),
        (DispatchConfig(scalings=("tensorwise",), fmt_backward="e4m3"), ("grad_input", "grad_weight"), "fmt_backward"),
        (DispatchConfig(scalings=("tensorwise",)), (), ""),
    ],
    ids=["disabled", "fp8_roles", "scalings", "backends", "formats", "same_config"],
)
def test_restored_plans_the_config_does_not_allow_are_reset(
    config: DispatchConfig, reset_roles: tuple[str, ...], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = Dispatcher(config, device="cpu")
    d.register("s", plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
    with caplog.at_level("WARNING", logger="loka_train.dispatch"):
        resets = d.load_state_dict(_saved_fp8_state(), step=41)
    assert [(c.step, c.site, c.role) for c in resets] == [(41, "s", r) for r in reset_roles]
    for role in ROLES:
        plan = getattr(d.plans["s"], role)
        assert plan == (GemmPlan() if role in reset_roles else getattr(_TENSORWISE, role)), role
    assert all(why in c.reason and c.new == "high" for c in resets)
    # Logged once each, counted, in the history and in the plan table's "why".
    assert len([r for r in caplog.records if "checkpoint" in r.getMessage()]) == len(reset_roles)
    assert d.history == resets and d.num_changes == 3 + len(reset_roles)
    if reset_roles:
        assert why in d.table()
    # Dispatch off: nothing moves the sites back to FP8 afterwards.
    d.replan(step=43, verdicts=_AllSafe())
    if not config.enabled:
        assert d.fp8_coverage() == 0.0


def test_disabled_dispatch_restores_the_initial_plan_and_keeps_high_precision() -> None:
    """Off keeps every site on its initial plan; a GEMM the run had moved to high precision
    (e.g. by the quality guard) stays there, since high precision is always allowed."""
    initial = LinearPlan.fp8(backend="emulated")  # row-wise
    saved = Dispatcher(DispatchConfig(scalings=("tensorwise", "rowwise")), device="cpu")
    saved.register("s", plan=initial)
    saved.plans["s"] = LinearPlan(
        forward=_TENSORWISE.forward, grad_input=GemmPlan(), grad_weight=initial.grad_weight
    )
    d = Dispatcher(DispatchConfig(enabled=False), device="cpu")
    d.register("s", plan=initial)
    resets = d.load_state_dict(saved.state_dict())
    assert [(c.role, c.new) for c in resets] == [("forward", str(initial.forward))]
    assert d.plans["s"] == LinearPlan(
        forward=initial.forward, grad_input=GemmPlan(), grad_weight=initial.grad_weight
    )


def test_restored_plan_the_site_cannot_run_is_reset() -> None:
    def emulated_only(plan: LinearPlan) -> tuple[bool, str]:
        for role in ROLES:
            gp = getattr(plan, role)
            if gp.is_fp8 and gp.backend != "emulated":
                return False, f"{role}: no batched FP8 GEMM on {gp.backend}"
        return True, ""

    cfg = DispatchConfig(scalings=("tensorwise",), backends=("triton", "emulated"))
    triton = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
    saved = Dispatcher(cfg, device="cuda")
    saved.register("s", plan=LinearPlan.high_precision())
    saved.plans["s"] = LinearPlan(forward=triton.forward, grad_input=_TENSORWISE.grad_input)
    d = Dispatcher(cfg, device="cuda")  # nothing here touches the device
    d.register("s", plan=LinearPlan.high_precision(), supports=emulated_only)
    resets = d.load_state_dict(saved.state_dict())
    assert [c.role for c in resets] == ["forward"] and "site cannot run it" in resets[0].reason
    assert d.plans["s"] == LinearPlan(grad_input=_TENSORWISE.grad_input)


@pytest.mark.parametrize("backward_fmt_b", ["e4m3", None], ids=["fmt_b_e4m3", "fmt_b_own"])
def test_a_verdict_measured_with_another_operand_b_format_is_not_used(backward_fmt_b) -> None:
    """grad_input plans run dY (e5m2) x W (dispatch.fmt_forward). A verdict whose SQNR was
    measured with W in another format says nothing about that GEMM: Dispatch must not take it."""
    probe = Probe(ProbeConfig(every_k_steps=1, interval=2, window=4, min_samples=1, hysteresis_intervals=1,
                              formats=("e4m3", "e5m2"), scalings=("rowwise",), backward_fmt_b=backward_fmt_b))
    probe.register_site("a", weight_shape=(N, K))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen)
    for step in range(2):
        probe.begin_step(step)
        probe.observe("a", "grad_input", torch.randn(M, N, generator=gen), w)
    verdicts = probe.reduce()
    d = Dispatcher(
        DispatchConfig(objective="coverage", scalings=("rowwise",), backends=("emulated",),
                       hysteresis_intervals=1, fp8_roles=("grad_input",), fmt_forward="e5m2",
                       fmt_backward="e5m2"),
        device="cpu",
    )
    d.register("a", plan=LinearPlan.high_precision(), shapes={"grad_input": (M, N, K)})
    d.replan(step=1, verdicts=verdicts)
    if backward_fmt_b == "e4m3":  # measured e5m2 x e4m3; the plan would run e5m2 x e5m2
        assert not d.plans["a"].grad_input.is_fp8
        assert "operand b in e5m2 (the Probe measured e4m3" in d.table()
    else:  # measured e5m2 x e5m2: exactly the plan's GEMM
        assert d.plans["a"].grad_input.is_fp8


def test_misspelled_backend_names_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"dispatch.backends names unknown GEMM backends \['trition'\]"):
        Dispatcher(DispatchConfig(backends=("trition",)), device="cpu")
    with pytest.raises(ValueError, match=r"dispatch.cpu_backends .*\['emulatd'\]"):
        Dispatcher(DispatchConfig(cpu_backends=("emulatd",)), device="cpu")


def test_timings_of_another_source_are_not_reused() -> None:
    """A checkpoint's GEMM times are kept only where they were taken the same way (timing
    mode, device, output dtype): another GPU's or the cost model's would pass for this one's."""
    def fresh(out_dtype: torch.dtype) -> Dispatcher:
        d = Dispatcher(DispatchConfig(objective="coverage", backends=("emulated",)), device="cpu",
                       out_dtype=out_dtype)
        d.register("a", plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)})
        return d

    first = fresh(torch.float32)
    first._estimate("forward", (M, K, N), None)
    state = first.state_dict()
    assert state["timings"]
    same = fresh(torch.float32)
    same.load_state_dict(state)
    assert same.state_dict()["timings"] == state["timings"]
    other = fresh(torch.bfloat16)
    other.load_state_dict(state)
    assert other.state_dict()["timings"] == {}


def test_a_folded_relu_is_charged_to_the_forward_candidates_whose_cast_does_not_apply_it() -> None:
    """A site that takes the ReLU before it (mods.fold_relu): its high-precision and row-wise
    forward candidates pay a ReLU pass over x, the tensor-wise Triton one does not; other roles
    and sites without a folded ReLU pay nothing."""
    d = Dispatcher(DispatchConfig(objective="speed", scalings=("tensorwise", "rowwise")), device="cpu")
    shape = (32768, 4096, 2048)
    d.register("folded", plan=LinearPlan.high_precision(), shapes={"forward": shape}, input_relu=True)
    d.register("plain", plan=LinearPlan.high_precision(), shapes={"forward": shape})
    tw = GemmPlan(precision=Precision.FP8, scaling=Scaling.TENSORWISE, backend="triton")
    rw = GemmPlan(precision=Precision.FP8, scaling=Scaling.ROWWISE, backend="triton")
    emulated = GemmPlan(precision=Precision.FP8, scaling=Scaling.TENSORWISE, backend="emulated")
    relu = d.timer.relu_pass_s(32768, 4096)
    elem = torch.finfo(d.timer.out_dtype).bits // 8  # the sites' compute dtype
    assert relu == pytest.approx(2 * elem * 32768 * 4096 / GpuCostModel().bandwidth + GpuCostModel().launch_s)
    assert d.timer.folds_relu(tw) and not d.timer.folds_relu(rw) and not d.timer.folds_relu(emulated)
    charged = {p: d._unfolded_relu_s("folded", "forward", shape, p) for p in (tw, rw, emulated, None)}
    assert charged == {tw: 0.0, rw: relu, emulated: relu, None: relu}
    assert d._unfolded_relu_s("folded", "grad_input", shape, None) == 0.0
    assert d._unfolded_relu_s("plain", "forward", shape, None) == 0.0
    # The ledger times the folded forward's ReLU pass the same way (ledger.LedgerGemm.input_relu).
    assert {(g.site, g.role): g.input_relu for g in d.ledger_gemms()} == {
        ("folded", "forward"): True, ("plain", "forward"): False}
    d.register("folded", plan=LinearPlan.high_precision(), shapes={"forward": shape})  # registered again: no ReLU
    assert d._unfolded_relu_s("folded", "forward", shape, None) == 0.0
    assert not any(g.input_relu for g in d.ledger_gemms())


def test_the_charge_for_an_unfolded_relu_decides_between_close_candidates(monkeypatch) -> None:
    """High precision 1.00, tensor-wise (Triton, folds the ReLU) 1.05, row-wise 1.02 (times
    set): without a folded ReLU the site stays high; with one, the charge (0.1) to the
    candidates that do not fold it makes tensor-wise the fastest."""
    cfg = DispatchConfig(objective="speed", scalings=("tensorwise", "rowwise"), cpu_backends=("triton",),
                         hysteresis_intervals=1, fp8_roles=("forward",), margin=0.0)
    chosen = {}
    for folded in (False, True):
        probe = _probe()
        d = Dispatcher(cfg, device="meta")  # not the CPU: the speed objective applies
        for site in SITES:
            d.register(site, plan=LinearPlan.high_precision(), shapes={"forward": (M, K, N)}, input_relu=folded)

        def estimate(role, shape, plan, reuse=(False, False)):  # type: ignore[no-untyped-def]
            if plan is None:
                return 1.0
            return 1.05 if plan.scaling is Scaling.TENSORWISE else 1.02

        monkeypatch.setattr(d.timer, "estimate", estimate)
        monkeypatch.setattr(d.timer, "relu_pass_s", lambda m, k: 0.1)
        monkeypatch.setattr(d.timer, "folds_relu", lambda plan: plan is not None and plan.scaling is Scaling.TENSORWISE)
        _run(probe, d, range(0, 8), False, [])
        chosen[folded] = d.plans["a"].forward
    assert not chosen[False].is_fp8
    assert chosen[True].is_fp8 and chosen[True].scaling is Scaling.TENSORWISE


def test_a_folded_relu_runs_again_in_the_backward_where_grad_weight_does_not_take_x_over() -> None:
    """A forward whose cast applies the ReLU saves the pass only where grad-weight takes its x
    over (the tensor-wise payload, transposed); otherwise the backward runs the ReLU on x again
    (kernels.linear), and Dispatch charges that pass: to the folding forward while grad-weight
    does not take x, to a grad-weight candidate (high precision too) that does not take it
    from a folding forward, and to a whole assignment in the joint choice."""
    from loka_train.dispatch.planning import takes_forward_x

    d = Dispatcher(DispatchConfig(objective="speed", scalings=("tensorwise", "rowwise")), device="cpu")
    tw = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
    rw = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton")
    # Where Triton runs (interpreted on a CPU), the tensor-wise cast applies the ReLU.
    d.timer.folds_relu = lambda p: p is not None and p.is_fp8 and p.scaling is Scaling.TENSORWISE  # type: ignore[method-assign]
    fwd_shape, gw_shape = (32768, 4096, 2048), (2048, 32768, 4096)
    d.register("folded", plan=LinearPlan.high_precision(), shapes={"forward": fwd_shape, "grad_weight": gw_shape},
               input_relu=True)
    relu = d.timer.relu_pass_s(32768, 4096)
    assert takes_forward_x(tw.grad_weight, tw.forward)
    assert not takes_forward_x(GemmPlan(), tw.forward) and not takes_forward_x(tw.grad_weight, rw.forward)
    assert not takes_forward_x(rw.grad_weight, tw.forward)
    # Grad-weight in high precision now: the folding forward pays the pass in the backward.
    charge = {p: d._unfolded_relu_s("folded", "forward", fwd_shape, p) for p in (tw.forward, rw.forward, None)}
    assert charge == {tw.forward: relu, rw.forward: relu, None: relu}
    assert d._unfolded_relu_s("folded", "grad_weight", gw_shape, None) == 0.0  # the forward does not fold
    # The forward folds now: grad-weight candidates that do not take its x pay the pass.
    d.plans["folded"] = LinearPlan(forward=tw.forward)
    charge = {p: d._unfolded_relu_s("folded", "grad_weight", gw_shape, p) for p in (tw.grad_weight, rw.grad_weight, None)}
    assert charge == {tw.grad_weight: 0.0, rw.grad_weight: relu, None: relu}
    # Grad-weight takes x over: the fold saves the pass.
    d.plans["folded"] = tw
    assert d._unfolded_relu_s("folded", "forward", fwd_shape, tw.forward) == 0.0
    assert d._relu_again_s("folded", {"forward": tw.forward, "grad_weight": tw.grad_weight}) == 0.0
    assert d._relu_again_s("folded", {"forward": tw.forward, "grad_weight": GemmPlan()}) == relu
    assert d._relu_again_s("folded", {"forward": rw.forward, "grad_weight": GemmPlan()}) == 0.0
    # No grad-weight GEMM seen: nothing runs again.
    d.register("frozen", plan=LinearPlan(forward=tw.forward), shapes={"forward": fwd_shape}, input_relu=True)
    assert d._unfolded_relu_s("frozen", "forward", fwd_shape, tw.forward) == 0.0
    # The ledger's forward rows carry the grad-weight plan that decides it.
    gemms = {(g.site, g.role): g for g in d.ledger_gemms()}
    assert gemms[("folded", "forward")].grad_weight_plan == tw.grad_weight
    assert gemms[("frozen", "forward")].grad_weight_plan is None


def test_dispatchs_planned_speedup_counts_the_relu_passes_it_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_train.dispatch.timing import timing_key

    d = Dispatcher(DispatchConfig(objective="speed", scalings=("tensorwise",)), device="cpu")
    rw = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton")
    tw = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
    shape = (32768, 4096, 2048)
    d.register("folded", plan=LinearPlan(forward=rw.forward), shapes={"forward": shape}, input_relu=True)
    relu = d.timer.relu_pass_s(32768, 4096)
    d.timer.timings[timing_key("forward", shape, None)] = 1e-3
    d.timer.timings[timing_key("forward", shape, rw.forward, (False, False))] = 0.8e-3
    # A row-wise cast does not apply the ReLU: both pay the pass.
    assert d.planned_speedup("folded", "forward") == pytest.approx((1e-3 + relu) / (0.8e-3 + relu))
    # Grad-weight's speed-up is its GEMMs' alone, where Dispatch charges a grad-weight candidate
    # (and high precision) the second pass of a folding forward whose x it does not take over:
    # the ledger counts that pass on the forward's row.
    monkeypatch.setattr(d.timer, "folds_relu", lambda plan: plan is not None and plan.scaling is Scaling.TENSORWISE)
    gw_shape = (2048, 32768, 4096)
    d.register("folded", plan=LinearPlan(forward=tw.forward, grad_weight=rw.grad_weight),
               shapes={"forward": shape, "grad_weight": gw_shape}, input_relu=True)
    assert d._unfolded_relu_s("folded", "grad_weight", gw_shape, rw.grad_weight) == pytest.approx(relu)
    d.timer.timings[timing_key("grad_weight", gw_shape, None)] = 1e-3
    d.timer.timings[timing_key("grad_weight", gw_shape, rw.grad_weight, (False, False))] = 0.8e-3
    assert d.planned_speedup("folded", "grad_weight") == pytest.approx(1.25)
