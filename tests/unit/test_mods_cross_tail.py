"""A DCN cross layer's tail in its ``W`` GEMM's epilogue (``mods.dcn_tail_in_gemm``), under bf16
autocast on the CPU with the Triton interpreter: the same outputs and gradients as the
``addcmul`` after the GEMM, eagerly and compiled; the next layer reads the epilogue's bf16 copy;
where the call does not allow it (a sampled step, another plan, no autocast) the ``addcmul``
runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec.modules.crossnet import LowRankCrossNet

from loka_train.kernels.formats import Scaling
from loka_train.kernels.linear import takes_cross_tail
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.mods.interaction import CrossNet
from loka_train.mods.site import GemmSite

# W's forward tensor-wise FP8 on the Triton backend (the interpreter runs it on the CPU), its
# backward in high precision: both paths then compute the same values but for the tail's own
# rounding. TAIL_FP8: the backward in FP8 (emulated), whose codes such a rounding can move.
TAIL = LinearPlan(forward=GemmPlan(precision=Precision.FP8, scaling=Scaling.TENSORWISE, backend="triton"))
TAIL_FP8 = LinearPlan(
    forward=TAIL.forward,
    grad_input=LinearPlan.fp8(scaling=Scaling.TENSORWISE).grad_input,
    grad_weight=LinearPlan.fp8(scaling=Scaling.TENSORWISE).grad_weight,
)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


def _nets(tail: LinearPlan = TAIL) -> tuple[CrossNet, CrossNet]:
    torch.manual_seed(0)
    cn = LowRankCrossNet(in_features=48, num_layers=3, low_rank=16)
    with torch.no_grad():
        for p in cn.parameters():
            p.normal_(0, 0.2)
    fused = CrossNet.from_crossnet(copy.deepcopy(cn), tail_in_gemm=True)
    unfused = CrossNet.from_crossnet(copy.deepcopy(cn), tail_in_gemm=False)
    for net in (fused, unfused):
        for i in range(3):
            net.layer_sites(i).W.set_plan(tail)
            net.layer_sites(i).V.set_plan(LinearPlan.fp8(scaling=Scaling.TENSORWISE))
    return fused, unfused


OUT = torch.randn(8, 48, generator=torch.Generator().manual_seed(1)) / 7
"""An over-arch's first weight after the net: it reads the net's output in bf16 under autocast,
whether the net returns the fp32 stream or its bf16 copy."""


def _run(net: CrossNet, x: torch.Tensor, g: torch.Tensor, fn=None) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = (net if fn is None else fn)(x)
        logits = torch.nn.functional.linear(y, OUT)
    logits.float().backward(g)
    return [y.detach().float(), x.grad, *(p.grad for p in net.parameters())]


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from loka_train.kernels import triton_cross

    calls: list[int] = []
    real = triton_cross.cross_epilogue_gemm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_cross, "cross_epilogue_gemm", counted)
    return calls


def test_the_tail_in_the_epilogue_gives_the_addcmuls_outputs_and_gradients(monkeypatch) -> None:
    calls = _calls(monkeypatch)
    fused, unfused = _nets()
    x = torch.randn(40, 48)
    g = torch.randn(40, 8)
    want = _run(unfused, x, g)
    assert not calls
    got = _run(fused, x, g)
    assert len(calls) == 3  # every layer's W GEMM took the tail
    # The net returns the bf16 copy of the last layer's output (what the over-arch reads).
    torch.testing.assert_close(got[0], want[0].to(torch.bfloat16).float(), rtol=2**-8, atol=1e-5)
    for name, a, b in zip(["x", *[n for n, _ in fused.named_parameters()]], got[1:], want[1:], strict=True):
        # The same GEMMs; the epilogue's z and copy round as the addcmul path's, its x_{l+1}
        # within an fp32 ulp (the interpreter's product rounds twice, the CPU's addcmul once).
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=name)


def test_with_an_fp8_backward_the_gradients_keep_their_sqnr(monkeypatch) -> None:
    fused, unfused = _nets(TAIL_FP8)
    x = torch.randn(64, 48)
    g = torch.randn(64, 8)
    want = _run(unfused, x, g)
    calls = _calls(monkeypatch)
    got = _run(fused, x, g)
    assert len(calls) == 3
    for a, b in zip(got[1:], want[1:], strict=True):
        assert _sqnr_db(b, a) > 20


def test_compiled_the_op_returns_the_tail(monkeypatch) -> None:
    fused, unfused = _nets()
    x = torch.randn(40, 48)
    g = torch.randn(40, 8)
    want = _run(unfused, x, g)
    calls = _calls(monkeypatch)
    torch._dynamo.reset()
    # fullgraph: a graph break (a Function handed one tensor twice, which dynamo refuses) would
    # run the net eagerly and pass unseen.
    got = _run(fused, x, g, torch.compile(fused, dynamic=False, fullgraph=True))
    assert calls  # the op's real run (after its fake one)
    torch.testing.assert_close(got[0], want[0].to(torch.bfloat16).float(), rtol=2**-8, atol=1e-5)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_where_the_call_does_not_allow_it_the_addcmul_runs(monkeypatch) -> None:
    calls = _calls(monkeypatch)
    # Row-wise W forward: no tail in the GEMM.
    fused, _ = _nets(LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton"))
    _run(fused, torch.randn(40, 48), torch.randn(40, 8))
    assert not calls
    # The emulated backend (the oracle) keeps its own GEMM.
    fused, _ = _nets(LinearPlan.fp8(scaling=Scaling.TENSORWISE))
    _run(fused, torch.randn(40, 48), torch.randn(40, 8))
    assert not calls
    # Without autocast the compute dtype is fp32.
    fused, _ = _nets()
    x = torch.randn(40, 48, requires_grad=True)
    fused(x).sum().backward()
    assert not calls
    ok, why = takes_cross_tail(torch.randn(4, 16), torch.randn(48, 16), None, TAIL, torch.randn(4, 48),
                               torch.randn(4, 48))
    assert not ok and "bf16" in why


def test_a_sampled_step_runs_the_addcmul_for_the_taps(monkeypatch) -> None:
    calls = _calls(monkeypatch)
    fused, _ = _nets()
    site = fused.layer_sites(0).W
    assert isinstance(site, GemmSite)
    monkeypatch.setattr(GemmSite, "_should_observe", lambda self: self is site)
    _run(fused, torch.randn(40, 48), torch.randn(40, 8))
    assert len(calls) == 2  # layers 1 and 2


def test_the_op_returns_the_tail_before_its_saved_tensors_and_its_gradients_are_the_functions() -> None:
    """``loka::planned_linear`` called with the tail (what compiled code runs): ``[y, x_{l+1},
    copy, *saved]``, the saved tensors rebuilt for its backward after the two extra outputs;
    ``x_l`` None reads ``x0``."""
    from loka_train.kernels import opaque
    from loka_train.kernels.linear import _planned_linear_op, cross_tail_linear
    torch.manual_seed(3)
    plan = LinearPlan(forward=TAIL.forward, grad_input=TAIL_FP8.grad_input, grad_weight=TAIL_FP8.grad_weight)
    u = torch.randn(40, 16).to(torch.bfloat16).requires_grad_()
    w = torch.randn(48, 16, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    x0 = torch.randn(40, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, out, out16 = cross_tail_linear(u, w, b, plan, x0, None, compiled_quantizer="custom")
        outs = _planned_linear_op(u, w, b, plan.key, None, False, True, None, False, False, x0, None, None, False,
                                  torch.bfloat16, opaque.needs_grad(u, w, b))
    assert len(outs) > 3 and torch.equal(outs[0], y) and torch.equal(outs[1], out) and torch.equal(outs[2], out16)
    torch.testing.assert_close(out, torch.addcmul(x0, x0, y.float()), rtol=2**-23, atol=2**-22)  # x_l read as x0
    assert not outs[1].requires_grad and not outs[2].requires_grad
    g = torch.randn(40, 48)
    want = torch.autograd.grad((y.float() * g).sum(), (u, w, b))
    got = torch.autograd.grad((outs[0].float() * g).sum(), (u, w, b))
    for a, c in zip(got, want, strict=True):
        assert torch.equal(a, c)
