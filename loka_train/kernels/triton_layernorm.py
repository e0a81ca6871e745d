"""Triton LayerNorm backward, the last kernel of a LayerNorm -> Linear -> activation backward.

:func:`layernorm_backward` (op ``loka::layernorm_backward``): LayerNorm's input gradient and
its weight/bias gradients in one pass over ``dH`` and ``x`` (per-program partial sums, reduced
by a second small kernel): on an H100 at 8192x1024 / 8192x4096 bf16, 35.9 / 93.7 us against
``aten.native_layer_norm_backward``'s 71.2 / 174.7 us (``python bench/gemm.py --parts b``),
which reduces the weight/bias gradients in a kernel of their own.

It follows :func:`layernorm_backward_reference` up to fp32 summation order (LayerNorm's row
and column sums). On CPU it runs only under ``TRITON_INTERPRET=1``; otherwise it raises (no
silent fallback).

Shape legend: ``M`` rows, ``K`` normalized features.

Example:
    >>> x_MK, dy_MK = torch.randn(64, 32), torch.randn(64, 32)
    >>> mean_M, rstd_M = x_MK.mean(1), x_MK.var(1, unbiased=False).add(1e-5).rsqrt()
    >>> dx_MK, dw_K, db_K = layernorm_backward(dy_MK, x_MK, mean_M, rstd_M, torch.ones(32))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.triton_kernels import (
    _cdiv,
    _check_runnable,
    _next_pow2,
    _round_rne,
    _sum_parts,
    _sw_round_args,
    multiprocessors,
)

__all__ = ["layernorm_backward", "layernorm_backward_reference"]


@triton.jit
def _layernorm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    M,
    K,
    rows_per_program,
    stride_dym,
    stride_xm,
    stride_dxm,
    HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HP_MANT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    cmask = cols < K
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.where(cmask, 1.0, 0.0)
    dw_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    first = pid * rows_per_program
    for r0 in range(first, tl.minimum(first + rows_per_program, M), BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        if NEED_DX:
            wdy = dy * w[None, :]
            c1 = tl.sum(xhat * wdy, axis=1) / K
            c2 = tl.sum(wdy, axis=1) / K
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HP_MANT > 0:
                dx = _round_rne(dx, HP_MANT, 0.0, 0.0)
            tl.store(
                dx_ptr + rows64[:, None] * stride_dxm + cols[None, :],
                dx.to(dx_ptr.dtype.element_ty),
                mask=mask,
            )
        if NEED_PARTS:
            dw_acc += tl.sum(dy * xhat, axis=0)
            db_acc += tl.sum(dy, axis=0)
    if NEED_PARTS:
        tl.store(dw_part_ptr + pid * K + cols, dw_acc, mask=cmask)
        tl.store(db_part_ptr + pid * K + cols, db_acc, mask=cmask)


def _num_programs_cap(device: torch.device) -> int:
    # A few programs a multiprocessor: enough to hide latency, few partial rows to reduce after.
    return 2 * multiprocessors(device)


def _layernorm_backward_impl(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if x.ndim != 2 or dy.shape != x.shape:
        raise ValueError(f"layernorm_backward: dy {tuple(dy.shape)} and x {tuple(x.shape)} must be equal 2-D")
    m, k = x.shape
    if mean.numel() != m or rstd.numel() != m:
        raise ValueError(f"layernorm_backward: mean/rstd need {m} values")
    if weight is not None and weight.shape != (k,):
        raise ValueError(f"layernorm_backward: weight {tuple(weight.shape)} != ({k},)")
    _check_runnable(x)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    mean = mean.reshape(m).float()
    rstd = rstd.reshape(m).float()
    pdtype = x.dtype if weight is None else weight.dtype
    dx = torch.empty((m, k) if need_dx else (0,), device=x.device, dtype=x.dtype)
    need_parts = need_dw or need_db
    dw = torch.empty((k,) if need_dw else (0,), device=x.device, dtype=pdtype)
    db = torch.empty((k,) if need_db else (0,), device=x.device, dtype=pdtype)
    if m == 0 or k == 0 or not (need_dx or need_parts):
        dw.zero_()
        db.zero_()
        return dx, dw, db
    block_k = _next_pow2(k)
    block_m = max(1, min(16, 4096 // block_k))
    num_warps = 4 if block_m * block_k <= 4096 else 8
    row_blocks = _cdiv(m, block_m)
    num_programs = min(row_blocks, _num_programs_cap(x.device))
    rows_per_program = _cdiv(row_blocks, num_programs) * block_m
    num_programs = _cdiv(m, rows_per_program)
    parts = torch.empty((2, num_programs, k) if need_parts else (0,), device=x.device, dtype=torch.float32)
    dummy = rstd
    _layernorm_backward_kernel[(num_programs,)](
        dy, x, weight if weight is not None else dummy, mean, rstd,
        dx if need_dx else dummy,
        parts[0] if need_parts else dummy,
        parts[1] if need_parts else dummy,
        m, k, rows_per_program, dy.stride(0), x.stride(0), dx.stride(0) if need_dx else 0,
        HAS_W=weight is not None, NEED_DX=need_dx, NEED_PARTS=need_parts,
        BLOCK_M=block_m, BLOCK_K=block_k,
        HP_MANT=_sw_round_args(x.dtype)["MANT"],
        num_warps=num_warps,
    )
    if need_parts:
        sums = _sum_parts(parts, pdtype)
        if need_dw:
            dw = sums[0]
        if need_db:
            db = sums[1]
    return dx, dw, db


@torch.library.custom_op("loka::layernorm_backward", mutates_args=())
def _layernorm_backward_op(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return _layernorm_backward_impl(dy, x, mean, rstd, weight, need_dx, need_dw, need_db)


@_layernorm_backward_op.register_fake
def _layernorm_backward_fake(dy, x, mean, rstd, weight, need_dx, need_dw, need_db):
    m, k = x.shape
    pdtype = x.dtype if weight is None else weight.dtype
    return (
        x.new_empty((m, k) if need_dx else (0,)),
        x.new_empty((k,) if need_dw else (0,), dtype=pdtype),
        x.new_empty((k,) if need_db else (0,), dtype=pdtype),
    )


def layernorm_backward(
    dy_MK: Tensor,
    x_MK: Tensor,
    mean_M: Tensor,
    rstd_M: Tensor,
    weight_K: Tensor | None,
    *,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm's backward over the last dim, one pass (op ``loka::layernorm_backward``).

    ``dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat))`` per row with
    ``xhat = (x - mean) * rstd``; ``dw = sum_rows(dy * xhat)``, ``db = sum_rows(dy)``, in fp32,
    as ``aten.native_layer_norm_backward`` computes them.

    Args:
        dy_MK: gradient of the LayerNorm output.
        x_MK: LayerNorm input.
        mean_M: per-row mean (fp32, as the forward kernel wrote it).
        rstd_M: per-row ``1 / sqrt(var + eps)``.
        weight_K: the affine weight, or None.
        need_dx / need_dw / need_db: which gradients to compute.

    Returns:
        ``(dx_MK, dw_K, db_K)``, each empty (shape (0,)) when not asked for; ``dw``/``db`` in
        the weight's dtype (``x``'s without a weight).
    """
    args = (dy_MK, x_MK, mean_M, rstd_M, weight_K, need_dx, need_dw, need_db)
    if opaque.tracing():
        return torch.ops.loka.layernorm_backward(*args)
    return _layernorm_backward_impl(*args)


def layernorm_backward_reference(
    dy_MK: Tensor,
    x_MK: Tensor,
    mean_M: Tensor,
    rstd_M: Tensor,
    weight_K: Tensor | None,
    *,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-PyTorch reference of :func:`layernorm_backward` (fp32 math)."""
    k = x_MK.shape[1]
    dy = dy_MK.float()
    xhat = (x_MK.float() - mean_M.reshape(-1, 1).float()) * rstd_M.reshape(-1, 1).float()
    w = torch.ones(k, device=x_MK.device) if weight_K is None else weight_K.float()
    wdy = dy * w
    dx = (wdy - xhat * (wdy * xhat).mean(1, keepdim=True) - wdy.mean(1, keepdim=True))
    dx = (dx * rstd_M.reshape(-1, 1).float()).to(x_MK.dtype)
    pdtype = x_MK.dtype if weight_K is None else weight_K.dtype
    empty = x_MK.new_empty((0,))
    return (
        dx if need_dx else empty,
        (dy * xhat).sum(0).to(pdtype) if need_dw else empty.to(pdtype),
        dy.sum(0).to(pdtype) if need_db else empty.to(pdtype),
    )
