"""``loka_train.export``: serving a trained model (plans carried over, FP8 weights quantized
once, the training forward's numerics) and the numerics debugger, on the CPU (the emulated
oracle, and the Triton kernels under the interpreter)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import loka_train.export.serving as serving_module
from loka_train.export import (
    ServeConfig,
    SkipGuards,
    compare_sites,
    compile_served,
    format_numerics,
    serve,
    served_sites,
)
from loka_train.kernels.formats import Scaling, sqnr_db
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.mods import ModsConfig, convert, sites
from loka_train.mods.site import Fp8Linear
from loka_train.probe import Probe, ProbeConfig
from tests.towers import Towers
from tests.unit._backends import Aligned16


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 1))
    return convert(net, config=ModsConfig(enabled=True))


def _plans(backend: str, scaling: Scaling) -> dict[str, LinearPlan]:
    return {"0": LinearPlan.fp8(backend=backend, scaling=scaling), "2": LinearPlan.fp8(backend=backend, scaling=scaling)}


@pytest.mark.parametrize(
    ("backend", "scaling", "dtype"),
    [
        ("emulated", Scaling.ROWWISE, "fp32"),
        ("emulated", Scaling.TENSORWISE, "bf16"),
        ("triton", Scaling.TENSORWISE, "bf16"),  # the folded ReLU in the Triton cast
        ("triton", Scaling.ROWWISE, "bf16"),
    ],
)
def test_served_outputs_are_the_training_forward_with_the_weight_quantized_once(
    backend: str, scaling: Scaling, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained = _mlp()
    plans = _plans(backend, scaling)
    for name, site in sites(trained).items():
        site.set_plan(plans[name])
    served = serve(copy.deepcopy(trained), config=ServeConfig(dtype=dtype), plans=plans)
    x = torch.randn(40, 32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with torch.no_grad(), autocast:
        expected = trained(x)
    quantized: list[bool] = []
    real = serving_module.quantize_operand

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        quantized.append(kwargs["is_weight"])
        return real(*args, **kwargs)

    monkeypatch.setattr(serving_module, "quantize_operand", counting)
    with torch.no_grad(), autocast:
        outs = [served(x) for _ in range(3)]
    for out in outs:
        assert torch.equal(out, expected)
    # Three calls of two FP8 sites: six input casts, no weight cast.
    assert quantized == [False] * 6
    # Plans carried over (the forward's; nothing runs the backward roles), observers detached.
    for name, site in sites(served).items():
        assert site.plan == LinearPlan(forward=plans[name].forward) and site.observer is None
        assert "served" in site._modules
    assert served_sites(served) == {n: f"{plans[n].forward}, weight quantized once" for n in plans}
    assert not served.training
    # A served call records the shape it ran (what bench.inference's forward-only ledger times).
    with torch.no_grad(), autocast:
        served(torch.randn(24, 32))
    assert {n: s.gemm_shapes()["forward"] for n, s in sites(served).items()} == {"0": (24, 32, 64), "2": (24, 64, 48)}


def test_the_served_payload_is_in_the_state_dict_and_a_weight_changed_later_needs_serving_again() -> None:
    model = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="fp32"))
    keys = set(model.state_dict())
    assert {"0.served.w_data", "0.served.w_scale", "0.served.bias", "0.weight"} <= keys
    assert model.state_dict()["0.served.w_data"].dtype == torch.float8_e4m3fn
    x = torch.randn(8, 32)
    with torch.no_grad():
        before = model(x)
        model[0].weight.mul_(2)
        assert torch.equal(model(x), before)  # the payload quantized at serve time
        serve(model, config=ServeConfig(dtype="fp32"))
        assert not torch.equal(model(x), before)


def test_static_scales_are_the_trained_sites_and_autograd_takes_the_training_path() -> None:
    trained = _mlp()
    plans = _plans("emulated", Scaling.TENSORWISE)
    for name, site in sites(trained).items():
        site.set_plan(plans[name])
        assert isinstance(site, Fp8Linear)
        site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
    x = torch.randn(16, 32)
    with torch.no_grad():
        trained(x)  # seeds the slots
    served = serve(copy.deepcopy(trained), config=ServeConfig(dtype="fp32"))
    with torch.no_grad():
        assert torch.equal(served(x), trained(x))
    xg = x.clone().requires_grad_()
    served(xg).sum().backward()  # the training path: a gradient flows
    assert xg.grad is not None and xg.grad.abs().sum() > 0


def test_serving_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="no LoKA site"):
        serve(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"plans name sites the model does not have: \['9'\]"):
        serve(_mlp(), plans={"9": LinearPlan.fp8(backend="emulated")})
    with pytest.raises(ValueError, match="choose one of"):
        ServeConfig(dtype="fp16")
    model = serve(_mlp(), plans=_plans("emulated", Scaling.ROWWISE))  # bf16 by default
    with torch.no_grad(), pytest.raises(ValueError, match=r"served for torch.bfloat16 .* or under autocast to it"):
        model(torch.randn(4, 32))  # an fp32 call: other codes than the payload's


def test_without_quantizing_once_the_training_path_serves() -> None:
    plans = _plans("emulated", Scaling.ROWWISE)
    model = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32", quantize_weights_once=False))
    assert not any("served" in s._modules for s in sites(model).values())
    assert served_sites(model)["0"].endswith("weight quantized at every call (ServeConfig.quantize_weights_once is off)")


@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_a_layernorm_feeding_a_served_site_is_the_training_forward(backend: str) -> None:
    """``forward_layernorm``: where the LayerNorm kernel quantizes the FP8 input (row-wise on
    Triton), the served site takes its output with the weight quantized once."""
    torch.manual_seed(3)
    norm = nn.LayerNorm(32)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    site = Fp8Linear.from_linear(nn.Linear(32, 48), plan=LinearPlan.fp8(backend=backend))
    site.site_name = "s"
    holder = nn.ModuleDict({"s": site})
    x = torch.randn(24, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = site.forward_layernorm(x, norm, activation="relu")
        serve(holder)
        served = site.forward_layernorm(x, norm, activation="relu")
        site.forward_layernorm(torch.randn(16, 32), norm, activation="relu")
    assert torch.equal(served, expected)
    assert site.gemm_shapes()["forward"] == (16, 32, 48)  # the shape it last served


# ------------------------------------------------------------------------------ debugger
def test_the_debugger_measures_each_site_against_fp32_and_the_reference() -> None:
    plans = _plans("emulated", Scaling.TENSORWISE)
    high = _mlp()
    served = serve(copy.deepcopy(high), plans=plans, config=ServeConfig(dtype="fp32"))
    serve(high, plans={n: LinearPlan() for n in plans}, config=ServeConfig(dtype="fp32"))
    x = torch.randn(64, 32)
    with torch.no_grad():
        rows = compare_sites(served, lambda m: m(x), reference=high)
        alone = compare_sites(served, lambda m: m(x))
        ref_rows = compare_sites(high, lambda m: m(x), reference=high)
    assert [r.site for r in rows] == ["0", "2"]  # in the order they ran
    first, second = rows
    # Site 0 reads the model's input: its local error is all the drift there is.
    assert first.drift_sqnr_db == pytest.approx(first.local_sqnr_db, abs=1e-3)
    with torch.no_grad():
        h = served[0](x)
        manual = sqnr_db(torch.nn.functional.linear(torch.relu(h.float()), served[2].weight, served[2].bias),
                         served[2](h))
    assert second.local_sqnr_db == pytest.approx(float(manual), abs=1e-3)
    # Site 2's output carries site 0's error as well.
    assert second.drift_sqnr_db is not None and second.drift_sqnr_db < second.local_sqnr_db
    assert 20 < first.local_sqnr_db < 60 and first.saturated == 0.0 and first.local_max_rel_err > 0
    assert all(r.drift_sqnr_db is None for r in alone)
    # The reference against itself: no error anywhere (high precision is exact against fp32 here).
    assert all(r.drift_sqnr_db == 200.0 for r in ref_rows)
    table = format_numerics(rows)
    assert table.splitlines()[0].startswith("site") and len(table.splitlines()) == 3


def test_the_debugger_counts_what_a_static_scale_misses_and_what_the_cast_flushes() -> None:
    plans = _plans("emulated", Scaling.TENSORWISE)
    model = _mlp()
    for name, site in sites(model).items():
        site.set_plan(plans[name])
        site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
    with torch.no_grad():
        model(torch.randn(16, 32))  # seeds the slots at this scale
        serve(model, config=ServeConfig(dtype="fp32"))
        x = torch.randn(16, 32)
        x[0, 0] = 1e4  # far beyond the seeded scale's room
        row = compare_sites(model, lambda m: m(x))[0]
        plain = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))  # dynamic scales
        x[0, 0] = 1e6  # the tensor-wise scale follows it: most other values fall below e4m3's range
        flushed = compare_sites(plain, lambda m: m(x))[0]
    assert row.site == "0" and row.saturated == pytest.approx(1 / (16 * 32))
    assert flushed.saturated == 0.0 and flushed.underflow > 0.5 and row.underflow < flushed.underflow
    # The outlier's row dominates the output: its SQNR stays high, the other rows' collapses.
    assert flushed.local_row_sqnr_low_db < 10 < flushed.local_sqnr_db


def test_the_debugger_needs_sites_that_run() -> None:
    with pytest.raises(ValueError, match="no LoKA site"):
        compare_sites(nn.Linear(2, 2), lambda m: m(torch.randn(1, 2)))
    with pytest.raises(ValueError, match="no site of the model ran"):
        compare_sites(_mlp(), lambda m: None)
    model = _mlp()
    compare_sites(model, lambda m: m(torch.randn(2, 32)))
    assert not any(k in s.__dict__ for s in sites(model).values() for k in ("forward", "linear"))  # unwrapped


def test_a_probe_attached_before_serving_is_detached() -> None:
    model = _mlp()
    probe = Probe(ProbeConfig(every_k_steps=1))
    for name, site in sites(model).items():
        probe.register_site(name, **site.probe_spec())
        site.attach_observer(probe)
    serve(model, plans=_plans("emulated", Scaling.ROWWISE), config=ServeConfig(dtype="fp32"))
    assert all(s.observer is None and not s.sampling for s in sites(model).values())
    assert GemmPlan() == sites(model)["0"].plan.grad_weight


# ------------------------------------------------------------------------------- monitor
def test_the_monitor_flags_a_site_whose_numerics_turn_unsafe_and_clears_it() -> None:
    from loka_train.export import Monitor, MonitorConfig

    model = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="fp32"))
    monitor = Monitor(model, MonitorConfig(every=2, window=4, min_samples=2, floor_db=20.0), floors={"2": 15.0})
    torch.manual_seed(1)
    calm = [torch.randn(64, 32) for _ in range(8)]
    with torch.no_grad():
        outs = [monitor(lambda m, x=x: m(x)) for x in calm]
        assert torch.equal(outs[0], model(calm[0]))  # the model's own output
        assert monitor.num_calls == 8 and monitor.num_samples == 4 and not monitor.flagged
        report = monitor.report()["sites"]
        assert report["0"]["floor_db"] == 20.0 and report["2"]["floor_db"] == 15.0
        assert report["0"]["samples"] == 4 and report["0"]["drift_db"] == pytest.approx(0.0)
        assert report["0"]["sqnr_low_db"] > 25
        # Traffic drifts: one sample per request carries a feature 10^6 times its training
        # scale. Site 0's tensor-wise cast scales to it, and the other samples' inputs fall
        # below e4m3's range: their outputs are lost, which the whole output's SQNR hides.
        for x in calm:
            x[0, 0] = 1e6
            monitor(lambda m, x=x: m(x))
        assert "0" in monitor.flagged and "< floor 20.0 dB" in monitor.flagged["0"] and monitor.num_flags >= 1
        drifted = monitor.report()["sites"]["0"]
        assert drifted["unsafe"] and drifted["drift_db"] < -10
        for x in calm:
            x[0, 0] = 0.5
            monitor(lambda m, x=x: m(x))
            monitor(lambda m, x=x: m(x))
    assert "0" not in monitor.flagged  # back above the floor (by the margin) over a full window


def test_the_monitor_needs_fp8_sites() -> None:
    from loka_train.export import Monitor, MonitorConfig

    with pytest.raises(ValueError, match="no site with an FP8 forward"):
        Monitor(serve(_mlp(), config=ServeConfig(dtype="fp32")))
    with pytest.raises(ValueError, match=r"floors name sites without an FP8 forward: \['9'\]"):
        Monitor(serve(_mlp(), plans=_plans("emulated", Scaling.ROWWISE)), floors={"9": 1.0})
    with pytest.raises(ValueError, match="min_samples"):
        MonitorConfig(window=4, min_samples=5)


@pytest.mark.parametrize("scaling", [Scaling.ROWWISE, Scaling.TENSORWISE])
def test_a_served_model_compiles_and_computes_what_it_computes_eagerly(scaling: Scaling) -> None:
    torch._dynamo.reset()
    model = serve(_mlp(), plans=_plans("triton", scaling), config=ServeConfig(dtype="bf16"))
    compiled = torch.compile(model)
    x = torch.randn(32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
        out = compiled(x)
    assert torch.equal(eager, out)  # the FP8 casts and GEMMs are opaque ops: the same kernels


def test_a_new_plan_drops_the_served_weight_and_casting_the_model_keeps_its_payload() -> None:
    model = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="fp32"))
    x = torch.randn(8, 32)
    model.to(torch.float64).to(torch.float32)  # a whole-model cast: the FP8 codes and scales stay
    assert model[0].served.w_data.dtype == torch.float8_e4m3fn and model[0].served.w_scale.dtype == torch.float32
    assert model[0].served.bias.dtype == torch.float32
    with torch.no_grad():
        served = model(x)
        model[0].set_plan(model[0].plan)  # the same forward plan: still served
        assert "served" in model[0]._modules and torch.equal(model(x), served)
        model[0].set_plan(LinearPlan())  # another one: the site runs it, as served_sites says
        assert "served" not in model[0]._modules and served_sites(model)["0"] == "high precision"
        assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))


def test_captures_do_not_nest() -> None:
    from loka_train.export import Monitor, MonitorConfig

    model = serve(_mlp(), plans=_plans("emulated", Scaling.ROWWISE), config=ServeConfig(dtype="fp32"))
    monitor = Monitor(model, MonitorConfig(every=1, window=2, min_samples=1))
    x = torch.randn(4, 32)
    with torch.no_grad(), pytest.raises(ValueError, match="cannot run inside one another"):
        monitor(lambda m: compare_sites(m, lambda mm: mm(x)))
    assert not any(k in s.__dict__ for s in sites(model).values() for k in ("forward", "linear"))  # restored


def test_the_monitor_clears_a_flag_only_above_the_floor_by_its_margin() -> None:
    from loka_train.export import Monitor, MonitorConfig

    model = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="fp32"))
    x = torch.randn(64, 32)
    with torch.no_grad():
        probe = Monitor(model, MonitorConfig(every=1, window=1, min_samples=1, floor_db=0.0))
        probe(lambda m: m(x))
        level = probe.report()["sites"]["0"]["sqnr_low_db"]  # this input's SQNR at site 0
        monitor = Monitor(model, MonitorConfig(every=1, window=1, min_samples=1, floor_db=level + 5, margin_db=10.0),
                          floors={"2": -100.0})
        monitor(lambda m: m(x))
        assert "0" in monitor.flagged
        monitor.floors["0"] = level - 5  # now above the floor, but not by the margin: still flagged
        monitor(lambda m: m(x))
        assert "0" in monitor.flagged
        monitor.floors["0"] = level - 11
        monitor(lambda m: m(x))
    assert "0" not in monitor.flagged and monitor.num_flags == 1


def test_a_padded_site_with_a_folded_relu_and_no_bias_serves_its_training_forward() -> None:
    """K and N padded to 16 as the training path pads them (the payload holds the padded
    weight), the ReLU the site applies to its input, a dropped bias, a 3-D input."""
    from loka_train.kernels.registry import register_backend

    register_backend(Aligned16(), replace=True)
    torch.manual_seed(5)
    net = convert(nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 20), nn.ReLU(), nn.Linear(20, 1)),
                  config=ModsConfig(enabled=True, pad_to_multiple=16, drop_unstable_bias=True))
    plan = LinearPlan.fp8(backend=Aligned16.name, scaling=Scaling.TENSORWISE)
    for site in sites(net).values():
        site.set_plan(plan)
    assert net[2].input_relu and net[2].bias_dropped
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        expected = net(x)
        serve(net, config=ServeConfig(dtype="fp32"))
        got = net(x)
    assert (net[0].served.pad_k, net[0].served.pad_n) == (8, 8) and net[2].served.w_data.shape == (32, 48)
    assert net[2].served.bias is None
    assert torch.equal(got, expected)


def test_a_served_weight_checks_its_padding_again_where_it_moves_or_is_copied() -> None:
    # Served where the backend asks for K and N padded to 16; then (another device, a backend
    # registered anew) it takes the GEMM as it is: calls run the training path, counted, rather
    # than the weight padded for the backend as it was.
    from loka_train.kernels.registry import register_backend

    class TakesAnyShape(Aligned16):
        def supports(self, problem: Any) -> tuple[bool, str]:
            return True, ""

    register_backend(Aligned16(), replace=True)
    try:
        net = convert(nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 1)),
                      config=ModsConfig(enabled=True, pad_to_multiple=16, keep_last_layer_high=True))
        net[0].set_plan(LinearPlan.fp8(backend=Aligned16.name, scaling=Scaling.TENSORWISE))
        serve(net, config=ServeConfig(dtype="fp32"))
        payload = net[0].served
        assert (payload.pad_k, payload.pad_n) == (8, 8) and payload.pads_ok and payload.backend_ok
        register_backend(TakesAnyShape(), replace=True)
        copied = copy.deepcopy(net)
        net.to("cpu")
        assert not payload.pads_ok and not copied[0].served.pads_ok
        x = torch.randn(16, 24)
        with torch.no_grad():
            got = net(x)
            expected = net[0].linear_as_trained(x, net[0].weight, net[0].active_bias())
        assert net[0].num_fallbacks == 1 and torch.equal(got, net[2](torch.relu(expected)))
    finally:
        register_backend(Aligned16(), replace=True)


def test_a_plan_whose_padding_reads_the_rows_refuses_a_symbolic_batch() -> None:
    from loka_train.mods.site import Fp8Linear

    site = Fp8Linear.from_linear(nn.Linear(24, 8), plan=LinearPlan.fp8(backend="emulated"), pad_to_multiple=16)
    x = torch.randn(32, 24)
    batch = torch.export.Dim("batch", min=2)
    with torch.no_grad():
        # An FP8 grad-weight pads M: only a static batch can be exported.
        with pytest.raises(ValueError, match="static batch"):
            torch.export.export(site, (x,), dynamic_shapes=({0: batch},))
        assert torch.equal(torch.export.export(site, (x,)).module()(x), site(x))
        # The forward alone pads K and N only: any batch.
        site.set_plan(LinearPlan(forward=LinearPlan.fp8(backend="emulated").forward))
        program = torch.export.export(site, (x,), dynamic_shapes=({0: batch},))
        y = torch.randn(48, 24)
        assert torch.equal(program.module()(y), site(y))


@pytest.mark.parametrize("fusion", [True, False])
def test_dcn_cross_layers_serve_their_weights_quantized_once(fusion: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrec.modules.crossnet import LowRankCrossNet

    from loka_train.mods.interaction import CrossNet

    torch.manual_seed(5)
    cn = LowRankCrossNet(in_features=32, num_layers=2, low_rank=16)
    for b in cn.bias:
        nn.init.normal_(b)
    trained = nn.ModuleDict({"crossnet": CrossNet.from_crossnet(cn, epilogue_fusion=fusion)})
    plans = {n: LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE) for n in sites(trained)}
    for name, site in sites(trained).items():
        site.set_plan(plans[name])
    served = serve(copy.deepcopy(trained), config=ServeConfig(dtype="bf16"), plans=plans)
    x = torch.randn(40, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = trained["crossnet"](x)
    quantized: list[bool] = []
    real = serving_module.quantize_operand
    monkeypatch.setattr(serving_module, "quantize_operand",
                        lambda *a, **k: (quantized.append(k["is_weight"]), real(*a, **k))[1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = served["crossnet"](x)
    assert torch.equal(got, expected)  # the bias of each call (the fused epilogue's too) included
    assert quantized == [False] * 4  # two layers of two sites: their inputs only
    assert served_sites(served) == {n: f"{plans[n].forward}, weight quantized once" for n in plans}
    # The copy serves its own weights: a served site called with another weight takes it as trained.
    other = served["crossnet"].layer_sites(0).V
    w = torch.randn(16, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(other.linear(x, w), other.linear_as_trained(x, w))


# ------------------------------------------------------------------------- inference plans
def _fake_timer(ms: dict[str, float]):  # type: ignore[no-untyped-def]
    """Milliseconds by what the ledger times: the bf16 GEMM, the FP8 GEMM, the input's cast,
    the weight's cast (told apart by the closures measure_ledger builds)."""
    def timer(fn) -> float:  # type: ignore[no-untyped-def]
        name = fn.__qualname__
        key = ("high" if name.startswith("_matmul") else "relu" if name.startswith("_relu")
               else "quant_a" if name.endswith("quant_a") else "quant_b" if name.endswith("quant_b") else "gemm")
        return ms.get(key, 0.0)
    return timer


@pytest.mark.parametrize(("ms", "margin", "kept"), [
    ({"high": 1.0, "gemm": 0.4, "quant_a": 0.2, "quant_b": 50.0}, 1.0, True),   # the weight's cast is not paid
    ({"high": 1.0, "gemm": 0.4, "quant_a": 0.2, "quant_b": 0.0}, 2.0, False),   # not twice as fast
    ({"high": 1.0, "gemm": 0.5, "quant_a": 0.6, "quant_b": 0.0}, 1.0, False),   # the input's cast eats it
])
def test_plans_are_re_decided_for_an_inference_batch(ms: dict[str, float], margin: float, kept: bool) -> None:
    from loka_train.export import decide_for_batch, format_decisions

    plans = _plans("emulated", Scaling.ROWWISE)
    served = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))
    decided, rows = decide_for_batch(served, lambda m: m(torch.randn(24, 32)), device=torch.device("cpu"),
                                     margin=margin, timer=_fake_timer(ms))
    assert [(r.site, r.shape) for r in rows] == [("0", (24, 32, 64)), ("2", (24, 64, 48))]  # the batch's shapes
    assert all(r.high_ms == 1.0 and r.fp8_ms == ms["gemm"] + ms["quant_a"] for r in rows)
    expected = {n: LinearPlan(forward=plans[n].forward) if kept else LinearPlan() for n in plans}
    assert decided == expected
    assert ("| 0 | 24x32x64 |" in format_decisions(rows)) and all((r.chosen != "high") == kept for r in rows)
    with pytest.raises(ValueError, match="margin"):
        decide_for_batch(served, lambda m: None, device=torch.device("cpu"), margin=0)


def test_re_deciding_charges_the_folded_relu_and_a_weight_cast_made_at_every_call() -> None:
    from loka_train.export import decide_for_batch

    ms = {"high": 1.0, "relu": 0.5, "gemm": 0.9, "quant_a": 0.2, "quant_b": 0.0}
    # Triton's tensor-wise cast applies the ReLU folded into site 2: bf16 pays that pass, FP8 not.
    plans = _plans("triton", Scaling.TENSORWISE)
    served = serve(_mlp(), plans=plans, config=ServeConfig(dtype="bf16"))
    assert [sites(served)[n].input_relu for n in ("0", "2")] == [False, True]

    def run(model: nn.Module) -> torch.Tensor:  # served in bf16: called under its autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(torch.randn(24, 32))

    decided, rows = decide_for_batch(served, run, device=torch.device("cpu"), timer=_fake_timer(ms))
    assert {r.site: (r.high_ms, r.fp8_ms) for r in rows} == {"0": (1.0, pytest.approx(1.1)), "2": (1.5, pytest.approx(1.1))}
    assert (decided["0"].forward.is_fp8, decided["2"].forward.is_fp8) == (False, True)
    # Without the weight quantized once, every call pays its cast.
    again = serve(_mlp(), plans=plans, config=ServeConfig(dtype="bf16", quantize_weights_once=False))
    decided, rows = decide_for_batch(again, run, device=torch.device("cpu"), timer=_fake_timer({**ms, "quant_b": 0.5}),
                                     quantize_weights_once=False)
    assert {r.site: r.fp8_ms for r in rows} == {"0": pytest.approx(1.6), "2": pytest.approx(1.6)}
    assert not decided["2"].forward.is_fp8


def _safe(verdicts: dict[tuple[str, str], bool]) -> Any:
    """SafeForwards with these forward verdicts ((site, scaling) -> safe), e4m3 operands."""
    from types import SimpleNamespace

    from loka_train.dispatch.config import DispatchConfig
    from loka_train.export import SafeForwards
    from loka_train.kernels.formats import Fp8Format

    return SafeForwards(
        verdicts={(site, "forward", Fp8Format.E4M3, Scaling(scaling)): SimpleNamespace(safe=ok, fmt_b=Fp8Format.E4M3)
                  for (site, scaling), ok in verdicts.items()},
        config=DispatchConfig(scalings=("rowwise", "tensorwise"), cpu_backends=("emulated",)),
    )


def _ledger_by_plan(gemm_ms: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """measure_ledger replaced: bf16 1 ms, each candidate's GEMM `gemm_ms` by scaling, its input's
    cast 0.1 ms, its weight's 5 ms. Returns the candidates each call was given, per GEMM."""
    from loka_train.dispatch.ledger import Fp8Times, Ledger, LedgerRow
    from loka_train.export import decide as decide_module

    timed: list[list[str]] = []

    def fake(gemms, *, device, timer=None, static_scales=False):  # type: ignore[no-untyped-def]
        rows = []
        for g in gemms:
            timed.append([str(p) for p in g.candidates])
            rows.append(LedgerRow(site=g.site, role=g.role, shape=g.shape, plan=str(g.plan) if g.plan.is_fp8 else "high",
                                  high_ms=1.0, fp8=tuple(Fp8Times(plan=str(p), gemm_ms=gemm_ms[p.scaling.value],
                                                                  quant_a_ms=0.1, quant_b_ms=5.0)
                                                         for p in g.candidates)))
        return Ledger(rows=rows, device="cpu", timing="fake")

    monkeypatch.setattr(decide_module, "measure_ledger", fake)
    return timed


def test_re_deciding_takes_the_fastest_forward_the_probe_judged_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_train.export import decide_for_batch

    # Site 0 trained in bf16, site 2 row-wise; tensor-wise GEMMs are the faster ones here.
    plans = {"0": LinearPlan(), "2": LinearPlan.fp8(backend="emulated", scaling=Scaling.ROWWISE)}
    timed = _ledger_by_plan({"tensorwise": 0.3, "rowwise": 0.5}, monkeypatch)
    safe = _safe({("0", "rowwise"): True, ("0", "tensorwise"): True, ("2", "tensorwise"): False})
    served = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))
    run = lambda m: m(torch.randn(24, 32))  # noqa: E731
    decided, rows = decide_for_batch(served, run, device=torch.device("cpu"), safe=safe, out_dtype=torch.float32)
    # Site 0 takes its fastest safe forward; site 2 keeps its trained one (tensor-wise judged unsafe there).
    assert [len(t) for t in timed] == [2, 1]
    assert decided["0"].forward == LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE).forward
    assert decided["2"] == LinearPlan(forward=plans["2"].forward)
    # Both weights are quantized once when served: their casts are not charged.
    assert {r.site: (r.trained, r.fp8_ms, r.chosen) for r in rows} == {
        "0": ("high", pytest.approx(0.4), str(decided["0"].forward)),
        "2": (str(plans["2"].forward), pytest.approx(0.6), str(plans["2"].forward))}
    # Without `safe`, only the trained FP8 forward is a candidate: site 0 stays in bf16.
    timed.clear()
    decided, rows = decide_for_batch(served, run, device=torch.device("cpu"))
    assert [r.site for r in rows] == ["2"] and not decided["0"].forward.is_fp8
    # No safe verdict for site 0: nothing to time there.
    timed.clear()
    decided, _ = decide_for_batch(served, run, device=torch.device("cpu"), safe=_safe({("0", "rowwise"): False}))
    assert len(timed) == 1 and not decided["0"].forward.is_fp8
    # The decided plans serve: site 0 now with its weight quantized once.
    served = serve(served, plans=decide_for_batch(served, run, device=torch.device("cpu"), safe=safe)[0],
                   config=ServeConfig(dtype="fp32"))
    assert served_sites(served)["0"].endswith("weight quantized once")


def test_re_deciding_charges_a_new_candidate_its_weight_cast_where_weights_are_cast_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loka_train.export import decide_for_batch

    _ledger_by_plan({"tensorwise": 0.3, "rowwise": 0.5}, monkeypatch)
    safe = _safe({("0", "tensorwise"): True, ("2", "tensorwise"): True})
    run = lambda m: m(torch.randn(24, 32))  # noqa: E731
    # Every site in bf16 and nothing served yet: how the weights will be served decides the cost.
    served = serve(_mlp(), plans={"0": LinearPlan(), "2": LinearPlan()}, config=ServeConfig(dtype="fp32"))
    decided, rows = decide_for_batch(served, run, device=torch.device("cpu"), safe=safe, quantize_weights_once=False)
    # 0.3 + 0.1 + 5.0 for the weight's cast at every call: slower than bf16 (1 ms).
    assert {r.site: r.fp8_ms for r in rows} == {"0": pytest.approx(5.4), "2": pytest.approx(5.4)}
    assert not decided["0"].forward.is_fp8 and not decided["2"].forward.is_fp8
    decided, rows = decide_for_batch(served, run, device=torch.device("cpu"), safe=safe)
    assert {r.site: r.fp8_ms for r in rows} == {"0": pytest.approx(0.4), "2": pytest.approx(0.4)}
    assert decided["0"].forward.is_fp8 and decided["2"].forward.is_fp8


def test_re_deciding_times_the_sites_on_the_host_clock_on_a_cpu() -> None:
    from loka_train.export import decide_for_batch

    plans = _plans("emulated", Scaling.TENSORWISE)
    served = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))
    decided, rows = decide_for_batch(served, lambda m: m(torch.randn(16, 32)), device=torch.device("cpu"))
    assert [r.site for r in rows] == ["0", "2"] and all(r.high_ms > 0 and r.fp8_ms > 0 for r in rows)
    assert all(decided[r.site].forward.is_fp8 == (r.chosen != "high") for r in rows)


def _served_crossnet() -> nn.Module:
    from torchrec.modules.crossnet import LowRankCrossNet

    from loka_train.mods.interaction import CrossNet

    torch.manual_seed(6)
    net = nn.ModuleDict({"crossnet": CrossNet.from_crossnet(LowRankCrossNet(in_features=32, num_layers=2, low_rank=16))})
    return serve(net, plans={n: LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE) for n in sites(net)},
                 config=ServeConfig(dtype="bf16"))


def test_a_cross_layers_weight_is_one_serve_can_quantize_once() -> None:
    from torchrec.modules.crossnet import LowRankCrossNet

    from loka_train.export.serving import weight_servable_sites
    from loka_train.mods.interaction import CrossNet

    net = nn.ModuleDict({"crossnet": CrossNet.from_crossnet(LowRankCrossNet(in_features=32, num_layers=2, low_rank=16))})
    names = set(sites(net))
    # The cross net names its layers' weights: each site's is servable once, as an Fp8Linear's.
    assert names and weight_servable_sites(net) == names
    served = serve(net, plans={n: LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE) for n in names},
                   config=ServeConfig(dtype="bf16", quantize_weights_once=False))
    assert all(how.endswith("(ServeConfig.quantize_weights_once is off)") for how in served_sites(served).values())


def test_served_sites_compile_without_graph_breaks() -> None:
    mlp = serve(_mlp(), plans=_plans("emulated", Scaling.ROWWISE), config=ServeConfig(dtype="bf16"))
    cross = _served_crossnet()["crossnet"]
    x = torch.randn(24, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for model in (mlp, cross):
            explained = torch._dynamo.explain(model)(x)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_served_sites_on_the_gpu_path_compile_without_graph_breaks() -> None:
    # The ops a GPU serves with: Triton's tensor-wise quantizer with static scales (interpreted
    # here) and torch._scaled_mm, the ReLU folded into the cast.
    mlp = _mlp()
    for site in sites(mlp).values():
        site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
    served = serve(mlp, plans=_plans("torch_scaled_mm", Scaling.TENSORWISE), config=ServeConfig(dtype="bf16"))
    x = torch.randn(32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        served(x)  # seeds the static scales
        explained = torch._dynamo.explain(served)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("tensorwise_quant_static" in o for o in ops) == 2 and sum("_scaled_mm" in o for o in ops) == 2
    assert not any("planned_linear" in o for o in ops), "a served site ran its training op"


def test_a_bf16_program_records_its_autocast_and_packages_outside_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from loka_train.export import aoti_package, export_dense, install_programs

    model = convert(Towers(32, 48), config=ModsConfig(enabled=True, keep_last_layer_high=True))
    served = serve(model, plans={n: LinearPlan.fp8(backend="emulated") for n in sites(model)},
                   config=ServeConfig(dtype="bf16"))
    batch = SimpleNamespace(dense_features=torch.randn(64, 32), sparse_features=torch.randn(64, 32))
    programs = export_dense(served, batch)  # under bf16 autocast, as served
    compiled = copy.deepcopy(served)
    for module in (compiled.dense_arch, compiled.over_arch):
        module.compile(backend="aot_eager", dynamic=False)
    x, s = torch.randn(40, 32), torch.randn(40, 32)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = compiled(x, s)
        # Called outside autocast, the programs run their towers in bf16 as served.
        fresh = install_programs(copy.deepcopy(served), programs)
        assert torch.equal(fresh(dense=x, sparse=s), expected)
        # A program module takes its tower's arguments by keyword too (nn.Sequential's "input").
        assert torch.equal(fresh.dense_arch(input=x), fresh.dense_arch(x))
        with pytest.raises(TypeError, match="takes"):
            fresh.dense_arch(x=x)
        package = torch._inductor.aoti_load_package(str(aoti_package(programs["dense_arch"], tmp_path / "d.pt2")))
        got = package(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, programs["dense_arch"].module()(x))  # emulate_precision_casts: the same codes


def _compiled_guards(model: nn.Module, x: Tensor) -> list[str]:
    """The sources of every guard dynamo keeps for `model` called on `x`."""
    names: list[str] = []

    def keep_all(entries: list[Any]) -> list[bool]:
        names.extend(e.name for e in entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=False, options={"guard_filter_fn": keep_all})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x)
    return names


def test_compiled_served_sites_guard_neither_their_plans_nor_the_padding_checks() -> None:
    # Dynamo evaluates every guard at every call: compiled served sites read flags set when they
    # were served, not their plans' GEMMs (high-precision sites) or the backends' padding checks.
    x = torch.randn(24, 32)
    high = serve(_mlp(), config=ServeConfig(dtype="bf16"))
    assert not [n for n in _compiled_guards(high, x) if ".plan." in n or n.endswith(".plan")]
    from loka_train.mods.bmm_site import BmmSite

    class NormBmm(nn.Module):  # a high-precision LayerNorm-fed site and batched site, as Wukong's
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin, self.bmm = nn.LayerNorm(32), Fp8Linear.from_linear(nn.Linear(32, 32)), BmmSite()

        def forward(self, x: Tensor) -> Tensor:
            h = self.lin.forward_layernorm(x, self.norm, activation="relu" if self.lin.runs_fused_norm(x) else "none")
            return self.bmm(h.reshape(4, 6, 32), h.reshape(4, 32, 6))

    assert not [n for n in _compiled_guards(NormBmm(), x) if ".plan." in n or n.endswith(".plan")]
    fp8 = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="bf16"))
    guards = _compiled_guards(fp8, x)
    assert not [n for n in guards if "forward_plan" in n or "pad_to_multiple" in n]
    # Nor what dynamo would reach from two places (a guard per site that they are one): the plan
    # and its enum members (read from one table), the site through its weight's source.
    assert not [n for n in guards if "'served'].gemm." in n or "['source'][0]" in n]


@pytest.mark.parametrize("accepted", [True, False])
def test_compiled_served_sites_check_their_backend_where_it_refused(accepted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled, a served site calls its backend directly where the backend took the GEMM when it
    # was served; elsewhere through run_backend's checks, which raise naming the fix.
    served = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="bf16"))
    assert served[0].served.backend_ok and served[2].served.backend_ok
    served[0].served.backend_ok = accepted
    checked: list[str] = []
    real = serving_module.run_backend
    monkeypatch.setattr(serving_module, "run_backend", lambda *a, **k: (checked.append("x"), real(*a, **k))[1])
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(served, backend="eager")(torch.randn(8, 32))
    assert bool(checked) is not accepted


def test_compile_served_compiles_the_towers() -> None:
    model = convert(Towers(32, 64), config=ModsConfig(enabled=True, keep_last_layer_high=True))
    names = list(sites(model))
    served = serve(model, plans={names[0]: LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE)},
                   config=ServeConfig(dtype="bf16"))
    dense, sparse = torch.randn(16, 32), torch.randn(16, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = served(dense, sparse)
        torch._dynamo.reset()
        assert compile_served(served) == ["dense_arch", "over_arch"]
        assert all(getattr(served, n)._compiled_call_impl is not None for n in ("dense_arch", "over_arch"))
        assert torch.allclose(served(dense, sparse).float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_a_served_model_copied_into_a_fresh_process_finds_its_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(_mlp(), plans=_plans("emulated", Scaling.TENSORWISE), config=ServeConfig(dtype="bf16"))
    x = torch.randn(8, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = served(x)
        monkeypatch.setattr(serving_module, "_GEMMS", {})  # a process that never served
        assert torch.equal(copy.deepcopy(served)(x), expected)


class _Scaled(nn.Module):
    """A tower whose output reads a Python float: dynamo guards its value, a guard no
    recompile has failed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.scale = 2.0

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.scale


def _skip_guarded(inner: nn.Module) -> tuple[SkipGuards, Tensor]:
    """`inner` compiled in place (eager backend, a fresh dynamo cache) in SkipGuards, and an input."""
    torch._dynamo.reset()
    inner.compile(backend="eager")
    return SkipGuards(inner), torch.randn(3, 8)


def test_skip_guards_runs_a_known_call_without_the_model_state_guards_until_reset() -> None:
    inner = _Scaled()
    model, x = _skip_guarded(inner)
    with torch.no_grad():
        first = model(x)
        assert torch.equal(model(x), first)
        assert (model.cold_calls, model.warm_calls) == (1, 1)
        inner.scale = 3.0  # a frozen model's promise broken: a known call runs the graph as it was
        assert torch.equal(model(x), first)
        model.reset()  # every guard again: the change recompiles
        assert torch.allclose(model(x), first * 1.5)
        assert (model.cold_calls, model.warm_calls) == (2, 2)
        # A new batch size, grad mode or dtype is a new kind of call: run with every guard.
        assert model(torch.randn(5, 8)).shape == (5, 4)
    with torch.enable_grad():
        assert model(x).requires_grad
    assert (model.cold_calls, model.warm_calls) == (4, 2)


def test_skip_guards_computes_a_known_call_whose_telling_guard_changed() -> None:
    inner = _Scaled()
    model, x = _skip_guarded(inner)
    with torch.no_grad():
        model(x)
        inner.scale = 3.0
        model.reset()
        model(x)  # recompiled for the new value: its guard failed once, so it tells the graphs apart
        inner.scale = 4.0  # no graph for it: dynamo compiles one, or refuses (torch 2.11) and SkipGuards falls back
        assert torch.allclose(model(x), inner.linear(x) * 4.0)


class _RefusesOnce(nn.Module):
    """Raises what dynamo raises where a call under the skip stance would need a new graph, once."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message, self.raised, self.broken = message, False, False

    def forward(self, x: Tensor) -> Tensor:
        if self.broken:
            raise ValueError("broken")
        if self.message and not self.raised:
            self.raised = True
            raise RuntimeError(self.message)
        return x * 2


def test_skip_guards_runs_a_known_call_with_every_guard_where_dynamo_refuses_to_compile_it() -> None:
    inner = _RefusesOnce("")
    model = SkipGuards(inner)
    x = torch.randn(3, 8)
    model(x)  # cold
    inner.message = ("Recompilation triggered with skip_guard_eval_unsafe stance. This usually means that you "
                     "have not warmed up your model")
    assert torch.equal(model(x), x * 2) and model.guard_fallbacks == 1
    assert torch.equal(model(x), x * 2) and (model.cold_calls, model.warm_calls, model.guard_fallbacks) == (2, 1, 1)
    inner.message, inner.raised = "a failure of its own", False  # fails once: the guarded call runs
    assert torch.equal(model(x), x * 2) and model.guard_fallbacks == 2
    inner.broken = True  # an error of the model's own raises from the guarded call
    with pytest.raises(ValueError, match="broken"):
        model(x)
    assert model.guard_fallbacks == 3


class _Moded(nn.Module):
    def forward(self, x: Tensor, opts: Any) -> Tensor:
        mode = opts["mode"] if isinstance(opts, dict) else opts.mode
        return x * 2 if mode == "double" else x * 3


def test_skip_guards_keys_a_mapping_by_its_values_and_never_skips_for_other_objects() -> None:
    from types import SimpleNamespace

    inner = _Moded()
    model, x = _skip_guarded(inner)
    for mode, factor in [("double", 2), ("triple", 3), ("double", 2), ("triple", 3)]:
        assert torch.equal(model(x, {"mode": mode}), x * factor)  # a fresh dict each call
    assert (model.cold_calls, model.warm_calls) == (2, 2)
    opts = SimpleNamespace(mode="double")  # an object whose attributes a graph reads: always guarded
    for mode, factor in [("double", 2), ("triple", 3), ("double", 2)]:
        opts.mode = mode
        assert torch.equal(model(x, opts), x * factor)
    assert (model.cold_calls, model.warm_calls) == (5, 2)


def test_skip_guards_leaves_a_callers_other_stance_in_force() -> None:
    inner = _Scaled()
    model, x = _skip_guarded(inner)
    with torch.no_grad():
        model(x)
        with torch.compiler.set_stance("force_eager"):
            inner.scale = 5.0  # eager: the new value, whatever graph is cached
            assert torch.allclose(model(x), inner.linear(x) * 5.0)
    assert (model.cold_calls, model.warm_calls, model.guard_fallbacks) == (2, 0, 0)


@pytest.mark.parametrize("loka", [True, False])
def test_skip_guards_over_compiled_served_towers_runs_each_tower_and_batch_size_its_own_graph(loka: bool) -> None:
    # Both towers compiled in place share nn.Module._call_impl's code, and so dynamo's cache: a
    # call that skipped the guards telling them apart would run one tower's graph for the other.
    served: nn.Module = Towers(32, 64)
    if loka:  # one FP8 site (its served weight and static scales among the buffers) and high ones
        served = convert(served, config=ModsConfig(enabled=True, keep_last_layer_high=True))
        names = list(sites(served))
        serve(served, plans={names[0]: LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE)},
              config=ServeConfig(dtype="bf16"))
    calls = [(torch.randn(b, 32), torch.randn(b, 32)) for b in (16, 8, 16, 8)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [served(d, s).float() for d, s in calls]
        torch._dynamo.reset()
        compile_served(served)
        fast = SkipGuards(served)
        for (d, s), want in zip(calls, expected, strict=True):
            assert torch.allclose(fast(d, s).float(), want, atol=1e-2, rtol=1e-2)
    assert (fast.cold_calls, fast.warm_calls) == (2, 2)


def test_skip_guards_tells_calls_apart_by_their_jagged_keys_and_batch() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from loka_train.export.program import _signature

    def kjt(keys: list[str], lengths: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=keys, values=torch.arange(sum(lengths)), lengths=torch.tensor(lengths))

    same = _signature(kjt(["a", "b"], [1, 2, 0, 3]))
    assert _signature(kjt(["a", "b"], [2, 2, 1, 1])) == same  # other ids, the same pooled shapes
    assert _signature(kjt(["a", "b"], [1, 2, 0, 3, 1, 1])) != same  # batch 3
    assert _signature(kjt(["b", "a"], [1, 2, 0, 3])) != same
    assert _signature(torch.zeros(2, 3)) != _signature(torch.zeros(3, 2))
    assert _signature(torch.zeros(2, 3)) != _signature(torch.zeros(2, 3, dtype=torch.bfloat16))


# ------------------------------------------------------------------------- fast accumulation
def test_fast_accumulation_reaches_the_backend_of_every_served_fp8_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from loka_train.kernels import registry

    plans = _plans("emulated", Scaling.ROWWISE)
    plans["2"] = LinearPlan()  # in high precision: nothing to accumulate fast
    calls: list[bool] = []

    class Recording:
        def __init__(self, name: str) -> None:
            self.backend = registry.get_backend(name)
            self.supports = self.backend.supports

        def __call__(self, *args: Any, fast_accum: bool = False, **kwargs: Any) -> Tensor:
            calls.append(fast_accum)
            return self.backend(*args, fast_accum=fast_accum, **kwargs)

    def recording(name: str) -> Any:
        return Recording(name)

    import loka_train.kernels.linear as linear_module

    monkeypatch.setattr(serving_module, "get_backend", recording)  # the compiled call
    monkeypatch.setattr(linear_module, "get_backend", recording)  # the eager one, through run_backend
    x = torch.randn(24, 32)
    exact = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))
    fast = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32", fast_accum=True))
    assert [str(s.plan.forward) for s in sites(fast).values()] == ["fp8:e4m3/rowwise@emulated+fast", "high"]
    assert not any(s.plan.forward.fast_accum for s in sites(exact).values())
    with torch.no_grad():
        calls.clear()
        want = exact(x)
        assert calls == [False]
        calls.clear()
        got = fast(x)
        assert calls == [True]
    torch.testing.assert_close(got, want)  # the emulated backend accumulates in fp32 either way
    # Compiled, the served weight calls its backend directly: with the flag too.
    from loka_train.kernels.formats import quantize

    served_weight = sites(fast)["0"].served
    gemm = sites(fast)["0"].plan.forward
    x_q = quantize(torch.randn(24, 32), gemm.fmt, gemm.scaling)
    calls.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    served_weight._gemm(gemm, x_q, torch.float32, None)
    monkeypatch.undo()
    assert calls == [True]


def test_a_backend_without_fast_accumulation_keeps_its_plan() -> None:
    from loka_train.kernels.plan import Precision

    odd = GemmPlan(precision=Precision.FP8, backend="registered_later")
    assert odd.with_fast_accum() is odd and GemmPlan().with_fast_accum() == GemmPlan()
    assert str(GemmPlan(precision=Precision.FP8, backend="triton").with_fast_accum()).endswith("@triton+fast")
    # cuBLASLt's block-scaled FP8 has no fast accumulation: such a plan keeps its own, and one
    # asking for it is refused where it is made.
    block = GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm", scaling=Scaling.BLOCK)
    assert block.with_fast_accum() is block
    assert GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm").with_fast_accum().fast_accum
    with pytest.raises(ValueError, match="no fast accumulation mode for block"):
        GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm", scaling=Scaling.BLOCK, fast_accum=True)


def test_plans_re_decided_for_fast_accumulation_are_timed_with_it() -> None:
    from loka_train.export import decide_for_batch

    plans = _plans("emulated", Scaling.ROWWISE)
    # Served without it: the trained plans (and the Probe's safe candidates) have none.
    served = serve(_mlp(), plans=plans, config=ServeConfig(dtype="fp32"))
    from loka_train.dispatch import ledger as ledger_module

    timed: list[str] = []
    real = ledger_module._fp8_times

    def recording(gemm: Any, plan: GemmPlan, *args: Any, **kwargs: Any) -> Any:
        timed.append(str(plan))
        return real(gemm, plan, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ledger_module, "_fp8_times", recording)
        decided, rows = decide_for_batch(served, lambda m: m(torch.randn(24, 32)), device=torch.device("cpu"),
                                         timer=_fake_timer({"high": 1.0, "gemm": 0.4, "quant_a": 0.1}),
                                         fast_accum=True)
    assert [r.chosen for r in rows] == ["fp8:e4m3/rowwise@emulated+fast"] * 2
    assert all(decided[n].forward == plans[n].forward.with_fast_accum() for n in plans)
    assert timed == ["fp8:e4m3/rowwise@emulated+fast"] * 2  # each candidate timed as it would serve
