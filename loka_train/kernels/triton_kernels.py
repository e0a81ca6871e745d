"""Triton kernels: a fused row-wise FP8 quantizer, and what every loka Triton kernel shares.

:func:`fused_rowwise_quant` (op ``loka::rowwise_quant``): one pass over each row computes the
producer (optional LayerNorm with affine weight/bias, optional ReLU/SiLU), rounds it to the
input dtype, and writes its FP8 row-wise quantization (amax -> scale -> saturating cast),
optionally also the high-precision output (needed by backward) and the LayerNorm statistics
(mean, rstd) for ``aten.native_layer_norm_backward``.

Shared by ``triton_gemm``, ``triton_block`` and ``triton_layernorm``: :func:`triton_runnable`
(where the kernels run, and why not), the interpreter's software rounding (``_round_rne``,
``_sw_round_args``), the fixed-order partial-sum reduction (``_sum_parts``) and small launch
helpers.

Under torch.compile the wrappers call the custom ops (so the graph holds one opaque node with a
fake implementation); in eager mode they call the same implementation directly, skipping the
dispatcher's per-call overhead. Each kernel has a pure-PyTorch reference
(:func:`rowwise_quant_reference`) that is the CPU test oracle, and a fake implementation so
torch.compile traces through it. On CPU they run only under ``TRITON_INTERPRET=1`` (set before
triton is imported); otherwise they raise: there is no silent fallback to the reference.

Shape legend: ``M`` rows (batch), ``K`` contraction / normalized dim, ``N`` output features.

Example:
    >>> x_MK = torch.randn(64, 32)
    >>> q_MK, scale_M1, ln_MK, mean_M, rstd_M, _ = fused_rowwise_quant(
    ...     x_MK, layernorm=True, activation="none", fmt=Fp8Format.E4M3, return_hp=True)
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Fp8Format, Scaling, as_format, quantize

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "INTERPRETED",
    "MAX_QUANT_ROW",
    "triton_runnable",
    "fused_rowwise_quant",
    "rowwise_quant_reference",
]

ACTIVATIONS = ("none", "relu", "silu")
"""Activations the kernels can fuse; index = the kernel's ACT constexpr."""

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels were built for the Triton interpreter (read once, at import)."""

_FP32_TINY = float(torch.finfo(torch.float32).tiny)
MAX_QUANT_ROW = 16384
"""Longest row the fused quantizer takes (a row is held in registers)."""
_TL_FP8 = {Fp8Format.E4M3: tl.float8e4nv, Fp8Format.E5M2: tl.float8e5}


def triton_runnable(device: torch.device | str) -> tuple[bool, str]:
    """Whether these kernels can run on ``device``, and why not (checked once per device: it
    is asked for every operand on the hot path)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    if torch.compiler.is_compiling():  # dynamo does not trace through functools caches
        return _triton_runnable.__wrapped__(dev)
    return _triton_runnable(dev)


@functools.cache
def _triton_runnable(dev: torch.device) -> tuple[bool, str]:
    if dev.type == "cpu":
        if INTERPRETED:
            return True, ""
        return False, "Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported"
    if dev.type != "cuda":
        return False, f"Triton kernels run on CUDA (or CPU via the interpreter), not {dev.type}"
    if INTERPRETED:
        return False, "TRITON_INTERPRET=1 is set: kernels were built for the CPU interpreter"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        return False, f"FP8 tl.dot needs sm_89+, device is sm_{cap[0]}{cap[1]}"
    return True, ""


def _check_runnable(t: Tensor) -> None:
    ok, why = triton_runnable(t.device)
    if not ok:
        raise RuntimeError(f"cannot run the loka Triton kernel here: {why}")


def _act_id(activation: str) -> int:
    try:
        return ACTIVATIONS.index(activation)
    except ValueError:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}") from None


def _triton_fmt(fmt: Fp8Format | str) -> Fp8Format:
    fmt = as_format(fmt)
    if fmt not in _TL_FP8:
        raise ValueError(f"Triton kernels support e4m3 and e5m2, not {fmt.value}")
    return fmt


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of output tile ``tile`` in the grouped order: ``GROUP_M`` row tiles
    walk the columns together, sharing the ``B`` tiles they read while those are in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


# The Triton interpreter (3.8) rounds fp32 -> fp8/bf16 casts wrongly (half-up without carry
# into the exponent, so e.g. 124.7 -> 64 in e4m3). In interpreted builds the kernels first
# round to the target grid with round-to-nearest-even here, which makes the cast exact. On GPU
# the hardware conversion (cvt.rn) is used directly (SW_ROUND_MANT = 0).
@triton.jit
def _round_rne(v, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """Round fp32 ``v`` to MANT mantissa bits (RNE); below MIN_NORMAL to the subnormal step
    (SUB_MAGIC = 1.5 * 2**23 * step makes ``(v + SUB_MAGIC) - SUB_MAGIC`` round to it)."""
    SHIFT: tl.constexpr = 23 - MANT
    bits_in = v.to(tl.int32, bitcast=True)
    lsb = (bits_in >> SHIFT) & 1
    bits = (bits_in + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    if MIN_NORMAL > 0.0:
        sub = (tl.abs(v) + SUB_MAGIC) - SUB_MAGIC
        # The sign bit, not v < 0: -0.0 and negative values that flush to zero stay negative.
        sub = tl.where(bits_in < 0, -sub, sub)
        normal = tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)
    return tl.where(v != v, v, normal)  # NaN stays NaN (rounding its payload bits can give inf)


@functools.cache
def _sw_round_args(dtype: torch.dtype) -> dict[str, float | int]:
    """Constexprs for _round_rne targeting ``dtype`` (MANT=0: no software rounding)."""
    if not INTERPRETED:
        return {"MANT": 0, "SUB_MAGIC": 0.0, "MIN_NORMAL": 0.0}
    for f in (Fp8Format.E4M3, Fp8Format.E5M2):
        if f.dtype == dtype:
            return {"MANT": f.mantissa_bits, "SUB_MAGIC": 1.5 * 2.0**23 * f.min_subnormal,
                    "MIN_NORMAL": f.min_normal}
    if dtype == torch.bfloat16:
        return {"MANT": 7, "SUB_MAGIC": 0.0, "MIN_NORMAL": 0.0}
    return {"MANT": 0, "SUB_MAGIC": 0.0, "MIN_NORMAL": 0.0}


# --------------------------------------------------------------------------------------------
# fused producer + row-wise quantizer
# --------------------------------------------------------------------------------------------


@triton.jit
def _rowwise_quant_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    b_ptr,
    q_ptr,
    scale_ptr,
    hp_ptr,
    mean_ptr,
    rstd_ptr,
    amax_ptr,
    M,
    K,
    stride_xm,
    stride_gm,
    stride_qm,
    stride_hm,
    eps,
    FP8_MAX: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_LN: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
    STORE_HP: tl.constexpr,
    STORE_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HP_MANT: tl.constexpr,
    Q_MANT: tl.constexpr,
    Q_SUB_MAGIC: tl.constexpr,
    Q_MIN_NORMAL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32)
    if HAS_GATE:
        g = tl.load(gate_ptr + rows64[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
        y = tl.where(g > 0, y, 0.0)
    if HAS_LN:
        mean = tl.sum(y, axis=1) / K
        yc = tl.where(mask, y - mean[:, None], 0.0)
        var = tl.sum(yc * yc, axis=1) / K
        rstd = 1.0 / tl.sqrt(var + eps)
        y = yc * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_B:
            b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
    if ACT == 1:
        y = tl.maximum(y, 0.0)
    elif ACT == 2:
        y = y * tl.sigmoid(y)
    # Quantize exactly what the high-precision consumer sees: the value rounded to x's dtype.
    if HP_MANT > 0:
        y = _round_rne(y, HP_MANT, 0.0, 0.0)
    y_hp = y.to(x.dtype)
    if STORE_HP:
        tl.store(hp_ptr + rows64[:, None] * stride_hm + cols[None, :], y_hp, mask=mask)
    y = tl.where(mask, y_hp.to(tl.float32), 0.0)
    y_abs = tl.abs(y)
    amax = tl.max(y_abs, axis=1)
    # tl.max drops NaN: count non-finite values separately so the scale can carry NaN.
    num_bad = tl.sum(((y != y) | (y_abs == float("inf"))).to(tl.int32), axis=1)
    scale = tl.maximum(amax / FP8_MAX, 1.1754943508222875e-38)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(num_bad > 0, float("nan"), scale)
    q = tl.clamp(y / scale[:, None], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if Q_MANT > 0:
        q = _round_rne(q, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL)
    tl.store(
        q_ptr + rows64[:, None] * stride_qm + cols[None, :],
        q.to(q_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(scale_ptr + rows, scale, mask=rmask)
    if STORE_AMAX:
        # The tensor's amax, inf where a value is non-finite (the tensor-wise scale is NaN
        # either way, as the reference's is). One atomic per program: no second pass over h.
        block_amax = tl.max(tl.where(rmask & (num_bad > 0), float("inf"), amax), axis=0)
        tl.atomic_max(amax_ptr, block_amax)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The multiprocessors a persistent grid sizes itself by: a CUDA device's count; 2 elsewhere
    (the interpreter runs programs one by one; a small grid still has them loop)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _cdiv(a: int, b: int) -> int:
    # Plain Python: triton.cdiv / next_power_of_2 are constexpr functions, slow on the host.
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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


@functools.cache
def _quant_launch_params(k: int) -> tuple[int, int, int]:
    block_k = _next_pow2(max(k, 1))
    block_m = max(1, min(64, 4096 // block_k))
    num_warps = 4 if block_m * block_k <= 4096 else 8
    return block_m, block_k, num_warps


def _rowwise_quant_impl(
    x: Tensor,
    gate: Tensor | None,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    eps: float,
    layernorm: bool,
    activation: str,
    fmt: str,
    return_hp: bool,
    return_amax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    fmt_ = _triton_fmt(fmt)
    if x.ndim != 2:
        raise ValueError(f"rowwise_quant expects a 2-D input, got shape {tuple(x.shape)}")
    if not layernorm and (ln_weight is not None or ln_bias is not None):
        raise ValueError("ln_weight / ln_bias given without layernorm=True")
    act = _act_id(activation)
    _check_runnable(x)
    m, k = x.shape
    if k > MAX_QUANT_ROW:
        raise ValueError(f"rowwise_quant keeps a row in registers; K={k} > {MAX_QUANT_ROW}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
    q = torch.empty((m, k), device=x.device, dtype=fmt_.dtype)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    hp = torch.empty((m, k) if return_hp else (0,), device=x.device, dtype=x.dtype)
    stats_shape = (m,) if layernorm else (0,)
    mean = torch.empty(stats_shape, device=x.device, dtype=torch.float32)
    rstd = torch.empty(stats_shape, device=x.device, dtype=torch.float32)
    # Zero is the identity of the kernel's atomic max (amaxes are >= 0).
    amax = torch.zeros((1,) if return_amax else (0,), device=x.device, dtype=torch.float32)
    if m == 0 or k == 0:
        scale.fill_(1.0)
        return q, scale, hp, mean, rstd, amax
    block_m, block_k, num_warps = _quant_launch_params(k)
    qr = _sw_round_args(q.dtype)
    dummy = scale  # never read: the constexpr flags switch its use off
    _rowwise_quant_kernel[(_cdiv(m, block_m),)](
        x,
        gate if gate is not None else dummy,
        ln_weight if ln_weight is not None else dummy,
        ln_bias if ln_bias is not None else dummy,
        q,
        scale,
        hp if return_hp else dummy,
        mean if layernorm else dummy,
        rstd if layernorm else dummy,
        amax if return_amax else dummy,
        m,
        k,
        x.stride(0),
        gate.stride(0) if gate is not None else 0,
        q.stride(0),
        hp.stride(0) if return_hp else 0,
        float(eps),
        FP8_MAX=fmt_.max,
        HAS_GATE=gate is not None,
        HAS_LN=layernorm,
        HAS_W=ln_weight is not None,
        HAS_B=ln_bias is not None,
        ACT=act,
        STORE_HP=return_hp,
        STORE_AMAX=return_amax,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        HP_MANT=_sw_round_args(x.dtype)["MANT"],
        Q_MANT=qr["MANT"],
        Q_SUB_MAGIC=qr["SUB_MAGIC"],
        Q_MIN_NORMAL=qr["MIN_NORMAL"],
        num_warps=num_warps,
    )
    return q, scale, hp, mean, rstd, amax


@torch.library.custom_op("loka::rowwise_quant", mutates_args=())
def _rowwise_quant_op(
    x: Tensor,
    gate: Tensor | None,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    eps: float,
    layernorm: bool,
    activation: str,
    fmt: str,
    return_hp: bool,
    return_amax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _rowwise_quant_impl(
        x, gate, ln_weight, ln_bias, eps, layernorm, activation, fmt, return_hp, return_amax
    )


@_rowwise_quant_op.register_fake
def _rowwise_quant_fake(
    x, gate, ln_weight, ln_bias, eps, layernorm, activation, fmt, return_hp, return_amax
):
    m, k = x.shape
    q = x.new_empty((m, k), dtype=Fp8Format(fmt).dtype)
    scale = x.new_empty((m, 1), dtype=torch.float32)
    hp = x.new_empty((m, k) if return_hp else (0,))
    stats = (m,) if layernorm else (0,)
    f32 = torch.float32
    amax = x.new_empty((1,) if return_amax else (0,), dtype=f32)
    return q, scale, hp, x.new_empty(stats, dtype=f32), x.new_empty(stats, dtype=f32), amax


def fused_rowwise_quant(
    x_MK: Tensor,
    *,
    fmt: Fp8Format = Fp8Format.E4M3,
    gate: Tensor | None = None,
    layernorm: bool = False,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
    eps: float = 1e-5,
    activation: str = "none",
    return_hp: bool = False,
    return_amax: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Producer + row-wise FP8 quantization in one pass (op ``loka::rowwise_quant``).

    Computes ``h = act(layer_norm(x * (gate > 0)) * w + b)`` (each stage optional; the gate
    is ReLU's backward: ``dZ = dY * (Y > 0)``) in fp32, rounds it to
    ``x.dtype``, and quantizes each row: ``scale = amax(|h|) / fmt.max`` (1 for all-zero rows,
    NaN for rows with a non-finite value), ``q = saturate(h / scale)``.

    Args:
        x_MK: 2-D input, rows contiguous.
        fmt: e4m3 or e5m2.
        gate: optional tensor shaped like ``x``; elements where ``gate <= 0`` are zeroed.
        layernorm: normalize each row over K first.
        ln_weight: LayerNorm weight (K,), optional.
        ln_bias: LayerNorm bias (K,), optional.
        eps: LayerNorm epsilon.
        activation: "none", "relu" or "silu", applied after the LayerNorm.
        return_hp: also return ``h`` in ``x.dtype`` (what backward needs).
        return_amax: also return ``max |h|`` over the whole tensor (inf if any value is
            non-finite), the amax of a tensor-wise scale, with no second pass over ``h``.

    Returns:
        ``(q_MK, scale_M1, h_MK, mean_M, rstd_M, amax_1)``; ``h`` is empty (shape (0,))
        unless ``return_hp``; ``mean``/``rstd`` unless ``layernorm``; ``amax`` unless
        ``return_amax``.
    """
    args = (x_MK, gate, ln_weight, ln_bias, eps, layernorm, activation, Fp8Format(fmt).value,
            return_hp, return_amax)
    if opaque.tracing():
        return torch.ops.loka.rowwise_quant(*args)
    # Eager: skip the custom-op dispatcher (tens of microseconds per call on the hot path).
    return _rowwise_quant_impl(*args)


def rowwise_quant_reference(
    x_MK: Tensor,
    *,
    fmt: Fp8Format = Fp8Format.E4M3,
    gate: Tensor | None = None,
    layernorm: bool = False,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
    eps: float = 1e-5,
    activation: str = "none",
    return_hp: bool = False,
    return_amax: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pure-PyTorch reference of :func:`fused_rowwise_quant` (same signature and outputs)."""
    act = _act_id(activation)
    h = x_MK.float()
    if gate is not None:
        h = torch.where(gate > 0, h, torch.zeros_like(h))
    m, k = x_MK.shape
    mean = rstd = h.new_empty((0,))
    if layernorm:
        mean = h.mean(dim=1)
        var = (h - mean[:, None]).square().mean(dim=1)
        rstd = torch.rsqrt(var + eps)
        w = None if ln_weight is None else ln_weight.float()
        b = None if ln_bias is None else ln_bias.float()
        h = F.layer_norm(h, (k,), w, b, eps)
    if act == 1:
        h = torch.relu(h)
    elif act == 2:
        h = F.silu(h)
    h = h.to(x_MK.dtype)
    qt = quantize(h, fmt, Scaling.ROWWISE, axis=-1)
    hp = h if return_hp else h.new_empty((0,))
    amax = mean.new_empty((0,))
    if return_amax:
        hf = h.float()
        amax = torch.zeros(1, device=h.device)
        if hf.numel():
            amax = torch.where(hf.isfinite().all(), torch.linalg.vector_norm(hf, ord=math.inf), math.inf).reshape(1)
    return qt.data, qt.scale, hp, mean, rstd, amax
