"""``LOKA_COMPILED_QUANTIZER`` (``kernels.linear.COMPILED_QUANTIZER``): under torch.compile,
"inductor" quantizes FP8 operands with plain torch ops (and runs LayerNorm -> Linear as the
separate composition) for inductor to fuse; "custom" (default) runs each FP8 Function as one
opaque custom op (``kernels.opaque``), with the Triton custom ops inside.
Eager code is the same either way. CPU: the Triton kernels run interpreted (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import AotEagerAndRecordGraphs

from loka_train.kernels import LinearPlan
from loka_train.kernels import linear as linear_mod
from loka_train.mods import Fp8Linear
from loka_train.mods import site as site_mod


def _plan() -> LinearPlan:
    return LinearPlan.fp8(backend="triton")


def _custom_ops(graphs: list) -> set[str]:
    """The loka:: custom ops in `graphs`, but the GEMM (an extern call like aten._scaled_mm)."""
    return {str(n.target) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("loka.")
            and not str(n.target).startswith("loka.fp8_gemm")}


def _run_compiled(monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[set[str], torch.Tensor, list]:
    monkeypatch.setattr(linear_mod, "COMPILED_QUANTIZER", mode)
    torch._dynamo.reset()
    torch.manual_seed(0)
    norm, site = nn.LayerNorm(32), Fp8Linear.from_linear(nn.Linear(32, 32))
    site.set_plan(_plan())
    x = torch.randn(64, 32, requires_grad=True)
    backend = AotEagerAndRecordGraphs()
    fn = torch.compile(lambda t: site.forward_layernorm(t, norm), backend=backend)
    y = fn(x)
    y.sum().backward()
    return _custom_ops(backend.fw_graphs + backend.bw_graphs), y.detach(), [x.grad, site.weight.grad]


def test_inductor_mode_traces_plain_torch_ops_and_custom_mode_keeps_the_custom_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    custom_ops, y_custom, grads_custom = _run_compiled(monkeypatch, "custom")
    # custom: the fused LayerNorm -> FP8 Function is one opaque op each way (kernels.opaque).
    assert custom_ops == {"loka.layernorm_linear.default", "loka.fn_backward.default"}, custom_ops
    inductor_ops, y_inductor, grads_inductor = _run_compiled(monkeypatch, "inductor")
    assert inductor_ops == set(), inductor_ops
    # Same quantization recipe (row-wise e4m3 forward): outputs agree to FP8 precision.
    torch.testing.assert_close(y_inductor, y_custom, rtol=0.1, atol=0.1)
    for a, b in zip(grads_inductor, grads_custom):
        assert a is not None and b is not None and torch.isfinite(a).all()


def test_the_switch_applies_only_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_mod, "COMPILED_QUANTIZER", "inductor")
    t = torch.randn(8, 32)
    plan = _plan().forward
    assert linear_mod.use_fused_quantizer(plan, t, plan.fmt)  # eager: the Triton quantizer
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert linear_mod.inductor_quantizes()
    assert not linear_mod.use_fused_quantizer(plan, t, plan.fmt)
    assert site_mod.inductor_quantizes()
    monkeypatch.setattr(linear_mod, "COMPILED_QUANTIZER", "custom")
    assert not linear_mod.inductor_quantizes()


def test_inductor_mode_computes_what_the_eager_fused_path_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch changes which kernels quantize, not the FP8 codes: the traced reference
    quantizer and separate LayerNorm -> Linear agree with the eager fused LayerNorm -> FP8
    Triton path up to LayerNorm rounding (a flipped FP8 code would be ~1e-2 off)."""
    monkeypatch.setattr(linear_mod, "COMPILED_QUANTIZER", "inductor")

    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        norm, site = nn.LayerNorm(64), Fp8Linear.from_linear(nn.Linear(64, 32))
        site.set_plan(_plan())
        x = torch.randn(128, 64, requires_grad=True)

        def fn(t: torch.Tensor) -> torch.Tensor:
            return site.forward_layernorm(t, norm)

        y = (torch.compile(fn, backend="aot_eager") if compiled else fn)(x)
        y.square().sum().backward()
        return [y.detach(), x.grad, site.weight.grad, norm.weight.grad]

    for eager, traced in zip(run(False), run(True)):
        torch.testing.assert_close(traced, eager, rtol=1e-4, atol=1e-4)
