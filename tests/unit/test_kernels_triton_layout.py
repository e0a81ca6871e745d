"""``loka::transposed_rows`` (under TRITON_INTERPRET=1): the rows of ``x_BND.transpose(1, 2)``
bit for bit as ``x.to(dtype).reshape(-1, N)`` copies them, ragged tiles included; its gradient;
the layouts it refuses."""

import pytest
import torch

from loka_train.kernels import triton_layout as tl_
from loka_train.kernels.triton_layout import is_batch_transposed, transposed_rows


@pytest.mark.parametrize("shape", [(3, 27, 70), (2, 70, 130), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_rows_are_the_reshaped_copy(shape, dtype, monkeypatch):
    monkeypatch.setattr(tl_, "_MAX_BLOCK_N", 32)  # N = 70 spans three tiles, the last ragged
    x_BND = torch.randn(*shape)
    x = x_BND.transpose(1, 2)
    assert is_batch_transposed(x) or shape == (1, 1, 1)
    if not is_batch_transposed(x):
        return
    got = transposed_rows(x, dtype)
    want = x.to(dtype).reshape(-1, shape[1])
    assert got.is_contiguous() and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        # The interpreter converts to bf16 by truncation, the GPU to nearest even (bit for bit
        # the copy there: tests/gpu/test_kernels_gpu.py): one bf16 ulp apart at most here.
        assert torch.equal(got, x.float().reshape(-1, shape[1]).to(dtype)) or torch.allclose(
            got.float(), want.float(), rtol=2**-7, atol=0)


def test_the_gradient_is_the_rows_gradient_viewed_back():
    x_BND = torch.randn(2, 5, 8, requires_grad=True)
    g = torch.randn(16, 5)
    transposed_rows(x_BND.transpose(1, 2), torch.float32).backward(g)
    ref = x_BND.detach().clone().requires_grad_()
    ref.transpose(1, 2).reshape(-1, 5).backward(g)
    assert torch.equal(x_BND.grad, ref.grad)


@pytest.mark.parametrize("args", [(torch.bfloat16,), (torch.bfloat16, 32)], ids=["rows", "padded"])
def test_opcheck(args):
    x = torch.randn(3, 27, 40).transpose(1, 2)
    torch.library.opcheck(torch.ops.loka.transposed_rows.default, (x, *args),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_other_layouts_are_refused():
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(4, 3, 2).permute(2, 1, 0), torch.float32)


@pytest.mark.parametrize(("n", "width"), [(27, 32), (5, 16), (16, 16), (5, 200)])
def test_rows_are_zero_padded_to_the_width(n, width, monkeypatch):
    monkeypatch.setattr(tl_, "_MAX_BLOCK_N", 32)  # width 200: tiles wholly past N, a ragged last one
    x = torch.randn(3, n, 40).transpose(1, 2)
    got = transposed_rows(x, torch.float32, width)
    assert got.shape == (120, width) and got.is_contiguous()
    assert torch.equal(got[:, :n], x.reshape(-1, n))
    assert torch.equal(got[:, n:], torch.zeros(120, width - n))


def test_the_gradient_of_padded_rows_drops_the_padding():
    x_BND = torch.randn(2, 5, 8, requires_grad=True)
    g = torch.randn(16, 16)
    transposed_rows(x_BND.transpose(1, 2), torch.float32, 16).backward(g)
    assert torch.equal(x_BND.grad, g[:, :5].reshape(2, 8, 5).transpose(1, 2))


def test_a_width_narrower_than_the_rows_is_refused():
    with pytest.raises(ValueError, match="narrower"):
        transposed_rows(torch.randn(2, 27, 8).transpose(1, 2), torch.float32, 16)


@pytest.fixture
def rows_seen(monkeypatch):
    """The shapes of the rows fp8_linear hands its Function, in call order."""
    from loka_train.kernels import linear

    seen: list[torch.Size] = []
    real = linear._fp8_linear_rows

    def record(x, *args):  # type: ignore[no-untyped-def]
        seen.append(x.shape)
        return real(x, *args)

    monkeypatch.setattr(linear, "_fp8_linear_rows", record)
    return seen


@pytest.mark.parametrize("plan_name", ["high", "tensorwise", "rowwise", "fp8_grad_input_only"])
def test_fp8_linear_over_padded_transposed_rows_matches_the_unpadded_layer(plan_name, rows_seen, monkeypatch):
    """fp8_linear copies the rows of a transposed input (Wukong's xt_proj, K = 27) zero-padded
    to K = 32 and pads its weight to match: forward and gradients are the unpadded layer's (the
    padding adds zero products), for every kind of plan such a site runs."""
    from loka_train.kernels import linear
    from loka_train.kernels.formats import Scaling
    from loka_train.kernels.linear import fp8_linear
    from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision

    plans = {
        "high": LinearPlan.high_precision(),
        "tensorwise": LinearPlan.fp8(scaling=Scaling.TENSORWISE),
        "rowwise": LinearPlan.fp8(scaling=Scaling.ROWWISE),
        "fp8_grad_input_only": LinearPlan(
            forward=GemmPlan(), grad_input=GemmPlan(precision=Precision.FP8), grad_weight=GemmPlan()),
    }
    plan = plans[plan_name]
    gen = torch.Generator().manual_seed(0)
    x_BND = torch.randn(4, 27, 40, generator=gen)
    w, b = torch.randn(16, 27, generator=gen), torch.randn(16, generator=gen)
    g = torch.randn(4, 40, 16, generator=gen)

    def run(pad: bool):
        monkeypatch.setattr(linear, "_copies_transposed_rows", lambda x: pad and is_batch_transposed(x))
        xb, wl, bl = (t.clone().requires_grad_() for t in (x_BND, w, b))
        y = fp8_linear(xb.transpose(1, 2), wl, bl, plan)
        y.backward(g)
        return y.detach(), xb.grad, wl.grad, bl.grad

    got, want = run(True), run(False)
    assert rows_seen == [torch.Size([160, 32]), torch.Size([160, 27])]
    for a, e in zip(got, want):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_an_aligned_k_is_not_padded(rows_seen, monkeypatch):
    """K a multiple of 8 already takes cuBLAS's aligned kernels: the rows stay K wide."""
    from loka_train.kernels import linear
    from loka_train.kernels.linear import fp8_linear
    from loka_train.kernels.plan import LinearPlan

    monkeypatch.setattr(linear, "_copies_transposed_rows", is_batch_transposed)
    for k in (24, 27):
        fp8_linear(torch.randn(2, k, 8).transpose(1, 2), torch.randn(4, k), None, LinearPlan.fp8())
    assert rows_seen == [torch.Size([16, 24]), torch.Size([16, 32])]
