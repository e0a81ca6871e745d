"""The rows of a batch of transposed matrices, in one Triton pass (op ``loka::transposed_rows``).

A linear layer over ``x_BDN = x_BND.transpose(1, 2)`` (Wukong's projections of ``X^T``) runs its
GEMMs on the rows ``(B * D, N)``, which no view of ``x_BND`` gives: they must be copied. Traced
as ``x.to(dtype).reshape(-1, N)``, inductor wrote that copy element by element with strided
reads (1.39 ms a step for Wukong's first layer, 32768 x 128 x 27 fp32 to bf16, on an H100,
against about 0.25 ms for the bytes it moves; bench/results/fold_relu_h100-h200_2026-11-26/NOTES.md). Here each program loads a ``(BLOCK_N, BLOCK_D)``
tile of one ``x_BND[b]`` along ``D`` (contiguous) and stores it transposed into the rows, where
the ``(D, N)`` block of one batch is contiguous: both sides coalesced.

The op's gradient is the rows' gradient viewed back as ``(B, D, N)`` (a view: no copy).

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
def _transposed_rows_kernel(x_ptr, out_ptr, D, N, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (n[:, None] < N) & (d[None, :] < D)
    base = b * N * D  # x_BND[b] and the output's (D, N) block of batch b start at the same offset
    tile = tl.load(x_ptr + base + n[:, None] * D + d[None, :], mask=mask)  # (BLOCK_N, BLOCK_D)
    tl.store(out_ptr + base + d[None, :] * N + n[:, None], tile.to(out_ptr.dtype.element_ty), mask=mask)


def _transposed_rows_impl(x: Tensor, dtype: torch.dtype) -> Tensor:
    if not is_batch_transposed(x):
        raise ValueError(
            f"transposed_rows reads x_BND.transpose(1, 2) of a contiguous x_BND; got shape {tuple(x.shape)} "
            f"with strides {x.stride()}"
        )
    _check_runnable(x)
    b, d, n = x.shape
    out = torch.empty((b * d, n), device=x.device, dtype=dtype)
    if out.numel():
        block_n = min(_MAX_BLOCK_N, triton.next_power_of_2(n))
        grid = (b, triton.cdiv(d, _BLOCK_D), triton.cdiv(n, block_n))
        _transposed_rows_kernel[grid](x, out, d, n, BLOCK_D=_BLOCK_D, BLOCK_N=block_n, num_warps=4)
    return out


@torch.library.custom_op("loka::transposed_rows", mutates_args=())
def _transposed_rows_op(x: Tensor, dtype: torch.dtype) -> Tensor:
    return _transposed_rows_impl(x, dtype)


@_transposed_rows_op.register_fake
def _transposed_rows_fake(x: Tensor, dtype: torch.dtype) -> Tensor:
    b, d, n = x.shape
    return x.new_empty((b * d, n), dtype=dtype)


def _setup_context(ctx: object, inputs: tuple[Tensor, torch.dtype], output: Tensor) -> None:
    x = inputs[0]
    ctx.shape = tuple(x.shape)  # type: ignore[attr-defined]
    ctx.dtype = x.dtype  # type: ignore[attr-defined]


def _backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
    return grad.reshape(ctx.shape).to(ctx.dtype), None  # type: ignore[attr-defined]


_transposed_rows_op.register_autograd(_backward, setup_context=_setup_context)


def transposed_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype).reshape(-1, N)`` of ``x = x_BND.transpose(1, 2)`` (:func:`is_batch_transposed`)
    in one coalesced pass: the ``(B * D, N)`` rows, contiguous, bit for bit that copy.
    Differentiable (the gradient is the rows' viewed back).

    Raises:
        ValueError: for another layout.
        RuntimeError: where Triton cannot run.
    """
    return torch.ops.loka.transposed_rows(x, dtype)
