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


def test_the_bits_give_threshold_backward_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    x[0, :8] = torch.tensor([0.0, -0.0, float("nan"), float("-inf"), float("inf"), 1e-30, -1e-30, 2.0])
    grad = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    grad[1, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 3.0])
    bits = relu_mask_bits(x)
    assert bits.dtype == torch.uint8 and bits.shape == (6, 5)
    # Element 8 i + j is bit j of byte i: x[0, :8] keeps NaN, +inf, 1e-30 and 2.0 (bits 2, 4, 5, 7).
    assert int(bits[0, 0]) == (1 << 2) | (1 << 4) | (1 << 5) | (1 << 7)
    expected = torch.ops.aten.threshold_backward(grad, x, 0)
    got = relu_grad_from_bits(grad, bits)
    assert got.dtype == grad.dtype and torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _saved(fn):  # type: ignore[no-untyped-def]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("grad_weight_fp8", [True, False])
def test_a_folded_relu_keeps_bits_and_the_same_gradients(grad_weight_fp8: bool) -> None:
    # The Triton tensor-wise cast folds the ReLU (interpreted on the CPU).
    plan = LinearPlan.fp8(backend="triton", scaling=Scaling.TENSORWISE)
    if not grad_weight_fp8:
        plan = LinearPlan(forward=plan.forward, grad_input=plan.grad_input)
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
    else:  # a high-precision grad-weight keeps x anyway: no bits
        assert not uint8


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
            run(x).float().sum().backward()
        grads.append([p.grad for p in m.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2]))
    with pytest.raises(ValueError, match="relu_mask_bits"):
        ModsConfig(relu_mask_bits="yes")  # type: ignore[arg-type]
