"""``loka::transposed_rows`` (under TRITON_INTERPRET=1): the rows of ``x_BND.transpose(1, 2)``
bit for bit as ``x.to(dtype).reshape(-1, N)`` copies them, ragged tiles included; its gradient;
the layouts it refuses."""

import pytest
import torch

from loka_train.kernels import triton_layout as tl_
from loka_train.kernels.triton_layout import is_batch_transposed, row_stride, transposed_rows


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
    assert got.shape == want.shape and got.stride() == (row_stride(shape[1], dtype), 1)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        # The interpreter converts to bf16 by truncation, the GPU to nearest even (bit for bit
        # the copy there: tests/gpu/test_kernels_gpu.py): one bf16 ulp apart at most here.
        assert torch.equal(got, x.float().reshape(-1, shape[1]).to(dtype)) or torch.allclose(
            got.float(), want.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize(("n", "dtype", "stride"), [
    (27, torch.bfloat16, 32), (32, torch.bfloat16, 32), (1, torch.bfloat16, 8), (27, torch.float32, 28),
    (70, torch.float32, 72), (64, torch.float32, 64),
])
def test_rows_lie_16_bytes_apart(n, dtype, stride):
    """cuBLAS picks its kernels by the leading dimension's alignment: rows 27 wide in bf16 took
    an align1 kernel; padded to 16 bytes, the GEMMs over them can take aligned ones."""
    assert row_stride(n, dtype) == stride
    if n == 1:
        return  # x_BND.transpose(1, 2) with N = 1 is contiguous: no rows to copy
    rows = transposed_rows(torch.randn(2, n, 3).transpose(1, 2), dtype)
    assert rows.stride() == (stride, 1) and rows.data_ptr() % 16 == 0


def test_a_linear_over_the_padded_rows_is_the_one_over_contiguous_rows():
    """What fp8_linear's high-precision GEMMs do with the rows: the padding is never read."""
    x = torch.randn(4, 27, 40).transpose(1, 2)
    w = torch.randn(16, 27, requires_grad=True)
    rows = transposed_rows(x, torch.float32)
    assert not rows.is_contiguous()
    y = rows @ w.t()
    ref_rows = x.reshape(-1, 27).contiguous()
    assert torch.equal(y, ref_rows @ w.t())
    g = torch.randn_like(y)
    (gw,) = torch.autograd.grad(y, w, g)
    assert torch.allclose(gw, g.t() @ ref_rows, rtol=1e-6, atol=1e-5)


def test_the_gradient_is_the_rows_gradient_viewed_back():
    x_BND = torch.randn(2, 5, 8, requires_grad=True)
    g = torch.randn(16, 5)
    transposed_rows(x_BND.transpose(1, 2), torch.float32).backward(g)
    ref = x_BND.detach().clone().requires_grad_()
    ref.transpose(1, 2).reshape(-1, 5).backward(g)
    assert torch.equal(x_BND.grad, ref.grad)


def test_opcheck():
    x = torch.randn(3, 27, 40).transpose(1, 2)
    torch.library.opcheck(torch.ops.loka.transposed_rows.default, (x, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_other_layouts_are_refused():
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(4, 3, 2).permute(2, 1, 0), torch.float32)


@pytest.mark.parametrize("plan_name", ["high", "tensorwise", "rowwise", "fp8_grad_input_only"])
def test_fp8_linear_over_the_padded_rows_matches_contiguous_rows(plan_name):
    """fp8_linear takes the padded rows as they are (forward and gradients the same as over a
    contiguous copy), for every kind of plan Wukong's ``xt_proj`` runs: K = 27 pads its FP8
    GEMMs, and its high-precision grad-weight reads the rows."""
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
    x_BND = torch.randn(4, 27, 40, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 27, generator=torch.Generator().manual_seed(1))
    b = torch.randn(16, generator=torch.Generator().manual_seed(2))
    g = torch.randn(160, 16, generator=torch.Generator().manual_seed(3))

    def run(padded: bool):
        xb, wl, bl = (t.clone().requires_grad_() for t in (x_BND, w, b))
        x = xb.transpose(1, 2)
        rows = transposed_rows(x, torch.float32) if padded else x.reshape(-1, 27)
        assert rows.is_contiguous() != padded
        y = fp8_linear(rows, wl, bl, plan)
        y.backward(g)
        return y.detach(), xb.grad, wl.grad, bl.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
