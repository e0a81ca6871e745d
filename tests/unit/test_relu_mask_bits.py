"""A folded ReLU's mask kept as bits (``mods.relu_mask_bits``): the same gradients as the
pre-activation gives, and the pre-activation no longer kept for the backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_train.kernels.formats import Scaling
from loka_train.kernels.linear import fp8_linear, relu_grad_from_bits, relu_mask_bits
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import ModsConfig, convert, sites


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_bits_give_threshold_backward_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal of the dtype
    x = torch.randn(6, 2, 40, generator=g).to(dtype)
    x[0, 0, :8] = torch.tensor([0.0, -0.0, float("nan"), float("-inf"), float("inf"), tiny, -tiny, 2.0])
    grad = torch.randn(6, 2, 40, generator=g).to(dtype)
    grad[1, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 3.0])
    bits = relu_mask_bits(x)
    assert bits.dtype == torch.uint8 and bits.shape == (6, 2, 5)
    # Element 8 i + j is bit j of byte i: x[0, 0, :8] keeps NaN, +inf, the subnormal and 2.0.
    assert int(bits[0, 0, 0]) == (1 << 2) | (1 << 4) | (1 << 5) | (1 << 7)
    ints = {2: torch.int16, 4: torch.int32}[grad.element_size()]
    for g_in in (grad, grad.transpose(0, 1).contiguous().transpose(0, 1)):  # and a non-contiguous one
        expected = torch.ops.aten.threshold_backward(g_in, x, 0)
        got = relu_grad_from_bits(g_in, bits)
        assert got.dtype == dtype and torch.equal(got.view(ints), expected.view(ints))


def _saved(fn):  # type: ignore[no-untyped-def]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("grad_weight", ["tensorwise", "high", "rowwise"])
def test_a_folded_relu_keeps_bits_and_the_same_gradients(grad_weight: str) -> None:
    # The Triton tensor-wise cast folds the ReLU (interpreted on the CPU). Bits only where
    # grad-weight takes the forward's FP8 x over: a high-precision or row-wise grad-weight keeps
    # x (the Function's own), and bits would be one more copy.
    plan = LinearPlan.fp8(backend="triton", scaling=Scaling.TENSORWISE)
    if grad_weight == "high":
        plan = LinearPlan(forward=plan.forward, grad_input=plan.grad_input)
    elif grad_weight == "rowwise":
        rowwise = LinearPlan.fp8(backend="triton", scaling=Scaling.ROWWISE)
        plan = LinearPlan(forward=plan.forward, grad_input=plan.grad_input, grad_weight=rowwise.grad_weight)
    grad_weight_fp8 = grad_weight == "tensorwise"
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(64, 48, generator=g)
    w0 = torch.randn(32, 48, generator=g) / 7
    b0 = torch.randn(32, generator=g)
    dy = torch.randn(64, 32, generator=g)
    results = {}
    for bits in (False, True):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, saved = _saved(lambda x=x, w=w, b=b, bits=bits: fp8_linear(x, w, b, plan, input_relu=True,
                                                                         mask_bits=bits))
        y.backward(dy)
        results[bits] = (y.detach(), x.grad, w.grad, b.grad, saved)
    plain, packed = results[False], results[True]
    for a, c in zip(plain[:4], packed[:4]):
        assert torch.equal(a, c)
    assert torch.equal(plain[1], torch.where(x0 > 0, plain[1], 0)) and (plain[1] != 0).any()
    uint8 = [t for t in packed[4] if t.dtype == torch.uint8]
    if grad_weight_fp8:
        # The bits instead of the pre-activation: no (64, 48) tensor kept, one (64, 6) of bits.
        assert [tuple(t.shape) for t in uint8] == [(64, 6)]
        assert not any(tuple(t.shape) == (64, 48) and t.is_floating_point() for t in packed[4])
        assert any(tuple(t.shape) == (64, 48) and t.is_floating_point() for t in plain[4])
    else:
        assert not uint8


def test_no_bits_without_a_backward_or_a_weight_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    import loka_train.kernels.linear as linear

    made = []
    real = linear.relu_mask_bits
    monkeypatch.setattr(linear, "relu_mask_bits", lambda x: made.append(x.shape) or real(x))
    plan = LinearPlan.fp8(backend="triton", scaling=Scaling.TENSORWISE)
    x, w = torch.randn(32, 48, requires_grad=True), torch.randn(16, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            fp8_linear(x, w, None, plan, input_relu=True, mask_bits=True)
        fp8_linear(x, w.detach(), None, plan, input_relu=True, mask_bits=True)  # a frozen weight
        fp8_linear(x[:, :44], w[:, :44], None, plan, input_relu=True, mask_bits=True)  # K not a multiple of 8
        assert made == []
        fp8_linear(x, w, None, plan, input_relu=True, mask_bits=True)
    assert made == [(32, 48)]


def test_convert_sets_the_option_and_a_compiled_step_computes_the_same_gradients() -> None:
    def model(bits: bool) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 1))
        m = convert(net, config=ModsConfig(enabled=True, relu_mask_bits=bits))
        for site in sites(m).values():
            site.set_plan(LinearPlan.fp8(backend="triton", scaling=Scaling.TENSORWISE))
        return m

    assert all(s.relu_mask_bits for s in sites(model(True)).values())
    assert not any(s.relu_mask_bits for s in sites(model(False)).values())
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    grads = []
    for bits, compiled in ((False, False), (True, False), (True, True)):
        m = model(bits)
        run = torch.compile(m, backend="aot_eager") if compiled else m
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, saved = _saved(lambda run=run: run(x))
        out.float().sum().backward()
        grads.append([p.grad for p in m.parameters()])
        if not compiled:  # the sites pass the option down: bits of the folded input (the logit layer's is not)
            assert [tuple(t.shape) for t in saved if t.dtype == torch.uint8] == ([(64, 8)] if bits else [])
    assert all(g is not None for g in grads[0]) and len(grads[0]) == 6
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2], strict=True))
    with pytest.raises(ValueError, match="relu_mask_bits"):
        ModsConfig(relu_mask_bits="yes")  # type: ignore[arg-type]
