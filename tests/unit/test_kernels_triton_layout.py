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


def test_opcheck():
    x = torch.randn(3, 27, 40).transpose(1, 2)
    torch.library.opcheck(torch.ops.loka.transposed_rows.default, (x, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_other_layouts_are_refused():
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match="transpose"):
        transposed_rows(torch.randn(4, 3, 2).permute(2, 1, 0), torch.float32)
