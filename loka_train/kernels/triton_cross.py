"""A DCN cross layer's second GEMM with the layer's elementwise tail in its epilogue.

Layer ``l`` of the low-rank cross network computes ``x_{l+1} = x0 * (u W^T + b) + x_l`` with
``u = x_l V^T`` (``(M, R)``, ``R`` the low rank) and ``x0``, ``x_l`` ``(M, N)`` (fp32 where the
embeddings are). Run as an FP8 GEMM writing ``z = u W^T + b`` and an elementwise kernel after
it, ``z`` makes a round trip through memory that the tail reads back. :func:`cross_epilogue_gemm`
computes the tile of ``z`` and applies the tail to it before it leaves the registers: it writes
``z`` (the backward needs it: ``d x0 = g * z``), ``x_{l+1}`` and, on request, ``x_{l+1}``'s bf16
copy (what the next layer's ``V`` GEMM reads), and reads ``z`` back never.

Numerics are those of the unfused path the sites run, the GEMM's accumulation order apart: the
FP8 products promoted to fp32 after every ``BLOCK_K`` of the contraction (``torch._scaled_mm``
without fast accumulation; the plan's ``fast_accum`` skips it), ``z`` is ``acc * sa * sb + b``
rounded once to bf16, then ``x_l + x0 * float(z)`` in fp32 (an ``addcmul``, one fused
multiply-add on the GPU; the Triton interpreter's rounds twice); :func:`cross_epilogue_reference`
is that path in PyTorch, the CPU oracle.

Shape legend: ``M`` rows (batch), ``R`` the rank (the GEMM's contraction), ``N`` the width.

Example (a GPU, or the Triton interpreter on the CPU)::

    z_MN, x_MN, copy_MN = cross_epilogue_gemm(u_q.data, u_q.scale, w_q.data, w_q.scale, bias, x0, x)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels.triton_kernels import (
    INTERPRETED,
    _check_runnable,
    _grouped_tile,
    _round_rne,
    _sw_round_args,
)

__all__ = ["CROSS_CONFIGS", "DEFAULT_CONFIG", "cross_epilogue", "cross_epilogue_gemm", "cross_epilogue_reference"]


@triton.jit
def _cross_epilogue_kernel(
    a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, x0_ptr, xl_ptr, z_ptr, out_ptr, copy_ptr,
    x0_desc, xl_desc, z_desc, out_desc, copy_desc, M, N, K,
    BF16_MANT: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_COPY: tl.constexpr, EPI_TMA: tl.constexpr,
    XL_IS_X0: tl.constexpr, FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One output tile a program; ``EPI_TMA``: the tail's tiles of ``x0`` and ``x_l`` come in,
    and ``z``, ``x_{l+1}`` and the copy go out, through the copy engine (tensor descriptors)
    instead of plain loads and stores. ``XL_IS_X0``: the first layer, ``x_l`` is ``x0``, read
    once. The products are promoted to fp32 after every ``BLOCK_K`` of the contraction (as
    ``torch._scaled_mm`` without fast accumulation), unless ``FAST_ACCUM``."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
        if FAST_ACCUM:
            acc = tl.dot(a, b.T, acc)
        else:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    zf = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    if HAS_BIAS:
        zf += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if BF16_MANT > 0:  # the interpreter's conversion truncates: round to nearest even first
        z = _round_rne(zf, BF16_MANT, 0.0, 0.0).to(tl.bfloat16)
    else:
        z = zf.to(tl.bfloat16)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if EPI_TMA:
        z_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], z)
        x0 = x0_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N])
        if XL_IS_X0:
            xl = x0
        else:
            xl = xl_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N])
    else:
        tl.store(z_ptr + offs, z, mask=inside)
        x0 = tl.load(x0_ptr + offs, mask=inside, other=0.0)
        if XL_IS_X0:
            xl = x0
        else:
            xl = tl.load(xl_ptr + offs, mask=inside, other=0.0)
    out = tl.fma(x0, z.to(tl.float32), xl)  # one rounding, as a compiled addcmul on the GPU
    if EPI_TMA:
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)
    else:
        tl.store(out_ptr + offs, out, mask=inside)
    if WRITE_COPY:
        if BF16_MANT > 0:
            out16 = _round_rne(out, BF16_MANT, 0.0, 0.0).to(tl.bfloat16)
        else:
            out16 = out.to(tl.bfloat16)
        if EPI_TMA:
            copy_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out16)
        else:
            tl.store(copy_ptr + offs, out16, mask=inside)


CROSS_CONFIGS: list[tuple[int, int, int, int, int, int, int]] = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, EPI_TMA)
    (128, 64, 128, 8, 4, 3, 0),
    (128, 64, 128, 8, 4, 3, 1),
    (128, 128, 128, 8, 8, 2, 1),
    (64, 128, 128, 8, 4, 3, 1),
    (128, 64, 64, 8, 4, 4, 1),
    (64, 64, 128, 8, 4, 3, 1),
    (64, 64, 128, 8, 4, 3, 0),
]
"""Tiles ``bench.cross_epilogue`` times :func:`cross_epilogue_gemm` with."""

DEFAULT_CONFIG = (64, 128, 128, 8, 4, 3, 1)
"""The tile :func:`cross_epilogue` runs, the tail's tiles through the copy engine: the fastest of
:data:`CROSS_CONFIGS` at DCN's 32768 x 512 x 3456 (``docs/performance.md``)."""


def _check(a_MR: Tensor, b_NR: Tensor, x0_MN: Tensor, xl_MN: Tensor | None, bias_N: Tensor | None) -> None:
    if a_MR.ndim != 2 or b_NR.ndim != 2 or b_NR.shape[1] != a_MR.shape[1]:
        raise ValueError(f"cross_epilogue_gemm needs a (M, R) and b (N, R) codes, got {tuple(a_MR.shape)}, "
                         f"{tuple(b_NR.shape)}")
    m, k = a_MR.shape
    n = b_NR.shape[0]
    streams = [x0_MN] if xl_MN is None else [x0_MN, xl_MN]
    if any(t.shape != (m, n) for t in streams):
        raise ValueError(f"cross_epilogue_gemm needs x0 and x_l of shape {(m, n)}, got "
                         f"{[tuple(t.shape) for t in streams]}")
    if any(t.dtype != torch.float32 for t in streams):
        raise ValueError(f"cross_epilogue_gemm takes fp32 x0 and x_l (the cross net's stream), got "
                         f"{[t.dtype for t in streams]}")
    if not all(t.is_contiguous() for t in (a_MR, b_NR, *streams)):
        raise ValueError("cross_epilogue_gemm needs contiguous operands")
    if k % 16:
        raise ValueError(f"cross_epilogue_gemm needs the rank R a multiple of 16 (tensor descriptors), got {k}")
    if n % 8:
        raise ValueError(f"cross_epilogue_gemm needs the width N a multiple of 8 (tensor descriptors), got {n}")
    if bias_N is not None and bias_N.shape != (n,):
        raise ValueError(f"cross_epilogue_gemm needs a bias of shape {(n,)}, got {tuple(bias_N.shape)}")


def cross_epilogue_gemm(
    a_MR: Tensor, a_scale: Tensor, b_NR: Tensor, b_scale: Tensor, bias_N: Tensor | None, x0_MN: Tensor,
    xl_MN: Tensor | None, *, write_copy: bool = True, fast_accum: bool = False,
    config: tuple[int, int, int, int, int, int, int] = DEFAULT_CONFIG,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``z = a b^T * sa * sb + bias`` (bf16), ``x_l + x0 * z`` (fp32) and its bf16 copy, in one
    kernel (module docstring).

    Args:
        a_MR: FP8 codes (``u``), tensor-wise ``a_scale`` (one element).
        b_NR: FP8 codes (``W``), tensor-wise ``b_scale``.
        bias_N: the bias, or None.
        x0_MN, xl_MN: fp32, contiguous; ``xl_MN`` None where ``x_l`` is ``x0`` (the first
            layer: read once).
        write_copy: also write ``x_{l+1}`` in bf16.
        fast_accum: accumulate the FP8 products without promoting them to fp32 every
            ``BLOCK_K`` (``GemmPlan.fast_accum``).
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, EPI_TMA)``.

    Returns:
        ``(z_MN, x_next_MN, copy_MN)``: bf16, fp32, bf16 (None without ``write_copy``).

    Raises:
        ValueError: for shapes, dtypes or layouts the kernel does not take.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check(a_MR, b_NR, x0_MN, xl_MN, bias_N)
    _check_runnable(a_MR)
    m, k = a_MR.shape
    n = b_NR.shape[0]
    z_MN = torch.empty((m, n), device=a_MR.device, dtype=torch.bfloat16)
    out_MN = torch.empty((m, n), device=a_MR.device, dtype=torch.float32)
    copy_MN = torch.empty((m, n), device=a_MR.device, dtype=torch.bfloat16) if write_copy else None
    xl = x0_MN if xl_MN is None else xl_MN
    bm, bn, bk, group, warps, stages, epi_tma = config
    if INTERPRETED or a_MR.device.type == "cpu":
        bm, bn, bk = min(bm, 32), min(bn, 32), min(bk, 32)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    written = copy_MN if copy_MN is not None else z_MN  # a stand-in where no copy is written
    descs = [TensorDescriptor.from_tensor(t, [bm, bn]) for t in (x0_MN, xl, z_MN, out_MN, written)]
    _cross_epilogue_kernel[grid](
        TensorDescriptor.from_tensor(a_MR, [bm, bk]), TensorDescriptor.from_tensor(b_NR, [bn, bk]),
        a_scale.float().reshape(1), b_scale.float().reshape(1), bias_N if bias_N is not None else z_MN, x0_MN, xl,
        z_MN, out_MN, written, *descs, m, n, k,
        BF16_MANT=_sw_round_args(torch.bfloat16)["MANT"], HAS_BIAS=bias_N is not None,
        WRITE_COPY=copy_MN is not None, EPI_TMA=bool(epi_tma), XL_IS_X0=xl_MN is None, FAST_ACCUM=fast_accum,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages,
    )
    return z_MN, out_MN, copy_MN


def _cross_epilogue_impl(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None, x0: Tensor,
                         xl: Tensor | None, fast_accum: bool) -> list[Tensor]:
    z, out, out16 = cross_epilogue_gemm(a, a_scale, b, b_scale, bias, x0, xl, fast_accum=fast_accum)
    assert out16 is not None
    return [z, out, out16]


@torch.library.custom_op("loka::cross_epilogue_gemm", mutates_args=())
def _cross_epilogue_op(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None, x0: Tensor,
                       xl: Tensor | None, fast_accum: bool) -> list[Tensor]:
    return _cross_epilogue_impl(a, a_scale, b, b_scale, bias, x0, xl, fast_accum)


@_cross_epilogue_op.register_fake
def _cross_epilogue_fake(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None, x0: Tensor,
                         xl: Tensor | None, fast_accum: bool) -> list[Tensor]:
    _check(a, b, x0, xl, bias)
    return [x0.new_empty(x0.shape, dtype=torch.bfloat16), torch.empty_like(x0),
            x0.new_empty(x0.shape, dtype=torch.bfloat16)]


def cross_epilogue(a_MR: Tensor, a_scale: Tensor, b_NR: Tensor, b_scale: Tensor, bias_N: Tensor | None,
                   x0_MN: Tensor, xl_MN: Tensor | None, *, fast_accum: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`cross_epilogue_gemm` with the copy, on :data:`DEFAULT_CONFIG`, as the op
    ``loka::cross_epilogue_gemm`` while code is traced (``opaque.tracing``), else directly.
    Not differentiable: ``kernels.linear``'s Function owns the gradients."""
    from loka_train.kernels import opaque

    if opaque.tracing():
        z, out, out16 = torch.ops.loka.cross_epilogue_gemm(a_MR, a_scale, b_NR, b_scale, bias_N, x0_MN, xl_MN,
                                                            fast_accum)
    else:
        z, out, out16 = _cross_epilogue_impl(a_MR, a_scale, b_NR, b_scale, bias_N, x0_MN, xl_MN, fast_accum)
    return z, out, out16


def cross_epilogue_reference(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None, x0: Tensor, xl: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The unfused path in PyTorch: the FP8 GEMM's ``z`` (fp32 products, bias added in fp32,
    rounded once to bf16), then ``torch.addcmul(xl, x0, z)`` (``xl`` None: ``x0``) and its bf16
    copy."""
    xl = x0 if xl is None else xl
    zf = (a.float() @ b.float().t()) * (a_scale.float() * b_scale.float())
    if bias is not None:
        zf = zf + bias.float()
    z = zf.to(torch.bfloat16)
    out = torch.addcmul(xl, x0, z.float())
    return z, out, out.to(torch.bfloat16)
