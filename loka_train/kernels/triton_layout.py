"""The rows of a batch of transposed matrices, in one Triton pass (op ``loka::transposed_rows``).

A linear layer over ``x_BDN = x_BND.transpose(1, 2)`` (Wukong's projections of ``X^T``) runs its
GEMMs on the rows ``(B * D, N)``, which no view of ``x_BND`` gives: they must be copied. Traced
as ``x.to(dtype).reshape(-1, N)``, inductor wrote that copy element by element with strided
reads (1.39 ms a step for Wukong's first layer, 32768 x 128 x 27 fp32 to bf16, on an H100,
against about 0.25 ms for the bytes it moves; bench/results/fold_relu_h100-h200_2026-11-26/NOTES.md). Here each program loads a ``(BLOCK_N, BLOCK_D)``
tile of one ``x_BND[b]`` along ``D`` (contiguous) and stores it transposed into the rows, where
the ``(D, N)`` block of one batch is contiguous: both sides coalesced.

With ``width`` larger than ``N`` the rows are written ``width`` elements wide, the columns past
``N`` zeros: a linear layer then runs its GEMMs over a contraction dimension that cuBLAS's
aligned kernels take (``fp8_linear`` pads its weight to match), where an ``N`` such as Wukong's
27 leaves only its ``align1`` kernels.

The op's gradient is the rows' gradient (its first ``N`` columns) viewed back as ``(B, D, N)``.

Example:
    >>> x_BND = torch.randn(4, 27, 128, device="cuda")
    >>> rows = transposed_rows(x_BND.transpose(1, 2), torch.bfloat16)
    >>> torch.equal(rows, x_BND.transpose(1, 2).to(torch.bfloat16).reshape(-1, 27))
    True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels.triton_kernels import _check_runnable

__all__ = ["is_batch_transposed", "transposed_rows"]

_BLOCK_D = 64
"""Columns of ``x_BND`` (rows of the output) one program moves."""
_MAX_BLOCK_N = 64
"""Rows of ``x_BND`` one program moves at most (all of a batch's where ``N`` is at most this)."""


def is_batch_transposed(x: Tensor) -> bool:
    """Whether ``x`` is a 3-D ``x_BND.transpose(1, 2)`` of a contiguous ``x_BND`` (and not
    contiguous itself): the layout :func:`transposed_rows` reads."""
    return x.ndim == 3 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


@triton.jit
def _transposed_rows_kernel(x_ptr, out_ptr, D, N, W, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_x = (n[:, None] < N) & (d[None, :] < D)
    tile = tl.load(x_ptr + b * N * D + n[:, None] * D + d[None, :], mask=in_x, other=0.0)  # (BLOCK_N, BLOCK_D)
    # Batch b's D rows of the output, W wide: columns N..W-1 get the tile's zeros.
    out = (n[:, None] < W) & (d[None, :] < D)
    tl.store(out_ptr + b * D * W + d[None, :] * W + n[:, None], tile.to(out_ptr.dtype.element_ty), mask=out)


def _transposed_rows_impl(x: Tensor, dtype: torch.dtype, width: int = 0) -> Tensor:
    if not is_batch_transposed(x):
        raise ValueError(
            f"transposed_rows reads x_BND.transpose(1, 2) of a contiguous x_BND; got shape {tuple(x.shape)} "
            f"with strides {x.stride()}"
        )
    _check_runnable(x)
    b, d, n = x.shape
    w = _width(n, width)
    out = torch.empty((b * d, w), device=x.device, dtype=dtype)
    if out.numel():
        block_n = min(_MAX_BLOCK_N, triton.next_power_of_2(w))
        grid = (b, triton.cdiv(d, _BLOCK_D), triton.cdiv(w, block_n))
        _transposed_rows_kernel[grid](x, out, d, n, w, BLOCK_D=_BLOCK_D, BLOCK_N=block_n, num_warps=4)
    return out


def _width(n: int, width: int) -> int:
    if width and width < n:
        raise ValueError(f"transposed_rows: width {width} is narrower than the rows ({n})")
    return max(n, width)


@torch.library.custom_op("loka::transposed_rows", mutates_args=())
def _transposed_rows_op(x: Tensor, dtype: torch.dtype, width: int = 0) -> Tensor:
    return _transposed_rows_impl(x, dtype, width)


@_transposed_rows_op.register_fake
def _transposed_rows_fake(x: Tensor, dtype: torch.dtype, width: int = 0) -> Tensor:
    b, d, n = x.shape
    return x.new_empty((b * d, _width(n, width)), dtype=dtype)


def _setup_context(ctx: object, inputs: tuple[Tensor, torch.dtype, int], output: Tensor) -> None:
    x = inputs[0]
    ctx.shape = tuple(x.shape)  # type: ignore[attr-defined]
    ctx.dtype = x.dtype  # type: ignore[attr-defined]


def _backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:
    n = ctx.shape[-1]  # type: ignore[attr-defined]
    return grad[:, :n].reshape(ctx.shape).to(ctx.dtype), None, None  # type: ignore[attr-defined]


_transposed_rows_op.register_autograd(_backward, setup_context=_setup_context)


def transposed_rows(x: Tensor, dtype: torch.dtype, width: int = 0) -> Tensor:
    """``x.to(dtype).reshape(-1, N)`` of ``x = x_BND.transpose(1, 2)`` (:func:`is_batch_transposed`)
    in one coalesced pass: the ``(B * D, N)`` rows, contiguous, bit for bit that copy; with
    ``width > N``, ``(B * D, width)`` rows whose columns past ``N`` are zeros (that copy
    zero-padded). Differentiable (the gradient is the rows' first ``N`` columns viewed back).

    Raises:
        ValueError: for another layout, or a ``width`` narrower than ``N``.
        RuntimeError: where Triton cannot run.
    """
    return torch.ops.loka.transposed_rows(x, dtype, width)
