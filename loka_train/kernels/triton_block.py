"""Triton transposed FP8 quantization, for the GEMMs that contract over a tensor's first dim.

:func:`transposed_quant` (op ``loka::transposed_quant``): ``x`` (R, C) -> its transpose
   (C, R) in FP8, in one read of ``x`` and one write, with either one tensor-wise scale or one
   scale per column of ``x`` (= per row of the transpose: row-wise scaling of ``x^T``), and
   optionally the column sums of ``x`` in fp32 (a bias gradient) from the same read. This is
   what the GEMMs that contract over a tensor's first dim need: the grad-input GEMM takes
   ``W^T`` and the grad-weight GEMM ``dZ^T`` and ``H^T``, K-major as Hopper's FP8 wgmma wants.
   For the tensor-wise grad-weight operand ``H^T`` it can also recompute ``H = LayerNorm(x)``
   from ``x`` and the forward's statistics, so the forward never writes ``H``.
   On an H100 at 8192x1024 / 8192x4096 bf16: a transposed copy then the row-wise kernel
   74.5 / 292.5 us; this kernel 27.2 / 85.1 us per column, 14.0 / 41.9 us tensor-wise
   (``python -m bench.gemm --parts b``, bench/results/gemm_block_h100_2026-11-23c/gemm_b).

It follows :func:`formats.quantize` on the transpose exactly (bit for bit on CPU; on a GPU the
fp32 division may put at most ~0.1 % of codes one step off, as in the row-wise kernel), and
the column sums up to fp32 summation order. On CPU it runs only under ``TRITON_INTERPRET=1``;
otherwise it raises (no silent fallback). LayerNorm's backward is ``triton_layernorm``.

Shape legend: ``R`` rows, ``C`` columns of the input.

Example:
    >>> x_RC = torch.randn(64, 32)
    >>> q_CR, scale_C1, colsum_C = transposed_quant(x_RC, fmt=Fp8Format.E4M3, per_column=True)
    >>> ref = quantize(x_RC.t(), Fp8Format.E4M3, Scaling.ROWWISE)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.kernels.triton_kernels import (
    _cdiv,
    _check_runnable,
    _round_rne,
    _sum_parts,
    _sw_round_args,
    _triton_fmt,
)

__all__ = ["transposed_quant", "transposed_quant_reference"]

_TILE = 64  # rows x columns of one transposed_quant program (measured: 64-128 all ~equal)
# Rows per program of the column-amax kernel: its partial maxima (one row per program row)
# are few enough for every quantizing program to reduce the ones of its columns itself.
_AMAX_ROWS = 256
# Up to this many partial rows (R <= 4096: weights) the quantizing programs reduce them
# themselves, which saves a launch; beyond, one reduction kernel runs first.
_PARTS_IN_KERNEL = 16


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
