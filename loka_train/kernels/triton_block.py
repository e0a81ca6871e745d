"""Triton kernels for the rest of a LayerNorm -> Linear -> activation block's backward.

1. :func:`transposed_quant` (op ``loka::transposed_quant``): ``x`` (R, C) -> its transpose
   (C, R) in FP8, in one read of ``x`` and one write, with either one tensor-wise scale or one
   scale per column of ``x`` (= per row of the transpose: row-wise scaling of ``x^T``), and
   optionally the column sums of ``x`` in fp32 (a bias gradient) from the same read. This is
   what the GEMMs that contract over a tensor's first dim need: the grad-input GEMM takes
   ``W^T`` and the grad-weight GEMM ``dZ^T`` and ``H^T``, K-major as Hopper's FP8 wgmma wants.
   For the tensor-wise grad-weight operand ``H^T`` it can also recompute ``H = LayerNorm(x)``
   from ``x`` and the forward's statistics, so the forward never writes ``H``.
   On an H100 at 8192x1024 / 8192x4096 bf16: a transposed copy then the row-wise kernel
   74.5 / 292.5 us; this kernel 27.2 / 85.1 us per column, 14.0 / 41.9 us tensor-wise
   (``python bench/gemm.py --parts b``, bench/results/h100_2026-11-23c/gemm_b).
2. :func:`layernorm_backward` (op ``loka::layernorm_backward``): LayerNorm's input gradient
   and its weight/bias gradients in one pass over ``dH`` and ``x`` (per-program partial sums,
   reduced by a second small kernel): 35.9 / 93.7 us against
   ``aten.native_layer_norm_backward``'s 71.2 / 174.7 us (same benchmark), which reduces the
   weight/bias gradients in a kernel of their own.

Both follow the reference numerics exactly where the reference is defined by a formula (the
quantizer: :func:`formats.quantize` on the transpose, bit for bit on CPU; on a GPU the fp32
division may put at most ~0.1 % of codes one step off, as in the row-wise kernel) and up to
fp32 summation order where it is a reduction (column sums, LayerNorm's row and column sums).
On CPU they run only under ``TRITON_INTERPRET=1``; otherwise they raise (no silent fallback).

Shape legend: ``R`` rows, ``C`` columns of the input; ``M`` rows, ``K`` normalized features.

Example:
    >>> x_RC = torch.randn(64, 32)
    >>> q_CR, scale_C1, colsum_C = transposed_quant(x_RC, fmt=Fp8Format.E4M3, per_column=True)
    >>> ref = quantize(x_RC.t(), Fp8Format.E4M3, Scaling.ROWWISE)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.kernels.triton_kernels import (
    _cdiv,
    _check_runnable,
    _next_pow2,
    _round_rne,
    _sw_round_args,
    _triton_fmt,
)

__all__ = [
    "transposed_quant",
    "transposed_quant_reference",
    "layernorm_backward",
    "layernorm_backward_reference",
]

_TILE = 64  # rows x columns of one transposed_quant program (measured: 64-128 all ~equal)
# Rows per program of the column-amax kernel: its partial maxima (one row per program row)
# are few enough for every quantizing program to reduce the ones of its columns itself.
_AMAX_ROWS = 256
# Up to this many partial rows (R <= 4096: weights) the quantizing programs reduce them
# themselves, which saves a launch; beyond, one reduction kernel runs first.
_PARTS_IN_KERNEL = 16


# --------------------------------------------------------------------------------------------
# (1) transposed quantization
# --------------------------------------------------------------------------------------------


@triton.jit
def _reduce_parts_kernel(
    part_ptr, out0_ptr, out1_ptr, P, C,
    MAX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, OUT_MANT: tl.constexpr,
):
    """out_j[c] = sum (or max, of values >= 0) over p of part[j, p, c] in fp32, fixed order,
    written in out's dtype."""
    pc = tl.program_id(0)
    j = tl.program_id(1)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        mask = (ps[:, None] < P) & (cols[None, :] < C)
        part = tl.load(part_ptr + (j * P + ps[:, None]).to(tl.int64) * C + cols[None, :], mask=mask, other=0.0)
        if MAX:
            acc = tl.maximum(acc, tl.max(part, axis=0))
        else:
            acc += tl.sum(part, axis=0)
    if OUT_MANT > 0:
        acc = _round_rne(acc, OUT_MANT, 0.0, 0.0)
    if j == 0:
        tl.store(out0_ptr + cols, acc.to(out0_ptr.dtype.element_ty), mask=cols < C)
    else:
        tl.store(out1_ptr + cols, acc.to(out1_ptr.dtype.element_ty), mask=cols < C)


def _sum_parts(part_JPC: Tensor, dtype: torch.dtype, *, maximum: bool = False) -> list[Tensor]:
    """``list(part.sum(1).to(dtype))`` (or ``amax(1)`` of non-negative parts; J <= 2) in one
    launch, as separate tensors (torch: a slow column reduction plus a cast per output)."""
    j, p, c = part_JPC.shape
    assert j in (1, 2)
    outs = [torch.empty((c,), device=part_JPC.device, dtype=dtype) for _ in range(j)]
    _reduce_parts_kernel[(_cdiv(c, 32), j)](
        part_JPC, outs[0], outs[-1], p, c, MAX=maximum, BLOCK_P=64, BLOCK_C=32,
        OUT_MANT=_sw_round_args(dtype)["MANT"], num_warps=4,
    )
    return outs


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr):
    """formats._amax_to_scale: 0 -> 1, non-finite -> NaN, else max(amax / max, fp32 tiny)."""
    scale = tl.maximum(amax / FP8_MAX, 1.1754943508222875e-38)
    scale = tl.where(amax == 0.0, 1.0, scale)
    return tl.where((amax != amax) | (amax == float("inf")), float("nan"), scale)


@triton.jit
def _col_amax_kernel(
    x_ptr, part_ptr, R, C, stride_xr,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """part[p, c] = max |x[r, c]| over this program's ROWS rows r; inf if one is NaN (NaN and
    inf amaxes both give a NaN scale; inf survives the max-reduction, NaN would not)."""
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    end = tl.minimum(pr * ROWS + ROWS, R)
    for r0 in range(pr * ROWS, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < end) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
        a = tl.abs(x.to(tl.float32))
        a = tl.where(a != a, float("inf"), a)
        amax = tl.maximum(amax, tl.max(a, axis=0))
    tl.store(part_ptr + pr * C + cols, amax, mask=cols < C)


@triton.jit
def _transposed_quant_kernel(
    x_ptr,
    amax_ptr,
    q_ptr,
    scale_ptr,
    colsum_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    R,
    C,
    NUM_PARTS,
    stride_xr,
    stride_qc,
    FP8_MAX: tl.constexpr,
    PER_COLUMN: tl.constexpr,
    COLSUM: tl.constexpr,
    HAS_LN: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HP_MANT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    Q_MANT: tl.constexpr,
    Q_SUB_MAGIC: tl.constexpr,
    Q_MIN_NORMAL: tl.constexpr,
):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows[:, None] < R) & cmask[None, :]
    x_raw = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    if HAS_LN:
        # LayerNorm's output recomputed from its input and statistics with the forward kernel's
        # operations (triton_kernels._rowwise_quant_kernel), rounded to the input dtype as it
        # rounds it: the forward need not write it out.
        mean = tl.load(mean_ptr + rows, mask=rows < R, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
        x = tl.where(mask, x - mean[:, None], 0.0) * rstd[:, None]
        if HAS_W:
            x = x * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            x = x + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HP_MANT > 0:
            x = _round_rne(x, HP_MANT, 0.0, 0.0)
        x = tl.where(mask, x.to(x_raw.dtype).to(tl.float32), 0.0)
    if PER_COLUMN:
        # amax_ptr holds the column-amax kernel's partial maxima (NUM_PARTS rows of C).
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for p0 in range(0, NUM_PARTS, 16):  # NUM_PARTS <= _PARTS_IN_KERNEL (16: one pass)
            ps = p0 + tl.arange(0, 16)
            part = tl.load(
                amax_ptr + ps[:, None] * C + cols[None, :],
                mask=(ps[:, None] < NUM_PARTS) & cmask[None, :], other=0.0,
            )
            amax = tl.maximum(amax, tl.max(part, axis=0))
        scale = _scale_of(amax, FP8_MAX)
        if pr == 0:
            tl.store(scale_ptr + cols, scale, mask=cmask)
        q = x / scale[None, :]
    else:
        scale = _scale_of(tl.load(amax_ptr), FP8_MAX)
        if (pr == 0) & (pc == 0):
            tl.store(scale_ptr, scale)
        q = x / scale
    # A no-op for finite groups (|x / scale| <= max up to one rounding, which the cast rounds
    # to max anyway); it keeps the interpreter's software rounding in range.
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if Q_MANT > 0:
        q = _round_rne(q, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL)
    # Stored transposed: the compiler routes the tile through shared memory so that both the
    # load (along C) and the store (along R) are coalesced.
    tl.store(
        q_ptr + cols[None, :].to(tl.int64) * stride_qc + rows[:, None],
        q.to(q_ptr.dtype.element_ty),
        mask=mask,
    )
    if COLSUM:
        tl.store(colsum_ptr + pr * C + cols, tl.sum(x, axis=0), mask=cmask)


def _transposed_quant_impl(
    x: Tensor,
    amax: Tensor | None,
    fmt: str,
    per_column: bool,
    return_colsum: bool,
    ln_mean: Tensor | None,
    ln_rstd: Tensor | None,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    fmt_ = _triton_fmt(fmt)
    if x.ndim != 2:
        raise ValueError(f"transposed_quant expects a 2-D input, got shape {tuple(x.shape)}")
    if amax is not None and per_column:
        raise ValueError("transposed_quant: a given amax is tensor-wise; per_column computes its own")
    layernorm = ln_mean is not None
    if (ln_rstd is not None) != layernorm or (not layernorm and (ln_weight is not None or ln_bias is not None)):
        raise ValueError("transposed_quant: the LayerNorm producer needs ln_mean and ln_rstd (weight/bias optional)")
    if layernorm and (amax is None or per_column or return_colsum):
        raise ValueError(
            "transposed_quant: the LayerNorm producer takes a tensor-wise amax from the forward "
            "kernel (return_amax=True) and no per_column / return_colsum"
        )
    if layernorm and (ln_mean.numel() != x.shape[0] or ln_rstd.numel() != x.shape[0]):  # type: ignore[union-attr]
        raise ValueError(f"transposed_quant: ln_mean/ln_rstd need {x.shape[0]} values")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is not None and tuple(t.shape) != (x.shape[1],):
            raise ValueError(f"transposed_quant: {name} {tuple(t.shape)} != ({x.shape[1]},)")
    _check_runnable(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if layernorm:
        # The kernel reads flat fp32 statistics and contiguous affine parameters.
        ln_mean = ln_mean.reshape(-1).float().contiguous()  # type: ignore[union-attr]
        ln_rstd = ln_rstd.reshape(-1).float().contiguous()  # type: ignore[union-attr]
        ln_weight = None if ln_weight is None else ln_weight.contiguous()
        ln_bias = None if ln_bias is None else ln_bias.contiguous()
    r, c = x.shape
    q = torch.empty((c, r), device=x.device, dtype=fmt_.dtype)
    scale = torch.empty((c, 1) if per_column else (), device=x.device, dtype=torch.float32)
    num_row_blocks = _cdiv(r, _TILE)
    colsum = torch.zeros((c,) if return_colsum else (0,), device=x.device, dtype=torch.float32)
    if r == 0 or c == 0:
        scale.fill_(1.0)
        return q, scale, colsum
    grid = (num_row_blocks, _cdiv(c, _TILE))
    qr = _sw_round_args(q.dtype)
    rounding = dict(Q_MANT=qr["MANT"], Q_SUB_MAGIC=qr["SUB_MAGIC"], Q_MIN_NORMAL=qr["MIN_NORMAL"])
    num_parts = 0
    if per_column:
        num_parts = _cdiv(r, _AMAX_ROWS)
        amax_ = torch.empty((num_parts, c), device=x.device, dtype=torch.float32)
        _col_amax_kernel[(num_parts, _cdiv(c, _TILE))](
            x, amax_, r, c, x.stride(0), ROWS=_AMAX_ROWS, BLOCK_R=_TILE, BLOCK_C=_TILE
        )
        if num_parts > _PARTS_IN_KERNEL:
            # Reduced once here: each quantizing program re-reducing them would read
            # num_parts * C floats per row block, growing with R^2.
            amax_ = _sum_parts(amax_[None], torch.float32, maximum=True)[0][None]
            num_parts = 1
    elif amax is None:
        amax_ = torch.linalg.vector_norm(x, ord=float("inf")).float()
    else:
        if amax.numel() != 1:
            raise ValueError(f"transposed_quant: amax must have one element, got {tuple(amax.shape)}")
        amax_ = amax.float().reshape(())
    col_part = (
        torch.empty((num_row_blocks, c), device=x.device, dtype=torch.float32)
        if return_colsum else scale
    )
    _transposed_quant_kernel[grid](
        x, amax_, q, scale, col_part,
        ln_mean if ln_mean is not None else scale,
        ln_rstd if ln_rstd is not None else scale,
        ln_weight if ln_weight is not None else scale,
        ln_bias if ln_bias is not None else scale,
        r, c, num_parts, x.stride(0), q.stride(0),
        FP8_MAX=fmt_.max, PER_COLUMN=per_column, COLSUM=return_colsum,
        HAS_LN=layernorm, HAS_W=ln_weight is not None, HAS_B=ln_bias is not None,
        HP_MANT=_sw_round_args(x.dtype)["MANT"],
        BLOCK_R=_TILE, BLOCK_C=_TILE, **rounding, num_warps=4,
    )
    if return_colsum:
        colsum = _sum_parts(col_part[None], torch.float32)[0]  # fixed order, unlike atomics
    return q, scale, colsum


@torch.library.custom_op("loka::transposed_quant", mutates_args=())
def _transposed_quant_op(
    x: Tensor,
    amax: Tensor | None,
    fmt: str,
    per_column: bool,
    return_colsum: bool,
    ln_mean: Tensor | None,
    ln_rstd: Tensor | None,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    return _transposed_quant_impl(
        x, amax, fmt, per_column, return_colsum, ln_mean, ln_rstd, ln_weight, ln_bias
    )


@_transposed_quant_op.register_fake
def _transposed_quant_fake(x, amax, fmt, per_column, return_colsum, ln_mean, ln_rstd, ln_weight, ln_bias):
    r, c = x.shape
    q = x.new_empty((c, r), dtype=Fp8Format(fmt).dtype)
    scale = x.new_empty((c, 1) if per_column else (), dtype=torch.float32)
    return q, scale, x.new_empty((c,) if return_colsum else (0,), dtype=torch.float32)


def transposed_quant(
    x_RC: Tensor,
    *,
    fmt: Fp8Format = Fp8Format.E4M3,
    amax: Tensor | None = None,
    per_column: bool = False,
    return_colsum: bool = False,
    ln_mean: Tensor | None = None,
    ln_rstd: Tensor | None = None,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``x^T`` quantized to FP8 without a transposed copy (op ``loka::transposed_quant``).

    Equal to ``formats.quantize(x.t(), fmt, TENSORWISE)`` (``per_column`` False) or
    ``formats.quantize(x.t(), fmt, ROWWISE)`` (``per_column`` True: one scale per column of
    ``x``), scales bit for bit, codes too on CPU (see the module doc for GPUs), with the
    payload ``x^T`` contiguous.

    Args:
        x_RC: 2-D input, rows contiguous.
        fmt: e4m3 or e5m2.
        amax: tensor-wise only: ``max |x|`` when the caller already has it (one element, e.g.
            the amax :func:`triton_kernels.fused_rowwise_quant` returns with
            ``return_amax``); else it is computed here.
        per_column: one scale per column of ``x`` instead of one for the tensor.
        return_colsum: also return the fp32 column sums of ``x`` (from the same read).
        ln_mean, ln_rstd, ln_weight, ln_bias: quantize ``LayerNorm(x)`` instead, recomputed
            from these per-row statistics (as :func:`triton_kernels.fused_rowwise_quant`
            wrote them) and the optional affine parameters, rounded to ``x.dtype`` as that
            kernel rounds it: the forward need not write the LayerNorm output. Tensor-wise
            with a given ``amax`` only.

    Returns:
        ``(q_CR, scale, colsum_C)``: ``scale`` is 0-dim (tensor-wise) or ``(C, 1)``;
        ``colsum`` is empty (shape (0,)) unless ``return_colsum``.
    """
    args = (x_RC, amax, Fp8Format(fmt).value, per_column, return_colsum,
            ln_mean, ln_rstd, ln_weight, ln_bias)
    if opaque.tracing():
        return torch.ops.loka.transposed_quant(*args)
    return _transposed_quant_impl(*args)


def transposed_quant_reference(
    x_RC: Tensor,
    *,
    fmt: Fp8Format = Fp8Format.E4M3,
    amax: Tensor | None = None,
    per_column: bool = False,
    return_colsum: bool = False,
    ln_mean: Tensor | None = None,
    ln_rstd: Tensor | None = None,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-PyTorch reference of :func:`transposed_quant` (``amax``, when given, must be the
    amax of what is quantized: the reference computes it)."""
    del amax
    if ln_mean is not None:
        assert ln_rstd is not None
        h = (x_RC.float() - ln_mean.reshape(-1, 1).float()) * ln_rstd.reshape(-1, 1).float()
        if ln_weight is not None:
            h = h * ln_weight.float()
        if ln_bias is not None:
            h = h + ln_bias.float()
        x_RC = h.to(x_RC.dtype)
    qt = quantize(x_RC.t(), fmt, Scaling.ROWWISE if per_column else Scaling.TENSORWISE, axis=-1)
    colsum = x_RC.float().sum(0) if return_colsum else x_RC.new_empty((0,), dtype=torch.float32)
    return qt.data.contiguous(), qt.scale, colsum


# --------------------------------------------------------------------------------------------
# (2) LayerNorm backward
# --------------------------------------------------------------------------------------------


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


@functools.cache
def _num_programs_cap(device: torch.device) -> int:
    if device.type == "cuda":
        # A few programs per SM: enough to hide latency, few partial rows to reduce after.
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one by one


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
