"""Per-row peak magnitude and non-finite count of a 2-D tensor in one read (op ``loka::row_stats``).

The Probe reads every full operand of a sampled GEMM twice over: it counts the operand's
non-finite values (none may slip past its row subsample) and finds the row holding its largest
finite magnitude (so the subsample keeps the tensor-wise amax). In PyTorch that is a
multiplication and a ``count_nonzero`` (three passes, two full-size writes) plus an fp32 copy, an
``abs`` and a reduction for the row norms: at 32768 x 4096 bf16 on an H100, about 2 ms per
operand. This kernel reads the operand once and writes two vectors of ``M``.

``row_stats(x_MK) -> (peak_M, nonfinite_M)``: ``peak_M[m]`` is ``max |x[m, :]|`` in fp32 when
row ``m`` is finite and 0 when it holds an inf or a NaN (such a row is never the peak row);
``nonfinite_M[m]`` counts its infs and NaNs (int32). :func:`row_stats_reference` is the same in
PyTorch (the CPU path and the test oracle).

Shape legend: ``M`` rows, ``K`` columns.

Example:
    >>> peak_M, bad_M = row_stats(torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16))
    >>> int(bad_M.sum()), int(peak_M.argmax())
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.triton_kernels import _cdiv, _check_runnable

__all__ = ["SUPPORTED_DTYPES", "row_stats", "row_stats_reference"]

_BLOCK_M = 4
"""Rows per program, at least (narrow rows take more: :func:`_blocks`)."""
_BLOCK_K = 1024
"""Columns per iteration of a program's loop over its rows, at most."""
_TILE = _BLOCK_M * _BLOCK_K
"""Elements a program reads per iteration."""


def _blocks(k: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_K)`` for rows of ``k`` columns: a tile of about ``_TILE`` elements no
    wider than the row (rounded up to a power of two). Wukong's projections have rows of 27-64
    over 4 million rows: a 4 x 1024 tile would leave 97% of each program's lanes masked and
    launch a program per 4 rows."""
    block_k = min(_BLOCK_K, triton.next_power_of_2(max(k, 1)))
    return max(_BLOCK_M, _TILE // block_k), block_k


@triton.jit
def _row_stats_kernel(x_ptr, peak_ptr, bad_ptr, M, K, stride_m, stride_k,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    peak = tl.zeros((BLOCK_M,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_m + cols.to(tl.int64)[None, :] * stride_k
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        nonfinite = (x != x) | (ax == float("inf"))
        bad += tl.sum(nonfinite.to(tl.int32), axis=1)
        peak = tl.maximum(peak, tl.max(tl.where(nonfinite, 0.0, ax), axis=1))
    tl.store(peak_ptr + rows, tl.where(bad > 0, 0.0, peak), mask=row_ok)
    tl.store(bad_ptr + rows, bad, mask=row_ok)


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes (read as fp32: a wider one could hold values beyond fp32's range)."""


def _row_stats_impl(x: Tensor) -> tuple[Tensor, Tensor]:
    _check_runnable(x)
    if x.dim() != 2:
        raise ValueError(f"row_stats takes a 2-D tensor, got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"row_stats takes fp32, bf16 or fp16, got {x.dtype} (use row_stats_reference)")
    M, K = x.shape
    peak = torch.empty(M, device=x.device, dtype=torch.float32)
    bad = torch.empty(M, device=x.device, dtype=torch.int32)
    if M == 0:
        return peak, bad
    if K == 0:
        return peak.zero_(), bad.zero_()
    block_m, block_k = _blocks(K)
    _row_stats_kernel[(_cdiv(M, block_m),)](
        x, peak, bad, M, K, x.stride(0), x.stride(1), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
    )
    return peak, bad


@torch.library.custom_op("loka::row_stats", mutates_args=())
def _row_stats_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _row_stats_impl(x)


@_row_stats_op.register_fake
def _row_stats_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.int32)


def row_stats(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    """``(peak_M, nonfinite_M)`` of a 2-D float tensor (any strides), in one read.

    Raises:
        ValueError: for a tensor that is not 2-D, or not fp32, bf16 or fp16.
        RuntimeError: where Triton cannot run (use :func:`row_stats_reference`).
    """
    if opaque.tracing():
        return torch.ops.loka.row_stats(x_MK)
    return _row_stats_impl(x_MK)


def row_stats_reference(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`row_stats` in PyTorch: the same two vectors, bit for bit."""
    x = x_MK.detach()
    nonfinite = ~torch.isfinite(x)
    bad = nonfinite.sum(dim=1, dtype=torch.int32)
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], device=x.device, dtype=torch.float32), bad
    peak = torch.where(nonfinite, 0.0, x.abs().float()).amax(dim=1)
    return torch.where(bad > 0, 0.0, peak), bad
