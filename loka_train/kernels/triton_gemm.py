"""Triton FP8 GEMM with row-wise scales and a fused bias/activation epilogue.

:func:`fp8_gemm` (op ``loka::fp8_gemm``): ``act((a @ b^T) * sa[:, None] * sb[None, :] + bias)``
with ``a`` (M, K) and ``b`` (N, K) FP8 (K contiguous in both: the layout Hopper's FP8 wgmma
wants), per-row fp32 scales, optional bias, activation none/relu/silu, optionally also the
pre-activation. Autotuned over tiles for recommendation shapes (M 1k-64k, K and N 64-4096)
unless the caller asks for one fixed config (``autotune=False``).

Under torch.compile the wrapper calls the custom op; in eager mode it calls the implementation
directly. :func:`fp8_gemm_reference` is the pure-PyTorch reference (the CPU test oracle). On
CPU the kernel runs only under ``TRITON_INTERPRET=1`` (``triton_kernels.triton_runnable``).

Shape legend: ``M`` rows of ``a``, ``K`` contraction, ``N`` rows of ``b`` / output columns.

Example:
    >>> a_MK = quantize(torch.randn(64, 32), Fp8Format.E4M3, Scaling.ROWWISE)
    >>> w_NK = quantize(torch.randn(16, 32), Fp8Format.E4M3, Scaling.ROWWISE)
    >>> y_MN, _ = fp8_gemm(a_MK.data, w_NK.data, a_MK.scale, w_NK.scale, activation="relu")
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.triton_kernels import (
    _act_id,
    _cdiv,
    _check_runnable,
    _grouped_tile,
    _next_pow2,
    _round_rne,
    _sw_round_args,
    _triton_fmt,
)

logger = logging.getLogger(__name__)

__all__ = ["GEMM_CONFIGS", "fp8_gemm", "fp8_gemm_reference"]


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    pre_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    STORE_PRE: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    OUT_MANT: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped row indices keep the main loop free of M/N masks (the store is masked).
    offs_am = (offs_m % M).to(tl.int64)
    offs_bn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] + offs_bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            # Promote the tensor-core partial sums to fp32 every BLOCK_K elements.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    m_mask = offs_m < M
    n_mask = offs_n < N
    sa = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    c_offs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if STORE_PRE:
        pre = acc
        if OUT_MANT > 0:
            pre = _round_rne(pre, OUT_MANT, 0.0, 0.0)
        tl.store(pre_ptr + c_offs, pre.to(pre_ptr.dtype.element_ty), mask=c_mask)
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACT == 2:
        acc = acc * tl.sigmoid(acc)
    if OUT_MANT > 0:
        acc = _round_rne(acc, OUT_MANT, 0.0, 0.0)
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _gemm_config(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_warps=warps,
        num_stages=stages,
    )


GEMM_CONFIGS = [
    # Large K/N (1024-4096): big tiles, 2 warpgroups.
    _gemm_config(128, 256, 128, 8, 3),
    _gemm_config(256, 128, 128, 8, 3),
    _gemm_config(128, 128, 128, 8, 4),
    _gemm_config(128, 128, 128, 4, 4),
    # Medium (256-1024): smaller tiles keep 132 SMs busy at M = 2k-8k.
    _gemm_config(128, 64, 128, 4, 4),
    _gemm_config(64, 128, 128, 4, 4),
    _gemm_config(64, 64, 128, 4, 4),
    # Small K (64-128): K fits in one or two steps; parallelism comes from M.
    _gemm_config(128, 128, 64, 4, 3),
    _gemm_config(128, 64, 64, 4, 3),
    _gemm_config(64, 64, 64, 4, 3),
]
"""Autotuning space of :func:`fp8_gemm` on GPU (pruned by problem size)."""


def _prune_configs(configs, named_args, **kwargs):
    k, n = named_args["K"], named_args["N"]
    keep = [
        c
        for c in configs
        if c.kwargs["BLOCK_K"] <= max(64, _next_pow2(k))
        and c.kwargs["BLOCK_N"] <= max(64, _next_pow2(n))
    ]
    return keep or configs[-1:]


_fp8_gemm_tuned = triton.autotune(
    configs=GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACT", "STORE_PRE", "FAST_ACCUM"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_fp8_gemm_kernel)

_UNTUNED_GEMM_CONFIG = GEMM_CONFIGS[-1]
"""The smallest tiles (64x64x64): valid for every shape, fast for none."""

# Tuned config per problem key (M bucket, N, K, dtypes, epilogue flags): filled by the
# autotuner's first run, then used to launch the kernel without the autotuner in between.
_BEST_GEMM_CONFIG: dict[tuple, triton.Config] = {}

_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


def _as_row_scale(scale: Tensor, rows: int, name: str) -> Tensor:
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1).expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"{name} must have 1 or {rows} elements, got shape {tuple(scale.shape)}")
    return s.reshape(rows).contiguous()


def _fp8_gemm_impl(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    bias: Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    return_preact: bool,
    autotune: bool,
) -> tuple[Tensor, Tensor]:
    for name, t in (("a", a), ("b", b)):
        _triton_fmt(_fmt_of(t, name))
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm needs a (M, K) and b (N, K), got {tuple(a.shape)}, {tuple(b.shape)}")
    act = _act_id(activation)
    _check_runnable(a)
    m, k = a.shape
    n = b.shape[0]
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    sa = _as_row_scale(a_scale, m, "a_scale")
    sb = _as_row_scale(b_scale, n, "b_scale")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias must have {n} elements, got {bias.numel()}")
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    pre = torch.empty((m, n) if return_preact else (0,), device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return c, pre
    if k == 0:
        c.zero_()
        if bias is not None:
            c += bias.to(out_dtype)
        if return_preact:
            pre.copy_(c)
        c = {0: c, 1: torch.relu(c), 2: F.silu(c)}[act]
        return c, pre
    args = (
        a,
        b,
        c,
        sa,
        sb,
        bias if bias is not None else sa,
        pre if return_preact else c,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        _next_pow2(m),
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        ACT=act,
        STORE_PRE=return_preact,
        FAST_ACCUM=fast_accum,
        OUT_MANT=_sw_round_args(out_dtype)["MANT"],
    )
    if a.device.type == "cpu":
        cfg = _INTERPRETER_CONFIG
        cpu_grid = (_cdiv(m, cfg["BLOCK_M"]) * _cdiv(n, cfg["BLOCK_N"]),)
        _fp8_gemm_kernel[cpu_grid](*args, **flags, **cfg, num_warps=4)
    else:
        key = (args[-1], n, k, a.dtype, b.dtype, c.dtype, bias is not None, act, return_preact, fast_accum, autotune)
        best = _BEST_GEMM_CONFIG.get(key)
        if best is None and not autotune:
            best = _BEST_GEMM_CONFIG[key] = _UNTUNED_GEMM_CONFIG
        if best is None:

            def grid(meta):
                return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)

            _fp8_gemm_tuned[grid](*args, **flags)
            _BEST_GEMM_CONFIG[key] = _fp8_gemm_tuned.best_config
            logger.debug("fp8_gemm %s: tuned %s", key, _fp8_gemm_tuned.best_config)
        else:
            # Launch the tuned config directly: the autotuner's per-call bookkeeping is pure
            # host overhead once the choice is known.
            tuned_grid = (_cdiv(m, best.kwargs["BLOCK_M"]) * _cdiv(n, best.kwargs["BLOCK_N"]),)
            _fp8_gemm_kernel[tuned_grid](
                *args, **flags, **best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages
            )
    return c, pre


def _fmt_of(t: Tensor, name: str) -> Fp8Format:
    for f in Fp8Format:
        if f.dtype == t.dtype:
            return f
    raise ValueError(f"{name} must be an FP8 tensor, got {t.dtype}")


@torch.library.custom_op("loka::fp8_gemm", mutates_args=())
def _fp8_gemm_op(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    bias: Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    return_preact: bool,
    autotune: bool,
) -> tuple[Tensor, Tensor]:
    return _fp8_gemm_impl(
        a, b, a_scale, b_scale, bias, activation, out_dtype, fast_accum, return_preact, autotune
    )


@_fp8_gemm_op.register_fake
def _fp8_gemm_fake(a, b, a_scale, b_scale, bias, activation, out_dtype, fast_accum, return_preact, autotune):
    m, n = a.shape[0], b.shape[0]
    c = a.new_empty((m, n), dtype=out_dtype)
    pre = a.new_empty((m, n) if return_preact else (0,), dtype=out_dtype)
    return c, pre


def fp8_gemm(
    a_MK: Tensor,
    b_NK: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    *,
    bias_N: Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    return_preact: bool = False,
    autotune: bool = True,
) -> tuple[Tensor, Tensor]:
    """``act((a @ b^T) * a_scale * b_scale^T + bias)`` in one kernel (op ``loka::fp8_gemm``).

    Args:
        a_MK: FP8 (e4m3/e5m2) left operand, K contiguous.
        b_NK: FP8 right operand, K contiguous (a weight in ``nn.Linear`` layout).
        a_scale: fp32 dequantization scales of ``a``: (M, 1), (M,) or one element.
        b_scale: fp32 dequantization scales of ``b``: (N, 1), (N,) or one element.
        bias_N: optional bias, added in fp32.
        activation: "none", "relu" or "silu".
        out_dtype: output dtype (bf16, fp16 or fp32).
        fast_accum: let Hopper accumulate FP8 products in its reduced-precision accumulator
            for the whole K loop (faster); otherwise partial sums are promoted to fp32 every
            ``BLOCK_K`` elements.
        return_preact: also return the value before the activation (for SiLU backward).
        autotune: on a GPU, tune the tile config for each new problem; False launches one
            fixed config (``settings.KernelSettings.triton_autotune``).

    Returns:
        ``(out_MN, preact_MN)``; ``preact`` is empty (shape (0,)) unless ``return_preact``.
    """
    args = (a_MK, b_NK, a_scale, b_scale, bias_N, activation, out_dtype, fast_accum, return_preact, autotune)
    if opaque.tracing():
        return torch.ops.loka.fp8_gemm(*args)
    # Eager: skip the custom-op dispatcher (tens of microseconds per call on the hot path).
    return _fp8_gemm_impl(*args)


def fp8_gemm_reference(
    a_MK: Tensor,
    b_NK: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    *,
    bias_N: Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    return_preact: bool = False,
) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch reference of :func:`fp8_gemm` (fp32 math; ``fast_accum`` has no effect)."""
    act = _act_id(activation)
    m, n = a_MK.shape[0], b_NK.shape[0]
    acc = a_MK.float() @ b_NK.float().t()
    acc = acc * _as_row_scale(a_scale, m, "a_scale")[:, None] * _as_row_scale(b_scale, n, "b_scale")[None, :]
    if bias_N is not None:
        acc = acc + bias_N.float()[None, :]
    pre = acc.to(out_dtype) if return_preact else acc.new_empty((0,), dtype=out_dtype)
    out = {0: acc, 1: torch.relu(acc), 2: F.silu(acc)}[act]
    return out.to(out_dtype), pre
