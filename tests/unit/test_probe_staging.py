"""The input buffers every Probe CUDA graph shares (`probe.measurement._Staging`): one per operand
position, views of the requested shapes and dtypes at the buffer's start, grown by doubling
(and reported, so that the graphs reading the old buffers are dropped)."""

from __future__ import annotations

import torch

from loka_train.probe.measurement import _Staging


def test_views_share_the_buffers_and_growth_is_reported() -> None:
    staging = _Staging()
    first, grown = staging.views((torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 8), torch.zeros(())))
    assert grown and [v.dtype for v in first] == [torch.bfloat16, torch.float32, torch.float32]
    assert [tuple(v.shape) for v in first] == [(4, 8), (16, 8), ()] and all(v.is_contiguous() for v in first)
    size = staging.nbytes
    # Smaller (or equal) operands: views of the same memory, nothing grows.
    second, grown = staging.views((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8, 8), torch.zeros(())))
    assert not grown and staging.nbytes == size
    for a, b in zip(first, second):
        assert a.data_ptr() == b.data_ptr()
    second[1].fill_(3.0)  # writes land in the shared buffer
    assert float(first[1].reshape(-1)[:64].sum()) == 3.0 * 64
    # A larger operand: that position's buffer is reallocated (at least doubled).
    third, grown = staging.views((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(32, 8), torch.zeros(())))
    assert grown and third[1].data_ptr() != first[1].data_ptr() and third[0].data_ptr() == first[0].data_ptr()
    assert staging.nbytes == size - 16 * 8 * 4 + 2 * 16 * 8 * 4
