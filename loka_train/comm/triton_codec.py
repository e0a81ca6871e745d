"""Fused Triton kernels of the comm wire formats: one pass per FP8 encode, FP8 decode and
16-bit encode, bit-identical to the pure-PyTorch reference in `comm.formats`.

* :func:`fp8_encode` (op ``loka::comm_fp8_encode``): per row of ``row_dim`` values, amax,
  inverse scale, saturating cast and packing into the reference payload
  ``[A bytes of fp8 | fp32 inverse scale]`` (A = row_dim rounded up to 4, padding zeroed).
* :func:`fp8_decode` (op ``loka::comm_fp8_decode``): unpack and divide by the row's inverse
  scale, into fp32.
* :func:`clamped_cast` (op ``loka::comm_clamped_cast``): the BF16/FP16 payload, saturated to
  the format's max instead of overflowing, in one read and one write.

Numerics follow the reference operation by operation, on each device:

* inverse scale ``= reciprocal(amax) * fmt_max`` (two fp32 roundings: PyTorch evaluates
  ``fmt_max / amax_R1``, a Python scalar over a tensor, as ``amax_R1.reciprocal() * fmt_max``
  on every device), 1 for an all-zero row, clamped to the fp32 max; a row holding NaN has amax
  NaN, hence inverse scale 1 (``torch.where(nan > 0, ...)``); a row holding inf has inverse
  scale 0;
* decode divides by the inverse scale, a tensor (not a Python scalar, which PyTorch's CUDA
  kernels would turn into a multiplication by its reciprocal): correctly rounded on every
  device, so the kernels use ``div_rn`` (Triton's plain fp32 division on CUDA is approximate);
* NaNs made by arithmetic (``inf * 0`` in a row holding inf) carry the device's sign (set on
  x86 CPUs, clear on CUDA); the kernel does the same arithmetic on the same device, so its
  codes follow the reference there;
* FP8 codes: round to nearest even after clamping to +-fmt_max; a NaN is written as PyTorch's
  cast writes it (``0x7F`` with the NaN's sign bit), and the sign bit of every code is the
  sign of the scaled value (so -0.0 stays 0x80, as in PyTorch);
* BF16 NaN: PyTorch's CPU cast writes 0xFFFF whatever the sign, its CUDA cast (``cvt.rn``)
  the hardware's canonical NaN; the interpreted kernel writes 0xFFFF, the compiled one uses
  the same ``cvt.rn`` instruction.

The interpreter's own fp32 -> fp8/bf16 casts round wrongly, and its bf16 -> fp32 and fp8 ->
fp32 upcasts mishandle subnormals and specials: FP8 codes are rounded in integer arithmetic
(``kernels.triton_kernels._round_rne``) on every device before the (then exact) cast, bf16
inputs are widened by a bit shift, and exponent-all-ones FP8 codes are decoded explicitly.
The interpreted 16-bit cast rounds bf16 in software; compiled, the hardware ``cvt.rn`` runs,
as in PyTorch's CUDA cast.

Shape legend: R rows, C values per row (row_dim), A aligned row bytes, P payload bytes per row
(A + 4), N values.

Example:
    >>> payload_RP = fp8_encode(torch.randn(1024, 128, device="cuda"), row_dim=128,
    ...                         fmt=Fp8Format.E4M3)
    >>> x_N = fp8_decode(payload_RP.reshape(-1), row_dim=128, fmt=Fp8Format.E4M3)
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.triton_kernels import (
    INTERPRETED,
    _cdiv,
    _next_pow2,
    _round_rne,
    triton_runnable,
)

logger = logging.getLogger(__name__)

__all__ = ["MAX_ROW_DIM", "clamped_cast", "codec_runnable", "fp8_decode", "fp8_encode"]

MAX_ROW_DIM = 16384
"""Longest row the FP8 kernels take (a row is held in registers)."""

_FP32_MAX = float(torch.finfo(torch.float32).max)
_CAST16_DTYPES = (torch.bfloat16, torch.float16)
_LOADABLE = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program of the row-wise kernels (rows x next_pow2(A)), and of the cast kernel.
_ROW_BLOCK_ELEMS = 4096
_CAST_BLOCK = 2048


def codec_runnable(device: torch.device | str, row_dim: int | None = None) -> tuple[bool, str]:
    """Whether the codec kernels can run on `device` (for rows of `row_dim`), and why not.

    Example:
        >>> codec_runnable("cuda:0", 128)
        (True, '')
    """
    ok, why = triton_runnable(device)
    if not ok:
        return False, why
    if row_dim is not None and not 1 <= row_dim <= MAX_ROW_DIM:
        return False, f"the FP8 kernels hold a row in registers: row_dim={row_dim} > {MAX_ROW_DIM}"
    return True, ""


def _check_runnable(t: Tensor, row_dim: int | None = None) -> None:
    ok, why = codec_runnable(t.device, row_dim)
    if not ok:
        raise RuntimeError(f"cannot run the loka Triton codec here: {why}")


def _aligned(num_bytes: int) -> int:
    return (num_bytes + 3) // 4 * 4


@functools.cache
def _row_launch(row_dim: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the row-wise kernels: BLOCK_C covers the aligned row."""
    block_c = _next_pow2(_aligned(row_dim))
    return max(1, min(256, _ROW_BLOCK_ELEMS // block_c)), block_c


@triton.jit
def _load_fp32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load as fp32; BF16_BITS: ``ptrs`` point at bf16 values viewed as int16, widened by a shift
    (exact, and the interpreter's own bf16 upcast gets subnormals wrong)."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


def _as_loadable(x: Tensor) -> tuple[Tensor, bool]:
    """(`x` as the kernels read it, whether it is bf16 viewed as int16)."""
    if x.dtype not in _LOADABLE:
        x = x.float()
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


# --------------------------------------------------------------------------------------------
# FP8 row-wise encode / decode
# --------------------------------------------------------------------------------------------


@triton.jit
def _encode_rows(
    x,
    IS_E4M3: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP32_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MANT: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    """FP8 codes (int32, 0-255) and fp32 inverse scales of the rows of `x` (BLOCK_R x BLOCK_C,
    fp32, padding +0.0): the reference encoder's arithmetic."""
    # torch's amax propagates NaN; tl.max need not.
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1))
    positive = amax > 0.0  # False for NaN: such a row keeps inverse scale 1, as in torch.where
    recip = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.where(positive, amax, 1.0))
    inv = tl.minimum(tl.where(positive, recip * FP8_MAX, 1.0), FP32_MAX)
    q = x * inv[:, None]
    clamped = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    # Onto the FP8 grid (round to nearest even) in integer arithmetic: the cast below is then
    # exact whatever the conversion instruction (or the interpreter) does.
    clamped = _round_rne(clamped, MANT, SUB_MAGIC, MIN_NORMAL)
    if IS_E4M3:
        code = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = clamped.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    # The code's sign is the scaled value's (the cast of -0.0 included); NaN as torch writes it.
    sign = tl.where(q.to(tl.int32, bitcast=True) < 0, 0x80, 0)
    code = tl.where(q != q, 0x7F, code & 0x7F) | sign
    return code, inv


@triton.jit
def _decode_codes(code, IS_E4M3: tl.constexpr):
    """fp32 values of FP8 codes (uint8), before the division by the row's inverse scale."""
    # Codes with the exponent all ones decoded explicitly: the interpreter's upcast reads them
    # as normal numbers (the GPU's conversion agrees with this).
    mag = code.to(tl.int32) & 0x7F
    if IS_E4M3:
        q = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        q = tl.where(mag == 0x7F, float("nan"), q)
    else:
        q = code.to(tl.float8e5, bitcast=True).to(tl.float32)
        inf = tl.where(code.to(tl.int32) >= 0x80, float("-inf"), float("inf"))
        q = tl.where(mag == 0x7C, inf, tl.where(mag > 0x7C, float("nan"), q))
    return q


@triton.jit
def _load_inv_scales(row_ptr, rmask, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr):
    """The rows' fp32 inverse scales, read as 4 little-endian bytes after the codes (any
    payload offset works: no 4-byte alignment needed); 1 for rows past the end (no 0 / 0)."""
    bits = tl.zeros([BLOCK_R], dtype=tl.uint32)
    for i in tl.static_range(4):
        byte = tl.load(row_ptr + ALIGNED + i, mask=rmask, other=0).to(tl.uint32)
        bits = bits | (byte << (8 * i))
    return tl.where(rmask, bits.to(tl.float32, bitcast=True), 1.0)


@triton.jit
def _fp8_encode_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    num_rows,
    ROW_DIM: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    IS_E4M3: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP32_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MANT: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    in_row = cols[None, :] < ROW_DIM
    x = _load_fp32(
        x_ptr + rows64[:, None] * ROW_DIM + cols[None, :], rmask[:, None] & in_row, BF16_BITS
    )
    code, inv = _encode_rows(x, IS_E4M3, FP8_MAX, FP32_MAX, BLOCK_R, MANT, SUB_MAGIC, MIN_NORMAL)
    # Columns from ROW_DIM to ALIGNED (the row's padding) loaded +0.0: their code is 0.
    _store_rows(out_ptr, scale_ptr, rows64, cols, rmask, code, inv, ALIGNED, ROW_BYTES, ROW_WORDS)


@triton.jit
def _store_rows(out_ptr, scale_ptr, rows64, cols, rmask, code, inv, ALIGNED: tl.constexpr,
                ROW_BYTES: tl.constexpr, ROW_WORDS: tl.constexpr):
    """Write rows of the payload: the codes (their padding included) and the inverse scales."""
    tl.store(
        out_ptr + rows64[:, None] * ROW_BYTES + cols[None, :],
        code.to(tl.uint8),
        mask=rmask[:, None] & (cols[None, :] < ALIGNED),
    )
    tl.store(scale_ptr + rows64 * ROW_WORDS + ALIGNED // 4, inv, mask=rmask)


@triton.jit
def _decode_rows(row_ptr, cols, rmask, mask, IS_E4M3: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 values of the payload rows starting at ``row_ptr`` (codes / inverse scale)."""
    code = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=0)
    inv = _load_inv_scales(row_ptr, rmask, ALIGNED, BLOCK_R)
    return tl.math.div_rn(_decode_codes(code, IS_E4M3), tl.broadcast_to(inv[:, None], (BLOCK_R, BLOCK_C)))


@triton.jit
def _fp8_decode_kernel(
    payload_ptr,
    y_ptr,
    num_rows,
    ROW_DIM: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IS_E4M3: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    mask = rmask[:, None] & (cols[None, :] < ROW_DIM)
    y = _decode_rows(payload_ptr + rows64 * ROW_BYTES, cols, rmask, mask, IS_E4M3, ALIGNED, BLOCK_R, BLOCK_C)
    tl.store(y_ptr + rows64[:, None] * ROW_DIM + cols[None, :], y, mask=mask)


def _fp8_constants(fmt: Fp8Format) -> dict[str, object]:
    """The constexpr arguments of :func:`_encode_rows` (and ``IS_E4M3`` of the decoders) for `fmt`.

    Raises:
        ValueError: a format other than e4m3 / e5m2.
    """
    if fmt not in (Fp8Format.E4M3, Fp8Format.E5M2):
        raise ValueError(f"the FP8 codec supports e4m3 and e5m2, not {fmt.value}")
    return {"IS_E4M3": fmt is Fp8Format.E4M3, "FP8_MAX": fmt.max, "FP32_MAX": _FP32_MAX,
            "MANT": fmt.mantissa_bits, "SUB_MAGIC": 1.5 * 2.0**23 * fmt.min_subnormal,
            "MIN_NORMAL": fmt.min_normal}


def _fp8_encode_impl(x: Tensor, row_dim: int, fmt: str) -> Tensor:
    fmt_ = Fp8Format(fmt)
    consts = _fp8_constants(fmt_)
    if x.numel() % row_dim != 0:
        raise ValueError(f"{x.numel()} values are not a multiple of row_dim={row_dim}")
    _check_runnable(x, row_dim)
    x, bf16_bits = _as_loadable(x.reshape(-1))
    num_rows, aligned = x.numel() // row_dim, _aligned(row_dim)
    row_bytes = aligned + 4
    out = torch.empty((num_rows, row_bytes), dtype=torch.uint8, device=x.device)
    if num_rows == 0:
        return out
    block_r, block_c = _row_launch(row_dim)
    _fp8_encode_kernel[(_cdiv(num_rows, block_r),)](
        x,
        out,
        out.view(torch.float32),
        num_rows,
        ROW_DIM=row_dim,
        ALIGNED=aligned,
        ROW_BYTES=row_bytes,
        ROW_WORDS=row_bytes // 4,
        BF16_BITS=bf16_bits,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=4,
        **consts,
    )
    return out


def _payload_rows(payload: Tensor, row_dim: int) -> tuple[int, int]:
    row_bytes = _aligned(row_dim) + 4
    if payload.dtype != torch.uint8:
        raise ValueError(f"an FP8 payload is uint8, got {payload.dtype}")
    if payload.numel() % row_bytes != 0:
        raise ValueError(
            f"FP8 payload of {payload.numel()} bytes is not a whole number of {row_bytes}-byte "
            f"rows (row_dim={row_dim})"
        )
    return payload.numel() // row_bytes, row_bytes


def _fp8_decode_impl(payload: Tensor, row_dim: int, fmt: str) -> Tensor:
    fmt_ = Fp8Format(fmt)
    num_rows, row_bytes = _payload_rows(payload, row_dim)
    _check_runnable(payload, row_dim)
    payload = payload.reshape(-1).contiguous()
    y = torch.empty(num_rows * row_dim, dtype=torch.float32, device=payload.device)
    if num_rows == 0:
        return y
    block_r, block_c = _row_launch(row_dim)
    _fp8_decode_kernel[(_cdiv(num_rows, block_r),)](
        payload,
        y,
        num_rows,
        ROW_DIM=row_dim,
        ALIGNED=_aligned(row_dim),
        ROW_BYTES=row_bytes,
        IS_E4M3=fmt_ is Fp8Format.E4M3,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return y


@torch.library.custom_op("loka::comm_fp8_encode", mutates_args=())
def _fp8_encode_op(x: Tensor, row_dim: int, fmt: str) -> Tensor:
    return _fp8_encode_impl(x, row_dim, fmt)


@_fp8_encode_op.register_fake
def _fp8_encode_fake(x, row_dim, fmt):
    return x.new_empty((x.numel() // row_dim, _aligned(row_dim) + 4), dtype=torch.uint8)


@torch.library.custom_op("loka::comm_fp8_decode", mutates_args=())
def _fp8_decode_op(payload: Tensor, row_dim: int, fmt: str) -> Tensor:
    return _fp8_decode_impl(payload, row_dim, fmt)


@_fp8_decode_op.register_fake
def _fp8_decode_fake(payload, row_dim, fmt):
    num_rows = payload.numel() // (_aligned(row_dim) + 4)
    return payload.new_empty((num_rows * row_dim,), dtype=torch.float32)


def fp8_encode(x: Tensor, *, row_dim: int, fmt: Fp8Format) -> Tensor:
    """Row-wise FP8 payload of `x` in one kernel (op ``loka::comm_fp8_encode``).

    Args:
        x: values (any shape, fp32 / bf16 / fp16; other float dtypes are converted to fp32
            first); every `row_dim` consecutive values of the flattened tensor share a scale.
        row_dim: values per row, at most `MAX_ROW_DIM`.
        fmt: e4m3 or e5m2.

    Returns:
        uint8 (R, A + 4): per row the fp8 codes, zero padding to A bytes, the fp32 inverse
        scale; bit-identical to the reference encoder (`WireFormat` with REFERENCE).

    Example:
        >>> fp8_encode(torch.randn(8, 6, device="cuda"), row_dim=6, fmt=Fp8Format.E5M2).shape
        torch.Size([8, 12])
    """
    args = (x, row_dim, Fp8Format(fmt).value)
    if opaque.tracing():
        return torch.ops.loka.comm_fp8_encode(*args)
    # Eager: skip the custom-op dispatcher (tens of microseconds per call on the hot path).
    return _fp8_encode_impl(*args)


def fp8_decode(payload: Tensor, *, row_dim: int, fmt: Fp8Format) -> Tensor:
    """fp32 values of a row-wise FP8 payload in one kernel (op ``loka::comm_fp8_decode``).

    Args:
        payload: uint8, a whole number of ``A + 4``-byte rows (the concatenation of several
            senders' payloads included), at any byte offset.
        row_dim: values per row.
        fmt: the e4m3 / e5m2 format the payload was encoded with.

    Returns:
        flat fp32 (R * row_dim), bit-identical to the reference decoder (NaN payload bits
        aside).

    Example:
        >>> fp8_decode(torch.zeros(12, dtype=torch.uint8, device="cuda"), row_dim=6,
        ...            fmt=Fp8Format.E4M3)
        tensor([nan, nan, nan, nan, nan, nan], device='cuda:0')  # a zero scale: 0 / 0
    """
    args = (payload, row_dim, Fp8Format(fmt).value)
    if opaque.tracing():
        return torch.ops.loka.comm_fp8_decode(*args)
    return _fp8_decode_impl(*args)


# --------------------------------------------------------------------------------------------
# BF16 / FP16 clamped cast
# --------------------------------------------------------------------------------------------


@triton.jit
def _clamped_cast_kernel(
    x_ptr,
    y_ptr,
    n,
    BF16_BITS: tl.constexpr,
    LIMIT: tl.constexpr,
    SW_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _load_fp32(x_ptr + offs, mask, BF16_BITS)
    _store_clamped(y_ptr, offs, mask, x, LIMIT, SW_BF16)


@triton.jit
def _clamp_keep_nan(x, LIMIT: tl.constexpr):
    """``torch.clamp(x, -LIMIT, LIMIT)``: NaN stays NaN (tl.minimum / tl.maximum need not keep it)."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -LIMIT), LIMIT))


@triton.jit
def _store_clamped(y_ptr, offs, mask, x, LIMIT: tl.constexpr, SW_BF16: tl.constexpr):
    """Store fp32 `x` clamped to +-LIMIT (NaN kept) as `y_ptr`'s 16-bit dtype; returns the stored
    values in fp32. SW_BF16: `y_ptr` is an int16 view of a bf16 output, rounded in software."""
    c = _clamp_keep_nan(x, LIMIT)
    if SW_BF16:
        bits = _sw_bf16_bits(c)
        tl.store(y_ptr + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        return (bits << 16).to(tl.float32, bitcast=True)
    p = c.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, p, mask=mask)
    return p.to(tl.float32)


@triton.jit
def _sw_bf16_bits(c):
    """The bf16 bits (uint32, low half) of fp32 `c` rounded to nearest even on its bits, for
    the interpreter, whose own cast rounds wrongly; NaN as torch's CPU cast writes it."""
    bits = _round_rne(c, 7, 0.0, 0.0).to(tl.uint32, bitcast=True) >> 16
    return tl.where(c != c, 0xFFFF, bits)


def _clamped_cast_impl(x: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype not in _CAST16_DTYPES:
        raise ValueError(f"clamped_cast targets {_CAST16_DTYPES}, not {dtype}")
    _check_runnable(x)
    src, bf16_bits = _as_loadable(x)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = y.numel()
    if n == 0:
        return y
    sw_bf16 = INTERPRETED and dtype == torch.bfloat16
    _clamped_cast_kernel[(_cdiv(n, _CAST_BLOCK),)](
        src,
        y.view(torch.int16) if sw_bf16 else y,
        n,
        BF16_BITS=bf16_bits,
        LIMIT=float(torch.finfo(dtype).max),
        SW_BF16=sw_bf16,
        BLOCK=_CAST_BLOCK,
        num_warps=4,
    )
    return y


@torch.library.custom_op("loka::comm_clamped_cast", mutates_args=())
def _clamped_cast_op(x: Tensor, dtype: torch.dtype) -> Tensor:
    return _clamped_cast_impl(x, dtype)


@_clamped_cast_op.register_fake
def _clamped_cast_fake(x, dtype):
    return x.new_empty(x.shape, dtype=dtype)


def clamped_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` in bf16 or fp16, saturated to the format's max, in one kernel
    (op ``loka::comm_clamped_cast``); bit-identical to ``x.float().clamp(-max, max).to(dtype)``
    on the same device (NaN payload bits aside on CUDA, see the module docstring).

    Args:
        x: values (fp32 / bf16 / fp16; other float dtypes are converted to fp32 first).
        dtype: torch.bfloat16 or torch.float16.

    Returns:
        a contiguous tensor of `x`'s shape in `dtype`.

    Example:
        >>> clamped_cast(torch.tensor([1e6, 1.5], device="cuda"), torch.float16)
        tensor([65504.0000, 1.5000], device='cuda:0', dtype=torch.float16)
    """
    if opaque.tracing():
        return torch.ops.loka.comm_clamped_cast(x, dtype)
    return _clamped_cast_impl(x, dtype)
