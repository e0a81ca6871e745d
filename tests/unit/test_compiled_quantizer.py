"""The compiled quantizer (``mods.compiled_quantizer``, ``KernelSettings.compiled_quantizer``,
a site's ``compiled_quantizer``): under torch.compile, "inductor" quantizes FP8 operands with
plain torch ops (and runs LayerNorm -> Linear as the separate composition) for inductor to
fuse; "custom" (default) runs each FP8 Function as one opaque custom op (``kernels.opaque``),
with the Triton custom ops inside. Eager code is the same either way. The environment variable
``LOKA_COMPILED_QUANTIZER`` overrides the config when ``convert`` runs.
CPU: the Triton kernels run interpreted (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import AotEagerAndRecordGraphs

from loka_train.kernels import LinearPlan
from loka_train.kernels import linear as linear_mod
from loka_train.kernels.settings import KernelSettings
from loka_train.mods import Fp8Linear, ModsConfig, convert, sites


def _plan() -> LinearPlan:
    return LinearPlan.fp8(backend="triton")


def _custom_ops(graphs: list) -> set[str]:
    """The loka:: custom ops in `graphs`, but the GEMM (an extern call like aten._scaled_mm)."""
    return {str(n.target) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("loka.")
            and not str(n.target).startswith("loka.fp8_gemm")}


def _run_compiled(mode: str) -> tuple[set[str], torch.Tensor, list]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    norm, site = nn.LayerNorm(32), Fp8Linear.from_linear(nn.Linear(32, 32))
    site.set_plan(_plan())
    site.compiled_quantizer = mode
    x = torch.randn(64, 32, requires_grad=True)
    backend = AotEagerAndRecordGraphs()
    fn = torch.compile(lambda t: site.forward_layernorm(t, norm), backend=backend)
    y = fn(x)
    y.sum().backward()
    return _custom_ops(backend.fw_graphs + backend.bw_graphs), y.detach(), [x.grad, site.weight.grad]


def test_inductor_mode_traces_plain_torch_ops_and_custom_mode_keeps_the_custom_ops() -> None:
    custom_ops, y_custom, grads_custom = _run_compiled("custom")
    # custom: the fused LayerNorm -> FP8 Function is one opaque op each way (kernels.opaque).
    assert custom_ops == {"loka.layernorm_linear.default", "loka.fn_backward.default"}, custom_ops
    inductor_ops, y_inductor, grads_inductor = _run_compiled("inductor")
    assert inductor_ops == set(), inductor_ops
    # Same quantization recipe (row-wise e4m3 forward): outputs agree to FP8 precision.
    torch.testing.assert_close(y_inductor, y_custom, rtol=0.1, atol=0.1)
    for a, b in zip(grads_inductor, grads_custom):
        assert a is not None and b is not None and torch.isfinite(a).all()


def test_the_switch_applies_only_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(8, 32)
    plan = _plan().forward
    assert not linear_mod.inductor_quantizes("inductor")  # eager: the Triton quantizer
    assert linear_mod.use_fused_quantizer(plan, t, plan.fmt)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert linear_mod.inductor_quantizes("inductor")
    assert not linear_mod.use_fused_quantizer(plan, t, plan.fmt, reference_quantizer=True)
    assert not linear_mod.inductor_quantizes("custom")


def test_convert_gives_the_sites_the_configured_mode_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def modes(config: ModsConfig) -> set[str]:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        convert(model, config=config)
        return {site.compiled_quantizer for site in sites(model).values()}

    monkeypatch.delenv("LOKA_COMPILED_QUANTIZER", raising=False)
    assert modes(ModsConfig()) == {"custom"}
    assert modes(ModsConfig(compiled_quantizer="inductor")) == {"inductor"}
    monkeypatch.setenv("LOKA_COMPILED_QUANTIZER", "inductor")
    assert modes(ModsConfig()) == {"inductor"}
    with pytest.raises(ValueError, match="compiled_quantizer"):
        ModsConfig(compiled_quantizer="fused")


def test_kernel_settings_read_their_overrides_only_when_asked() -> None:
    assert KernelSettings() == KernelSettings(compiled_quantizer="custom", triton_autotune=True)
    env = {"LOKA_COMPILED_QUANTIZER": "inductor", "LOKA_TRITON_AUTOTUNE": "0"}
    assert KernelSettings().with_env_overrides(env) == KernelSettings(
        compiled_quantizer="inductor", triton_autotune=False
    )
    assert KernelSettings().with_env_overrides({"LOKA_TRITON_AUTOTUNE": "1"}).triton_autotune
    with pytest.raises(ValueError, match="LOKA_COMPILED_QUANTIZER"):
        KernelSettings().with_env_overrides({"LOKA_COMPILED_QUANTIZER": "fused"})


def test_inductor_mode_computes_what_the_eager_fused_path_computes() -> None:
    """The switch changes which kernels quantize, not the FP8 codes: the traced reference
    quantizer and separate LayerNorm -> Linear agree with the eager fused LayerNorm -> FP8
    Triton path up to LayerNorm rounding (a flipped FP8 code would be ~1e-2 off)."""

    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        norm, site = nn.LayerNorm(64), Fp8Linear.from_linear(nn.Linear(64, 32))
        site.set_plan(_plan())
        site.compiled_quantizer = "inductor"
        x = torch.randn(128, 64, requires_grad=True)

        def fn(t: torch.Tensor) -> torch.Tensor:
            return site.forward_layernorm(t, norm)

        y = (torch.compile(fn, backend="aot_eager") if compiled else fn)(x)
        y.square().sum().backward()
        return [y.detach(), x.grad, site.weight.grad, norm.weight.grad]

    for eager, traced in zip(run(False), run(True)):
        torch.testing.assert_close(traced, eager, rtol=1e-4, atol=1e-4)
