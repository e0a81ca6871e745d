"""The input buffers the Probe's CUDA graphs share (`probe.measurement._Staging`): one per
operand position, views of the requested shapes and dtypes at the buffer's start, a buffer too
small replaced by one at least twice as large while the views of the old one stay valid."""

from __future__ import annotations

import torch

from loka_train.probe.measurement import _Staging


def test_views_share_the_buffers_and_grow_by_doubling() -> None:
    staging = _Staging()
    first = staging.views((torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 8), torch.zeros(())))
    assert [v.dtype for v in first] == [torch.bfloat16, torch.float32, torch.float32]
    assert [tuple(v.shape) for v in first] == [(4, 8), (16, 8), ()] and all(v.is_contiguous() for v in first)
    assert staging.nbytes == 4 * 8 * 2 + 16 * 8 * 4 + 4
    # Smaller (or equal) operands: views of the same memory, nothing grows.
    second = staging.views((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8, 8), torch.zeros(())))
    assert staging.nbytes == 4 * 8 * 2 + 16 * 8 * 4 + 4
    for a, b in zip(first, second):
        assert a.data_ptr() == b.data_ptr()
    second[1].fill_(3.0)  # writes land in the shared buffer
    assert float(first[1].reshape(-1)[:64].sum()) == 3.0 * 64
    # 17 x 8 fp32 = 544 bytes > 512: that position's buffer doubles to 1024 bytes, the others stay.
    third = staging.views((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(17, 8), torch.zeros(())))
    assert third[1].data_ptr() != first[1].data_ptr() and third[0].data_ptr() == first[0].data_ptr()
    assert staging.nbytes == 4 * 8 * 2 + 1024 + 4
    # The old buffer lives on in the views that read it (a graph captured on it keeps working).
    assert float(first[1].reshape(-1)[:64].sum()) == 3.0 * 64
