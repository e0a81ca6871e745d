"""Tensor-wise FP8 quantization in Triton at memory bandwidth (op ``loka::tensorwise_quant``).

The reference (:func:`loka_train.kernels.formats.quantize`) takes an amax reduction, an fp32
division that writes a full fp32 temporary, and a cast that reads it again: about 13 bytes of
traffic per bf16 element. Here three launches move 5: one pass reads ``x`` for per-block
amaxes, one program turns them into the scale, one pass reads ``x`` again and writes the FP8
payload. Results are bit-identical to the reference: the scale is ``amax / fmt.max`` (1 for an
all-zero tensor, NaN when a value is non-finite), the codes ``x / scale`` rounded to nearest
even, the division of ``x`` IEEE-rounded (``_quotient``: on CUDA as multiplies and FMAs, the
division's fast path without its slow one), values saturating at ``fmt.max``.

A tensor-wise payload is what lets a site reuse its forward's ``x`` and ``W`` and its
grad-input's ``dY`` transposed in the backward (``kernels.linear.transposed_reuse``): with this
quantizer a tensor-wise linear layer quantizes two large tensors a step instead of four.
:func:`tensorwise_quant_both` (op ``loka::tensorwise_quant_both``) also writes the payload's
transpose, contiguous, in the cast pass, from the same read (6 bytes of traffic per bf16 element
instead of 5; an fp32 input's transpose is copied from the payload instead, see
``_transposes_in_kernel``): the layout the backward's GEMM takes
(K-major, as Hopper's FP8 GEMMs want), where a transposed view of the payload would have a
backend copy it (``torch._scaled_mm`` makes both operands contiguous) in a pass of its own.

Example:
    >>> q, scale = tensorwise_quant(torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16))
    >>> q, scale, q_t = tensorwise_quant_both(torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16))
    >>> torch.equal(q_t, q.t().contiguous())
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque, static_scales
from loka_train.kernels.formats import Fp8Format, Scaling, as_format, is_row_strided, quantize
from loka_train.kernels.triton_kernels import (
    _cdiv,
    _check_runnable,
    _round_rne,
    _sw_round_args,
    _triton_fmt,
    multiprocessors,
)

__all__ = [
    "relu_bits",
    "tensorwise_quant",
    "tensorwise_quant_both",
    "tensorwise_quant_reference",
    "tensorwise_quant_static",
]

_BLOCK = 8192
"""Elements of one block of the one-layout passes (8 warps, 32 elements a thread)."""
_FINAL_BLOCK = 1024
"""Partial amaxes the finishing program reads per iteration."""
_TILE_R = 32
"""Rows of one tile of the cast that writes both layouts. With ``_TILE_C`` and
``_BOTH_WARPS``: of the configurations ``python -m bench.quant_tiles`` times on an H100, within
3% of the fastest static-scale cast (64 x 128, 4 warps) and of the fastest dynamic one
(64 x 64, 4 warps)."""
_TILE_C = 128
"""Columns of one tile of the cast that writes both layouts."""
_BOTH_WARPS = 4
"""Warps of a program of the cast that writes both layouts (the faster of 4 and 8 for the
static-scale cast in ``python -m bench.quant_tiles``)."""
_PROGRAMS_PER_SM = 2
"""Programs of a cast pass a multiprocessor: the grid is persistent, each program casting every
``num_programs``-th tile (block), so that the static-scale check reduces one amax a program and
the recast (its programs exit at once where the gate is 0) launches few. The grid
``python -m bench.cast_variants`` timed fastest on an H100 (``docs/performance.md``)."""
_STAGES = 3
"""Loads in flight of a cast program's loop over its tiles (``tl.range``'s ``num_stages``)."""

@triton.jit
def _input(x, RELU: tl.constexpr):
    """``x`` (fp32) as the casts read it: through a ReLU with ``RELU``, as ``torch.relu`` gives
    it on CUDA (NaN kept, ``-0.0`` to ``0.0``; the CPU's keeps ``-0.0``, a zero code of the
    other sign that no GEMM result tells apart), so an activation's codes come from its producer."""
    if RELU:
        x = tl.where(x <= 0.0, 0.0, x)
    return x


@triton.jit
def _masked(x, mask_ptr, byte, bit, in_range, MASK: tl.constexpr):
    """``x`` where bit ``bit`` of byte ``byte`` of the mask is set, else 0, with ``MASK`` (a folded
    ReLU's backward on a gradient: :func:`kernels.linear.relu_mask_bits` of the pre-activation)."""
    if MASK:
        b = tl.load(mask_ptr + byte, mask=in_range, other=0).to(tl.int32)
        x = tl.where(((b >> bit.to(tl.int32)) & 1) != 0, x, 0.0)
    return x


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, N, mask_ptr, BLOCK: tl.constexpr, RELU: tl.constexpr,
                         MASK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _input(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32), RELU)
    x = _masked(x, mask_ptr, offs // 8, offs % 8, offs < N, MASK)
    # A block with a non-finite value reports inf (the scale is then NaN).
    tl.store(partial_ptr + pid, _block_amax(x))


@triton.jit
def _amax_partial_rows_kernel(x_ptr, partial_ptr, R, C, stride_r, mask_ptr, BLOCK_R: tl.constexpr,
                              BLOCK_C: tl.constexpr, RELU: tl.constexpr, MASK: tl.constexpr):
    """_amax_partial_kernel over (BLOCK_R, BLOCK_C) tiles of an (R, C) input whose rows lie
    ``stride_r`` elements apart."""
    t = tl.program_id(0)
    tiles_c = tl.cdiv(C, BLOCK_C)
    rows = (t // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (t % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=mask, other=0.0)
    x = _masked(_input(x.to(tl.float32), RELU), mask_ptr, rows[:, None].to(tl.int64) * (C // 8) + cols[None, :] // 8,
                cols[None, :] % 8, mask, MASK)
    tl.store(partial_ptr + t, _tile_amax(x))


@triton.jit
def _reduced_amax(partial_ptr, P, BLOCK: tl.constexpr):
    """The largest of ``P`` partial amaxes (inf where a block had a non-finite value)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, P, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(partial_ptr + offs, mask=offs < P, other=0.0))
    return tl.max(acc, axis=0)


@triton.jit
def _dynamic_scale(amax, inv_max, FP8_MAX: tl.constexpr, RECIPROCAL: tl.constexpr):
    """The reference's tensor-wise scale of a tensor whose amax is ``amax``: 1 for zeros, NaN
    for a non-finite value."""
    # As the reference computes ``amax / fmt.max`` on this device: PyTorch divides by a Python
    # scalar as a product with its fp32 reciprocal on CUDA, as a true division on the CPU.
    if RECIPROCAL:
        scale = amax * inv_max
    else:
        scale = tl.math.div_rn(amax, FP8_MAX)
    scale = tl.maximum(scale, 1.1754943508222875e-38)
    scale = tl.where(amax == 0.0, 1.0, scale)
    return tl.where(amax == float("inf"), float("nan"), scale)


@triton.jit
def _scale_kernel(partial_ptr, scale_ptr, P, inv_max, FP8_MAX: tl.constexpr, RECIPROCAL: tl.constexpr,
                  BLOCK: tl.constexpr):
    tl.store(scale_ptr, _dynamic_scale(_reduced_amax(partial_ptr, P, BLOCK), inv_max, FP8_MAX, RECIPROCAL))


@triton.jit
def _quotient(x, s, FMA_DIV: tl.constexpr):
    """``x / s`` correctly rounded (IEEE), as the reference divides; ``s`` a positive scalar.

    A power-of-two scale (every static scale) multiplies by its exact reciprocal. With
    ``FMA_DIV`` (CUDA) other scales take the division's own fast path as multiplies and FMAs:
    ``y = 1/s`` correctly rounded once a tile, ``q = x*y`` and two residual corrections
    ``q += (x - q*s)*y``, the residual exact by the FMA (Markstein: the second correction
    rounds correctly), for every quotient whose magnitude lies in ``[2**-20, 2**20]`` with ``s``
    in ``[2**-50, 2**50]`` (no residual underflows). Outside it the product alone is taken:
    below, both quotients round to a zero code of x's sign in every FP8 format (half the
    smallest e5m2 subnormal is 2**-17); above, both saturate (``fmt.max`` is at most 57344);
    NaN stays NaN. The IEEE division (``div_rn``) takes a slow path on a zero numerator, which
    doubled the cast of a ReLU'd activation (half zeros); here no element divides. Scales out
    of that range, and the interpreter (whose FMA rounds twice), divide.
    """
    bits = s.to(tl.int32, bitcast=True)
    if (bits & 0x7FFFFF) == 0:  # 2**k (or 0 / inf: the same quotients)
        y = x * tl.math.div_rn(1.0, s)
    elif FMA_DIV:
        if (s >= 8.881784197001252e-16) & (s <= 1125899906842624.0):  # 2**-50, 2**50
            r = tl.math.div_rn(1.0, s)
            q0 = x * r
            q1 = tl.fma(tl.fma(-q0, s, x), r, q0)
            q2 = tl.fma(tl.fma(-q1, s, x), r, q1)
            a0 = tl.abs(q0)
            y = tl.where((a0 < 9.5367431640625e-07) | (a0 > 1048576.0), q0, q2)  # 2**-20, 2**20
        else:
            y = tl.math.div_rn(x, s)
    else:
        y = tl.math.div_rn(x, s)
    return y


@triton.jit
def _codes(x, scale_ptr, FP8_MAX: tl.constexpr, Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr,
           Q_MIN_NORMAL: tl.constexpr, FMA_DIV: tl.constexpr):
    """``x / scale`` (:func:`_quotient`) saturated at ``fmt.max`` and rounded to the format's
    codes, in fp32: what both casts store."""
    y = _quotient(x, tl.load(scale_ptr), FMA_DIV)
    q = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if Q_MANT > 0:
        q = _round_rne(q, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL)
    return q


@triton.jit
def _tile_amax(x):
    """Largest |value| of a 2-D tile, inf where a value is not finite (tl.max drops NaN: a NaN
    enters as inf), in one reduction: the tile's cast waits on each."""
    return tl.max(tl.where(x != x, float("inf"), tl.abs(x)))


@triton.jit
def _block_amax(x):
    """:func:`_tile_amax` of a 1-D block, in two reductions (a count of non-finite values and
    the max): the one-reduction form made the one-layout static cast slower
    (``docs/performance.md``)."""
    ax = tl.abs(x)
    num_bad = tl.sum(((x != x) | (ax == float("inf"))).to(tl.int32))
    return tl.where(num_bad > 0, float("inf"), tl.max(ax))


@triton.jit
def _cast_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    N,
    partial_ptr,
    gate_ptr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    Q_MANT: tl.constexpr,
    Q_SUB_MAGIC: tl.constexpr,
    Q_MIN_NORMAL: tl.constexpr,
    STORE_AMAX: tl.constexpr,
    GATED: tl.constexpr,
    FMA_DIV: tl.constexpr,
    RELU: tl.constexpr,
    STAGES: tl.constexpr,
    mask_ptr,
    MASK: tl.constexpr,
):
    """The cast of ``x`` (through a ReLU with ``RELU``, :func:`_input`; zeroed where the mask's
    bit is clear with ``MASK``, :func:`_masked`) in blocks, each program
    looping over every ``num_programs``-th block (a persistent grid, ``STAGES`` loads in flight);
    ``STORE_AMAX`` also stores each program's amax over its blocks (the static-scale pass reads
    ``x`` once for both); ``GATED`` (the static-scale recast) runs only where ``gate`` holds 1."""
    if GATED:
        if tl.load(gate_ptr) != 0:
            _cast_blocks(x_ptr, scale_ptr, q_ptr, N, partial_ptr, mask_ptr, FP8_MAX, BLOCK, Q_MANT, Q_SUB_MAGIC,
                         Q_MIN_NORMAL, False, FMA_DIV, RELU, STAGES, MASK)
    else:
        _cast_blocks(x_ptr, scale_ptr, q_ptr, N, partial_ptr, mask_ptr, FP8_MAX, BLOCK, Q_MANT, Q_SUB_MAGIC,
                     Q_MIN_NORMAL, STORE_AMAX, FMA_DIV, RELU, STAGES, MASK)


@triton.jit
def _cast_blocks(x_ptr, scale_ptr, q_ptr, N, partial_ptr, mask_ptr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
                 Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
                 STORE_AMAX: tl.constexpr, FMA_DIV: tl.constexpr, RELU: tl.constexpr, STAGES: tl.constexpr,
                 MASK: tl.constexpr):
    amax = tl.zeros((), tl.float32)
    for blk in tl.range(tl.program_id(0), tl.cdiv(N, BLOCK), tl.num_programs(0), num_stages=STAGES):
        offs = (tl.zeros((BLOCK,), tl.int64) + blk) * BLOCK + tl.arange(0, BLOCK)  # int64: N may pass 2**31
        mask = offs < N
        x = _input(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), RELU)
        x = _masked(x, mask_ptr, offs // 8, offs % 8, mask, MASK)
        q = _codes(x, scale_ptr, FP8_MAX, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, FMA_DIV)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        if STORE_AMAX:
            amax = tl.maximum(amax, _block_amax(x))
    if STORE_AMAX:
        tl.store(partial_ptr + tl.program_id(0), amax)


@triton.jit
def _cast_both_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    qt_ptr,
    R,
    C,
    stride_r,
    partial_ptr,
    gate_ptr,
    FP8_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    Q_MANT: tl.constexpr,
    Q_SUB_MAGIC: tl.constexpr,
    Q_MIN_NORMAL: tl.constexpr,
    STORE_AMAX: tl.constexpr,
    GATED: tl.constexpr,
    FMA_DIV: tl.constexpr,
    ROWS_APART: tl.constexpr,
    RELU: tl.constexpr,
    STAGES: tl.constexpr,
    mask_ptr,
    MASK: tl.constexpr,
):
    """_cast_kernel on (BLOCK_R, BLOCK_C) tiles of the (R, C) input (row-major tile order),
    stored as they are into ``q`` and transposed into ``qt`` (C, R); ``STORE_AMAX``, ``GATED``,
    ``FMA_DIV`` and ``STAGES`` as there. The input's rows lie ``stride_r`` elements apart with
    ``ROWS_APART``, else ``C`` (contiguous: one address for the load and the store, which the
    contiguous cast measured faster with)."""
    if GATED:
        if tl.load(gate_ptr) != 0:
            _cast_both_tiles(x_ptr, scale_ptr, q_ptr, qt_ptr, R, C, stride_r, partial_ptr, mask_ptr, FP8_MAX, BLOCK_R,
                             BLOCK_C, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, False, FMA_DIV, ROWS_APART, RELU, STAGES,
                             MASK)
    else:
        _cast_both_tiles(x_ptr, scale_ptr, q_ptr, qt_ptr, R, C, stride_r, partial_ptr, mask_ptr, FP8_MAX, BLOCK_R,
                         BLOCK_C, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, STORE_AMAX, FMA_DIV, ROWS_APART, RELU, STAGES,
                         MASK)


@triton.jit
def _cast_both_tiles(x_ptr, scale_ptr, q_ptr, qt_ptr, R, C, stride_r, partial_ptr, mask_ptr,
                     FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, Q_MANT: tl.constexpr,
                     Q_SUB_MAGIC: tl.constexpr, Q_MIN_NORMAL: tl.constexpr, STORE_AMAX: tl.constexpr,
                     FMA_DIV: tl.constexpr, ROWS_APART: tl.constexpr, RELU: tl.constexpr, STAGES: tl.constexpr,
                     MASK: tl.constexpr):
    tiles_c = tl.cdiv(C, BLOCK_C)
    amax = tl.zeros((), tl.float32)
    for t in tl.range(tl.program_id(0), tl.cdiv(R, BLOCK_R) * tiles_c, tl.num_programs(0), num_stages=STAGES):
        rows = (t // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (t % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        # x's rows may lie apart (a slice of a concatenation's gradient); the payloads are contiguous.
        offs = rows[:, None].to(tl.int64) * C + cols[None, :]
        if ROWS_APART:
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=mask, other=0.0)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        x = _input(x.to(tl.float32), RELU)
        # The mask's bits are contiguous, (R, C / 8), whatever x's row stride.
        x = _masked(x, mask_ptr, rows[:, None].to(tl.int64) * (C // 8) + cols[None, :] // 8, cols[None, :] % 8, mask,
                    MASK)
        q = _codes(x, scale_ptr, FP8_MAX, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, FMA_DIV).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + offs, q, mask=mask)
        # The compiler routes the tile through shared memory: both stores are coalesced.
        tl.store(qt_ptr + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)
        if STORE_AMAX:
            amax = tl.maximum(amax, _tile_amax(x))
    if STORE_AMAX:
        tl.store(partial_ptr + tl.program_id(0), amax)


@triton.jit
def _static_check_kernel(partial_ptr, P, slot_ptr, scale_ptr, gate_ptr, inv_max, FP8_MAX: tl.constexpr,
                         HEADROOM: tl.constexpr, RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):
    """Whether the slot's static scale fits this tensor (module docstring): writes the scale
    the payload takes and the gate of the recast; counts a fallback and re-seeds the slot."""
    amax = _reduced_amax(partial_ptr, P, BLOCK)
    static = tl.load(slot_ptr)
    count = tl.load(slot_ptr + 1)
    # The format's headroom (static_scales.headroom, a power of two: exact products).
    margin = tl.load(slot_ptr + 2) * HEADROOM
    spread = tl.load(slot_ptr + 3) * (HEADROOM * HEADROOM)
    dynamic = _dynamic_scale(amax, inv_max, FP8_MAX, RECIPROCAL)
    finite = amax < float("inf")
    peak = tl.math.div_rn(amax, tl.where(static > 0.0, static, 1.0))  # the largest code's magnitude
    fits = (static > 0.0) & finite & (peak <= FP8_MAX) & ((peak * spread >= FP8_MAX) | (amax == 0.0))
    tl.store(scale_ptr, tl.where(fits, static, dynamic))
    tl.store(gate_ptr, tl.where(fits, 0, 1).to(tl.int32))
    tl.store(slot_ptr + 1, tl.where(fits | (static <= 0.0), count, count + 1.0))
    # Re-seed: the next power of two at or above amax * margin / max (exponent bits, exact).
    bits = (amax * (margin * inv_max)).to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    seed = (tl.minimum(tl.maximum(exp, 1), 254) << 23).to(tl.float32, bitcast=True)
    tl.store(slot_ptr, tl.where(fits | ~finite | (amax == 0.0), static, seed))


_BITS_BLOCK = 1024
"""Bytes a program of :func:`relu_bits` writes (8192 elements read)."""


@triton.jit
def _relu_bits_kernel(y_ptr, bits_ptr, NB, WIDTH_MASK: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                      INF_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Byte ``i``: bit ``j`` set where element ``8 i + j`` of ``y`` is not ``<= 0``: positive and
    not zero, or NaN. Read from the float's bits (``y_ptr`` an integer view of it), so that no
    conversion flushes a subnormal to zero."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    in_range = byte[:, None] < NB
    v = tl.load(y_ptr + byte[:, None] * 8 + j[None, :], mask=in_range, other=0).to(tl.int64) & WIDTH_MASK
    magnitude = v & ((1 << SIGN_SHIFT) - 1)
    keep = ((magnitude != 0) & ((v >> SIGN_SHIFT) == 0)) | (magnitude > INF_BITS)
    tl.store(bits_ptr + byte, tl.sum(keep.to(tl.int32) << j[None, :], axis=1).to(tl.uint8), mask=byte < NB)


_FLOAT_BITS = {
    torch.float32: (torch.int32, 0xFFFFFFFF, 31, 0x7F800000),
    torch.bfloat16: (torch.int16, 0xFFFF, 15, 0x7F80),
    torch.float16: (torch.int16, 0xFFFF, 15, 0x7C00),
}
"""dtype -> (integer view, width mask, sign bit, bits of +inf) for :func:`relu_bits`."""


def relu_bits(y: Tensor) -> Tensor:
    """:func:`kernels.linear.relu_mask_bits` of a contiguous ``y`` whose last dim is a multiple of
    8, in one pass (``y`` read once, an eighth of a byte an element written): the mask of a
    folded ReLU's backward, taken by its producer from its own output (``output_relu`` of
    ``kernels.fp8_linear``)."""
    if not (y.is_contiguous() and y.shape[-1] % 8 == 0 and y.dtype in _FLOAT_BITS):
        raise ValueError(f"relu_bits needs a contiguous fp32, bf16 or fp16 input with a last dim a multiple "
                         f"of 8, got {y.dtype} {tuple(y.shape)} with strides {y.stride()}")
    _check_runnable(y)
    view, width, sign, inf = _FLOAT_BITS[y.dtype]
    bits = torch.empty((*y.shape[:-1], y.shape[-1] // 8), device=y.device, dtype=torch.uint8)
    nb = bits.numel()
    if nb:
        _relu_bits_kernel[(_cdiv(nb, _BITS_BLOCK),)](
            y.view(view), bits, nb, WIDTH_MASK=width, SIGN_SHIFT=sign, INF_BITS=inf, BLOCK=_BITS_BLOCK, num_warps=8)
    return bits


@functools.cache
def _reciprocal(v: float) -> float:
    """``1 / v`` rounded to fp32, as PyTorch's CUDA division by a scalar computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / v)


def _scale(x: Tensor, fmt_: Any, relu: bool = False, mask: Tensor | None = None) -> Tensor:
    """The tensor-wise scale of ``x`` (of ``relu(x)`` with ``relu``, of ``x`` zeroed where the
    ``mask`` bits are clear with ``mask``; amax partials, then one program): a 0-dim fp32 tensor."""
    scale = torch.empty((), device=x.device, dtype=torch.float32)
    n = x.numel()
    if n == 0:
        return scale.fill_(1.0)
    if x.is_contiguous():
        num_blocks = _cdiv(n, _BLOCK)
        partial = torch.empty(num_blocks, device=x.device, dtype=torch.float32)
        _amax_partial_kernel[(num_blocks,)](x, partial, n, x if mask is None else mask, BLOCK=_BLOCK, num_warps=8,
                                            RELU=relu, MASK=mask is not None)
    else:  # rows apart (_checked allows it for the two-layout cast only)
        num_blocks = _num_tiles(x, True)
        partial = torch.empty(num_blocks, device=x.device, dtype=torch.float32)
        _amax_partial_rows_kernel[(num_blocks,)](
            x, partial, x.shape[0], x.shape[1], x.stride(0), x if mask is None else mask, BLOCK_R=_TILE_R,
            BLOCK_C=_TILE_C, num_warps=_BOTH_WARPS, RELU=relu, MASK=mask is not None,
        )
    _scale_kernel[(1,)](
        partial, scale, num_blocks, _reciprocal(fmt_.max), FP8_MAX=fmt_.max,
        RECIPROCAL=x.device.type == "cuda", BLOCK=_FINAL_BLOCK, num_warps=4,
    )
    return scale


def _checked(x: Tensor, fmt: str, *, rows_apart: bool = False) -> Any:
    fmt_ = _triton_fmt(fmt)
    _check_runnable(x)
    if not (x.is_contiguous() or (rows_apart and is_row_strided(x))):
        raise ValueError(
            "tensorwise_quant needs a contiguous input (transposed views take loka::transposed_quant; "
            "the two-layout casts also read rows that lie apart)"
        )
    return fmt_


def _cast(
    x: Tensor, scale: Tensor, q: Tensor, q_t: Tensor | None, fmt_: Any, *, partial: Tensor | None = None,
    gate: Tensor | None = None, relu: bool = False, mask: Tensor | None = None,
) -> None:
    """One cast pass of ``x`` (of ``relu(x)`` with ``relu``, zeroed where the ``mask`` bits are
    clear with ``mask``) into ``q`` (and its transpose into
    ``q_t`` when given) with the scale at ``scale``'s first element; with ``partial``, also each
    program's amax; with ``gate``, only where it holds 1."""
    qr = _sw_round_args(q.dtype)
    common = dict(
        FP8_MAX=fmt_.max, Q_MANT=qr["MANT"], Q_SUB_MAGIC=qr["SUB_MAGIC"], Q_MIN_NORMAL=qr["MIN_NORMAL"],
        STORE_AMAX=partial is not None, GATED=gate is not None, FMA_DIV=x.device.type == "cuda", RELU=relu,
        MASK=mask is not None,
    )
    unused = scale  # a pointer the kernel does not read when its flag is off
    p = unused if partial is None else partial
    g = unused if gate is None else gate
    m = unused if mask is None else mask
    grid = (_num_programs(x, q_t is not None),)
    if q_t is None:
        _cast_kernel[grid](x, scale, q, x.numel(), p, g, BLOCK=_BLOCK, num_warps=8, STAGES=_STAGES, mask_ptr=m,
                           **common)
    else:
        r, c = x.shape
        _cast_both_kernel[grid](
            x, scale, q, q_t, r, c, x.stride(0), p, g, BLOCK_R=_TILE_R, BLOCK_C=_TILE_C, num_warps=_BOTH_WARPS,
            ROWS_APART=not x.is_contiguous(), STAGES=_STAGES, mask_ptr=m, **common,
        )


def _transposes_in_kernel(x: Tensor) -> bool:
    """Whether the two-layout cast writes the transpose in its own pass: for 16-bit inputs
    (GPU test ``test_the_tile_kernel_casts_every_16bit_value_in_both_layouts``). From fp32
    tiles, the transposed store of the FP8 tile put codes in the wrong places on an H100 (Triton
    3.6), as in triton-lang/triton#11111 (an FP8 value from a NaN-propagating min/max stored
    both as it is and transposed), so an fp32 input takes the one-layout cast, contiguous, and
    its payload's transpose is copied after the last cast (:func:`_transpose_payload`): the
    same payloads, one more pass."""
    return x.element_size() == 2


def _two_layout_input(x: Tensor) -> Tensor:
    """``x`` as the two-layout casts read it: as it is for the tile kernel, else contiguous."""
    return x if _transposes_in_kernel(x) else x.contiguous()


def _transpose_payload(x: Tensor, q: Tensor, q_t: Tensor) -> None:
    """Where the tile kernel does not write ``q_t`` (:func:`_transposes_in_kernel`), copy it
    from the finished payload ``q``."""
    if not _transposes_in_kernel(x):
        q_t.copy_(q.t())


def _num_tiles(x: Tensor, both: bool) -> int:
    """Tiles of the two-layout kernel with ``both``, else blocks of the one-layout kernel."""
    if both:
        return _cdiv(x.shape[0], _TILE_R) * _cdiv(x.shape[1], _TILE_C)
    return _cdiv(x.numel(), _BLOCK)


def _num_programs(x: Tensor, both: bool) -> int:
    """Programs of one cast pass (and amaxes its static-scale form stores): a persistent grid of
    at most :data:`_PROGRAMS_PER_SM` a multiprocessor, each looping over tiles (blocks)."""
    return min(_num_tiles(x, both), _PROGRAMS_PER_SM * multiprocessors(x.device))


def _checked_2d(x: Tensor, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{what} expects a 2-D input, got shape {tuple(x.shape)}")


def _tensorwise_quant_impl(x: Tensor, fmt: str, relu: bool = False) -> tuple[Tensor, Tensor]:
    fmt_ = _checked(x, fmt)
    q = torch.empty(x.shape, device=x.device, dtype=fmt_.dtype)
    scale = _scale(x, fmt_, relu)
    if x.numel():
        _cast(x, scale, q, None, fmt_, relu=relu)
    return q, scale


def _checked_mask(x: Tensor, mask: Tensor | None) -> None:
    """A two-layout cast's ``mask``: the bits of :func:`kernels.linear.relu_mask_bits` for ``x``."""
    if mask is None:
        return
    r, c = x.shape
    if (c % 8 or mask.dtype != torch.uint8 or tuple(mask.shape) != (r, c // 8) or not mask.is_contiguous()
            or mask.device != x.device):
        raise ValueError(
            f"the two-layout cast's mask must be contiguous uint8 bits of shape ({r}, {c} / 8) on {x.device} "
            f"(relu_mask_bits of the pre-activation), got {mask.dtype} {tuple(mask.shape)} on {mask.device}")


def _tensorwise_quant_both_impl(
    x: Tensor, fmt: str, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    fmt_ = _checked(x, fmt, rows_apart=True)
    _checked_2d(x, "tensorwise_quant_both")
    _checked_mask(x, mask)
    x = _two_layout_input(x)
    r, c = x.shape
    q = torch.empty((r, c), device=x.device, dtype=fmt_.dtype)
    q_t = torch.empty((c, r), device=x.device, dtype=fmt_.dtype)
    scale = _scale(x, fmt_, relu, mask)
    if x.numel():
        _cast(x, scale, q, q_t if _transposes_in_kernel(x) else None, fmt_, relu=relu, mask=mask)
        _transpose_payload(x, q, q_t)
    return q, scale, q_t


def _tensorwise_quant_static_impl(
    x: Tensor, slot: Tensor, fmt: str, both: bool, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    fmt_ = _checked(x, fmt, rows_apart=both)
    static_scales.check_slot(slot, x.device)
    if mask is not None and not both:
        raise ValueError("tensorwise_quant_static takes a mask with both=True only")
    if both:
        _checked_2d(x, "tensorwise_quant_static")
        _checked_mask(x, mask)
        x = _two_layout_input(x)
    q = torch.empty(x.shape, device=x.device, dtype=fmt_.dtype)
    q_t = torch.empty((x.shape[1], x.shape[0]) if both else (0,), device=x.device, dtype=fmt_.dtype)
    scale = torch.empty((), device=x.device, dtype=torch.float32)
    if x.numel() == 0:
        return q, scale.fill_(1.0), q_t
    tile_q_t = q_t if both and _transposes_in_kernel(x) else None
    num_programs = _num_programs(x, tile_q_t is not None)
    partial = torch.empty(num_programs, device=x.device, dtype=torch.float32)
    gate = torch.empty((), device=x.device, dtype=torch.int32)
    # Cast with the slot's scale (its first element), reading x once for the codes and the amax;
    # then decide, and recast with the dynamic scale only where the static one does not fit.
    _cast(x, slot, q, tile_q_t, fmt_, partial=partial, relu=relu, mask=mask)
    _static_check_kernel[(1,)](
        partial, num_programs, slot, scale, gate, _reciprocal(fmt_.max), FP8_MAX=fmt_.max,
        HEADROOM=static_scales.headroom(Fp8Format(fmt)), RECIPROCAL=x.device.type == "cuda", BLOCK=_FINAL_BLOCK,
        num_warps=4,
    )
    _cast(x, scale, q, tile_q_t, fmt_, gate=gate, relu=relu, mask=mask)
    if both:
        _transpose_payload(x, q, q_t)
    return q, scale, q_t


@torch.library.custom_op("loka::tensorwise_quant", mutates_args=())
def _tensorwise_quant_op(x: Tensor, fmt: str, relu: bool = False) -> tuple[Tensor, Tensor]:
    return _tensorwise_quant_impl(x, fmt, relu)


@_tensorwise_quant_op.register_fake
def _tensorwise_quant_fake(x: Tensor, fmt: str, relu: bool = False) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=Fp8Format(fmt).dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("loka::tensorwise_quant_both", mutates_args=())
def _tensorwise_quant_both_op(
    x: Tensor, fmt: str, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    return _tensorwise_quant_both_impl(x, fmt, relu, mask)


@_tensorwise_quant_both_op.register_fake
def _tensorwise_quant_both_fake(
    x: Tensor, fmt: str, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    dtype = Fp8Format(fmt).dtype
    r, c = x.shape
    return x.new_empty((r, c), dtype=dtype), x.new_empty((), dtype=torch.float32), x.new_empty((c, r), dtype=dtype)


@torch.library.custom_op("loka::tensorwise_quant_static", mutates_args=("slot",))
def _tensorwise_quant_static_op(
    x: Tensor, slot: Tensor, fmt: str, both: bool, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    return _tensorwise_quant_static_impl(x, slot, fmt, both, relu, mask)


@_tensorwise_quant_static_op.register_fake
def _tensorwise_quant_static_fake(
    x: Tensor, slot: Tensor, fmt: str, both: bool, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    dtype = Fp8Format(fmt).dtype
    q_t = x.new_empty((x.shape[1], x.shape[0]) if both else (0,), dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32), q_t


def tensorwise_quant(
    x: Tensor, *, fmt: Fp8Format = Fp8Format.E4M3, relu: bool = False
) -> tuple[Tensor, Tensor]:
    """Quantize a contiguous float tensor to FP8 with one scale for the whole tensor.

    Args:
        x: fp32, bf16 or fp16, contiguous, any shape.
        fmt: e4m3 or e5m2.
        relu: quantize ``torch.relu(x)``, applied as the pass reads ``x`` (an activation's
            producer folded into its cast: no pass writes the ReLU's output).

    Returns:
        ``(q, scale)``: the FP8 payload shaped like ``x`` and the 0-dim fp32 dequantization
        scale, bit-identical to :func:`tensorwise_quant_reference` (of ``torch.relu(x)`` with
        ``relu``).

    Raises:
        ValueError: for a non-contiguous input or another format.
        RuntimeError: where Triton cannot run.
    """
    fmt_s = as_format(fmt).value
    if opaque.tracing():
        return torch.ops.loka.tensorwise_quant(x, fmt_s, relu)
    return _tensorwise_quant_impl(x, fmt_s, relu)


def tensorwise_quant_both(
    x: Tensor, *, fmt: Fp8Format = Fp8Format.E4M3, relu: bool = False, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tensorwise_quant` of a 2-D tensor that also writes the payload's transpose,
    contiguous, in the same pass for a 16-bit input (op ``loka::tensorwise_quant_both``; an
    fp32 input's transpose is copied from the payload, ``_transposes_in_kernel``).

    Args:
        x: fp32, bf16 or fp16, 2-D ``(R, C)``, contiguous or with its rows apart
            (:func:`kernels.formats.is_row_strided`; a 16-bit one read as it is, an fp32 one
            copied contiguous first).
        fmt: e4m3 or e5m2.
        relu: as in :func:`tensorwise_quant`.
        mask: quantize ``x`` zeroed where the bits are clear: a folded ReLU's backward on a
            gradient, applied as the pass reads it (:func:`kernels.linear.relu_mask_bits` of the
            pre-activation, uint8 ``(R, C / 8)``, contiguous; ``C`` a multiple of 8).

    Returns:
        ``(q, scale, q_t)``: ``q`` and ``scale`` as :func:`tensorwise_quant` returns them for
        ``x.contiguous()`` (of :func:`kernels.linear.relu_grad_from_bits` of it with ``mask``;
        bit for bit), ``q_t`` equal to ``q.t()``, both contiguous.

    Raises:
        ValueError: for a non-2-D input, one neither contiguous nor with only its rows apart,
            or another format.
        RuntimeError: where Triton cannot run.
    """
    fmt_s = as_format(fmt).value
    if opaque.tracing():
        return torch.ops.loka.tensorwise_quant_both(x, fmt_s, relu, mask)
    return _tensorwise_quant_both_impl(x, fmt_s, relu, mask)


def tensorwise_quant_static(
    x: Tensor, slot: Tensor, *, fmt: Fp8Format = Fp8Format.E4M3, both: bool = False, relu: bool = False,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Tensor-wise quantization with the static scale that ``slot`` holds, where it fits ``x``
    (op ``loka::tensorwise_quant_static``; ``kernels.static_scales`` says when it fits and how
    the slot is updated). One pass reads ``x`` for the codes and the amax together, where the
    dynamic quantizer reads it twice; a tensor the static scale does not fit is recast with the
    dynamic scale (bit for bit :func:`tensorwise_quant`'s payload), counted in the slot.

    Args:
        x: fp32, bf16 or fp16, contiguous (or, with ``both``, 2-D and possibly with its rows
            apart, :func:`kernels.formats.is_row_strided`).
        slot: the operand's slot (``static_scales.new_slots``), updated in place.
        fmt: e4m3 or e5m2.
        both: also write the payload's transpose, contiguous (as
            :func:`tensorwise_quant_both` does).
        relu: as in :func:`tensorwise_quant` (the slot's fit and amax are ``torch.relu(x)``'s).
        mask: with ``both``, as in :func:`tensorwise_quant_both` (the fit and amax are the
            masked tensor's).

    Returns:
        ``(q, scale, q_t)``: bit for bit :func:`static_scales.quantize_static_reference`'s
        payload and scale; ``q_t`` is ``q``'s transpose with ``both``, else None.

    Raises:
        ValueError: for a non-contiguous input (rows apart are read with ``both``), a bad slot
            or another format.
        RuntimeError: where Triton cannot run.
    """
    fmt_s = as_format(fmt).value
    if opaque.tracing():
        q, scale, q_t = torch.ops.loka.tensorwise_quant_static(x, slot, fmt_s, both, relu, mask)
    else:
        q, scale, q_t = _tensorwise_quant_static_impl(x, slot, fmt_s, both, relu, mask)
    return q, scale, (q_t if both else None)


def tensorwise_quant_reference(x: Tensor, *, fmt: Fp8Format = Fp8Format.E4M3) -> tuple[Tensor, Tensor]:
    """The reference quantizer's tensor-wise result, as ``(q, scale)``."""
    qt = quantize(x, Fp8Format(fmt), Scaling.TENSORWISE)
    return qt.data, qt.scale
