"""Fused Triton kernels of the FP8 and BF16 replica syncs (`comm.ReplicaSync`): two passes over a
replicated tensor instead of about a dozen, bit-identical to the reference path.

A lossy sync of one replicated tensor ``w`` (N values) with anchor ``a`` (its value at the last
sync, fp32) and error-feedback residual ``e`` computes, in the reference path,
``d = (w - a) + e``, pads it to whole rows, encodes it (row-wise FP8, `comm.formats`), keeps
``e' = d - decode(payload)``, all-gathers the R replicas' payloads, decodes them, averages and
sets ``w = a = a + mean``: each step a full pass over fp32 N values.

* :func:`delta_encode`: ``d``, its payload and ``e'`` in one read of ``w``, ``a``, ``e``
  (the payload is the reference encoder's, byte for byte: ``triton_codec``'s row encoding);
* :func:`mean_apply`: from the R gathered payloads, ``a + (d_0 + d_1 + ... + d_{R-1}) * (1/R)``
  (summed in replica order, as the reference does) written to the anchor and to ``w`` (fp32;
  another dtype gets a copy of the anchor, rounded as ``Tensor.copy_`` rounds).
* :func:`delta_encode_bf16` / :func:`mean_apply_bf16`: the same two passes for the BF16 sync
  (the change cast to bf16, saturating as the codec's clamped cast does).

Shape legend: N values, R replicas, P payload bytes per row (``A + 4``, A = row_dim rounded up
to 4).

Example:
    >>> payload, residual_N = delta_encode(w_N, anchor_N, residual_N, row_dim=128, fmt=Fp8Format.E4M3)
    >>> dist.all_gather(gathered, payload)
    >>> mean_apply(torch.cat(gathered), anchor_N, w_N, num_replicas=2, row_dim=128, fmt=Fp8Format.E4M3)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.comm.triton_codec import (
    _CAST_BLOCK,
    _aligned,
    _as_loadable,
    _check_runnable,
    _decode_codes,
    _decode_rows,
    _encode_rows,
    _fp8_constants,
    _load_fp32,
    _row_launch,
    _store_clamped,
    _store_rows,
)
from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.triton_kernels import INTERPRETED, _cdiv

__all__ = ["delta_encode", "delta_encode_bf16", "mean_apply", "mean_apply_bf16"]

_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@triton.jit
def _row_block(num_values, num_rows, ROW_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows of the flat tensor seen as rows of ROW_DIM values: the columns, the
    rows' mask, the rows (int64), the values' flat indices, the mask of the rows' values and
    that mask within the tensor's N values."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    idx = rows64[:, None] * ROW_DIM + cols[None, :]
    in_rows = rmask[:, None] & (cols[None, :] < ROW_DIM)
    return cols, rmask, rows64, idx, in_rows, in_rows & (idx < num_values)


@triton.jit
def _delta_encode_kernel(
    w_ptr,
    anchor_ptr,
    res_ptr,
    out_ptr,
    scale_ptr,
    res_out_ptr,
    num_values,
    num_rows,
    ROW_DIM: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    HAS_RES: tl.constexpr,
    FEEDBACK: tl.constexpr,
    IS_E4M3: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP32_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MANT: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    # Past N (the last row's padding) everything loads 0: the reference pads d with zeros.
    cols, rmask, rows64, idx, _, mask = _row_block(num_values, num_rows, ROW_DIM, BLOCK_R, BLOCK_C)
    d = _load_fp32(w_ptr + idx, mask, BF16_BITS) - tl.load(anchor_ptr + idx, mask=mask, other=0.0)
    if HAS_RES:
        d = d + tl.load(res_ptr + idx, mask=mask, other=0.0)
    code, inv = _encode_rows(d, IS_E4M3, FP8_MAX, FP32_MAX, BLOCK_R, MANT, SUB_MAGIC, MIN_NORMAL)
    _store_rows(out_ptr, scale_ptr, rows64, cols, rmask, code, inv, ALIGNED, ROW_BYTES, ROW_WORDS)
    if FEEDBACK:
        # What the receivers decode, as the decoder computes it.
        sent = tl.math.div_rn(
            _decode_codes(code.to(tl.uint8), IS_E4M3), tl.broadcast_to(inv[:, None], (BLOCK_R, BLOCK_C))
        )
        tl.store(res_out_ptr + idx, d - sent, mask=mask)


@triton.jit
def _apply_mean(anchor_ptr, w_ptr, idx, mask, total, INV_REPLICAS: tl.constexpr, WRITE_W: tl.constexpr):
    """The new value ``anchor + total / R`` (total: the replicas' changes summed in replica
    order), into the anchor and, with WRITE_W, the tensor."""
    new = tl.load(anchor_ptr + idx, mask=mask, other=0.0) + total * INV_REPLICAS
    tl.store(anchor_ptr + idx, new, mask=mask)
    if WRITE_W:
        tl.store(w_ptr + idx, new, mask=mask)


@triton.jit
def _mean_apply_kernel(
    payload_ptr,
    anchor_ptr,
    w_ptr,
    num_values,
    num_rows,
    replica_bytes,
    NUM_REPLICAS: tl.constexpr,
    INV_REPLICAS: tl.constexpr,
    WRITE_W: tl.constexpr,
    ROW_DIM: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IS_E4M3: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, rmask, rows64, idx, code_mask, mask = _row_block(num_values, num_rows, ROW_DIM, BLOCK_R, BLOCK_C)
    total = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r in tl.static_range(NUM_REPLICAS):
        row_ptr = payload_ptr + r * replica_bytes.to(tl.int64) + rows64 * ROW_BYTES
        value = _decode_rows(row_ptr, cols, rmask, code_mask, IS_E4M3, ALIGNED, BLOCK_R, BLOCK_C)
        # In replica order from the first value, as the reference adds them.
        if r == 0:
            total = value
        else:
            total = total + value
    _apply_mean(anchor_ptr, w_ptr, idx, mask, total, INV_REPLICAS, WRITE_W)


def delta_encode(
    w: Tensor, anchor_N: Tensor, residual_N: Tensor | None, *, row_dim: int, fmt: Fp8Format, feedback: bool
) -> tuple[Tensor, Tensor | None]:
    """The row-wise FP8 payload of ``d = (w - anchor) + residual`` (zero-padded to whole rows)
    and, with `feedback`, the new residual ``d - decode(payload)``, in one pass.

    Args:
        w: the replicated tensor (fp32 / bf16 / fp16, any shape, N values).
        anchor_N: its value at the last sync, fp32, flat.
        residual_N: what earlier lossy syncs dropped (fp32, flat), or None.
        row_dim: values per row of the payload.
        fmt: e4m3 or e5m2.
        feedback: whether to return the new residual.

    Returns:
        (uint8 payload, flat: ``ceil(N / row_dim)`` rows of P bytes, the reference encoder's;
        the new fp32 residual (N) or None).
    """
    consts = _fp8_constants(fmt)
    _check_runnable(anchor_N, row_dim)
    num_values = anchor_N.numel()
    if w.numel() != num_values or (residual_N is not None and residual_N.numel() != num_values):
        raise ValueError(f"delta_encode: w, anchor and residual must hold the same number of values "
                         f"({w.numel()}, {num_values}, {None if residual_N is None else residual_N.numel()})")
    w_N, bf16_bits = _as_loadable(w.reshape(-1))
    anchor_N = anchor_N.reshape(-1).contiguous()
    num_rows, aligned = _cdiv(num_values, row_dim), _aligned(row_dim)
    row_bytes = aligned + 4
    out = torch.empty((num_rows, row_bytes), dtype=torch.uint8, device=anchor_N.device)
    res_out = torch.empty_like(anchor_N) if feedback else None
    if num_rows:
        block_r, block_c = _row_launch(row_dim)
        res_in = residual_N.reshape(-1).contiguous() if residual_N is not None else anchor_N
        _delta_encode_kernel[(_cdiv(num_rows, block_r),)](
            w_N, anchor_N, res_in, out, out.view(torch.float32), res_out if res_out is not None else anchor_N,
            num_values, num_rows,
            ROW_DIM=row_dim, ALIGNED=aligned, ROW_BYTES=row_bytes, ROW_WORDS=row_bytes // 4,
            BF16_BITS=bf16_bits, HAS_RES=residual_N is not None, FEEDBACK=feedback,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4, enable_fp_fusion=False, **consts,
        )
    return out.reshape(-1), res_out


def mean_apply(
    gathered: Tensor, anchor_N: Tensor, w: Tensor, *, num_replicas: int, row_dim: int, fmt: Fp8Format
) -> None:
    """Add the mean of the replicas' decoded payloads to `anchor_N` and write it to `w`, in place.

    Args:
        gathered: uint8, the R replicas' payloads of :func:`delta_encode`, concatenated in replica order.
        anchor_N: fp32, flat (N): becomes ``anchor + (d_0 + ... + d_{R-1}) * (1 / R)``.
        w: the replicated tensor (N values): gets the new anchor (fp32 in the kernel; another
            dtype rounded by ``Tensor.copy_``).
        num_replicas: R.
        row_dim: values per row of the payloads.
        fmt: the format they were encoded with.
    """
    is_e4m3 = _fp8_constants(fmt)["IS_E4M3"]
    _check_runnable(anchor_N, row_dim)
    num_values = anchor_N.numel()
    num_rows, aligned = _cdiv(num_values, row_dim), _aligned(row_dim)
    row_bytes = aligned + 4
    if gathered.dtype != torch.uint8 or gathered.numel() != num_replicas * num_rows * row_bytes:
        raise ValueError(f"mean_apply: expected {num_replicas} payloads of {num_rows} rows of {row_bytes} bytes "
                         f"(uint8), got {gathered.numel()} values of {gathered.dtype}")
    if not anchor_N.is_contiguous() or anchor_N.dtype != torch.float32:
        raise ValueError("mean_apply: the anchor must be a contiguous fp32 tensor (it is updated in place)")
    if w.numel() != num_values:
        raise ValueError(f"mean_apply: the tensor holds {w.numel()} values, the anchor {num_values}")
    write_w = w.dtype == torch.float32 and w.is_contiguous()
    if num_rows:
        block_r, block_c = _row_launch(row_dim)
        _mean_apply_kernel[(_cdiv(num_rows, block_r),)](
            gathered.reshape(-1).contiguous(), anchor_N, w if write_w else anchor_N, num_values, num_rows,
            num_rows * row_bytes,
            NUM_REPLICAS=num_replicas, INV_REPLICAS=1.0 / num_replicas, WRITE_W=write_w,
            ROW_DIM=row_dim, ALIGNED=aligned, ROW_BYTES=row_bytes, BLOCK_R=block_r, BLOCK_C=block_c,
            # `anchor + total * (1/R)` rounds twice, as the reference does: no fused multiply-add.
            num_warps=4, enable_fp_fusion=False, IS_E4M3=is_e4m3,
        )
    if not write_w:
        w.copy_(anchor_N.view_as(w))


# --------------------------------------------------------------------------------------------
# BF16
# --------------------------------------------------------------------------------------------


@triton.jit
def _delta_encode_bf16_kernel(
    w_ptr,
    anchor_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    n,
    BF16_BITS: tl.constexpr,
    HAS_RES: tl.constexpr,
    FEEDBACK: tl.constexpr,
    LIMIT: tl.constexpr,
    SW_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = _load_fp32(w_ptr + offs, mask, BF16_BITS) - tl.load(anchor_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        d = d + tl.load(res_ptr + offs, mask=mask, other=0.0)
    # The codec's clamped cast; out_ptr is bf16 (an int16 view with SW_BF16).
    sent = _store_clamped(out_ptr, offs, mask, d, LIMIT, SW_BF16)
    if FEEDBACK:
        tl.store(res_out_ptr + offs, d - sent, mask=mask)


@triton.jit(do_not_specialize=["replica_elems"])
def _mean_apply_bf16_kernel(
    payload_ptr,
    anchor_ptr,
    w_ptr,
    n,
    replica_elems,
    NUM_REPLICAS: tl.constexpr,
    INV_REPLICAS: tl.constexpr,
    WRITE_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(NUM_REPLICAS):
        # bf16 payloads (an int16 view) widened by a shift: exact.
        value = _load_fp32(payload_ptr + r * replica_elems.to(tl.int64) + offs, mask, True)
        if r == 0:
            total = value
        else:
            total = total + value
    _apply_mean(anchor_ptr, w_ptr, offs, mask, total, INV_REPLICAS, WRITE_W)


def delta_encode_bf16(
    w: Tensor, anchor_N: Tensor, residual_N: Tensor | None, *, feedback: bool
) -> tuple[Tensor, Tensor | None]:
    """The BF16 payload of ``d = (w - anchor) + residual`` (clamped to bf16's range, as the
    codec casts) and, with `feedback`, the new residual ``d - payload``, in one pass.

    Returns:
        (bf16 payload, flat N; the new fp32 residual (N) or None).
    """
    _check_runnable(anchor_N)
    n = anchor_N.numel()
    if w.numel() != n or (residual_N is not None and residual_N.numel() != n):
        raise ValueError("delta_encode_bf16: w, anchor and residual must hold the same number of values")
    w_N, bf16_bits = _as_loadable(w.reshape(-1))
    anchor_N = anchor_N.reshape(-1).contiguous()
    out = torch.empty(n, dtype=torch.bfloat16, device=anchor_N.device)
    res_out = torch.empty_like(anchor_N) if feedback else None
    sw_bf16 = INTERPRETED
    if n:
        res_in = residual_N.reshape(-1).contiguous() if residual_N is not None else anchor_N
        _delta_encode_bf16_kernel[(_cdiv(n, _CAST_BLOCK),)](
            w_N, anchor_N, res_in, out.view(torch.int16) if sw_bf16 else out,
            res_out if res_out is not None else anchor_N, n,
            BF16_BITS=bf16_bits, HAS_RES=residual_N is not None, FEEDBACK=feedback, LIMIT=_BF16_MAX,
            SW_BF16=sw_bf16, BLOCK=_CAST_BLOCK, num_warps=4, enable_fp_fusion=False,
        )
    return out, res_out


def mean_apply_bf16(gathered: Tensor, anchor_N: Tensor, w: Tensor, *, num_replicas: int) -> None:
    """:func:`mean_apply` for the R replicas' BF16 payloads (concatenated in replica order,
    any dtype viewed as their bytes): ``anchor + (d_0 + ... + d_{R-1}) * (1/R)`` into the
    anchor and `w`."""
    _check_runnable(anchor_N)
    n = anchor_N.numel()
    payload = gathered.reshape(-1).contiguous().view(torch.int16)
    if payload.numel() != num_replicas * n:
        raise ValueError(f"mean_apply_bf16: expected {num_replicas} payloads of {n} bf16 values, "
                         f"got {payload.numel()} values")
    if not anchor_N.is_contiguous() or anchor_N.dtype != torch.float32:
        raise ValueError("mean_apply_bf16: the anchor must be a contiguous fp32 tensor (it is updated in place)")
    if w.numel() != n:
        raise ValueError(f"mean_apply_bf16: the tensor holds {w.numel()} values, the anchor {n}")
    write_w = w.dtype == torch.float32 and w.is_contiguous()
    if n:
        _mean_apply_bf16_kernel[(_cdiv(n, _CAST_BLOCK),)](
            payload, anchor_N, w if write_w else anchor_N, n, n,
            NUM_REPLICAS=num_replicas, INV_REPLICAS=1.0 / num_replicas, WRITE_W=write_w, BLOCK=_CAST_BLOCK,
            # `anchor + total * (1/R)` rounds twice, as the reference does: no fused multiply-add.
            num_warps=4, enable_fp_fusion=False,
        )
    if not write_w:
        w.copy_(anchor_N.view_as(w))
