"""What a tensor-wise FP8 GEMM costs when it casts its activation as it loads it, on the GPU.

The sites cast an activation to FP8 in a pass of its own (``loka::tensorwise_quant_static``:
read bf16, write the codes), then run the FP8 GEMM on the codes. Where the activation is wide
and the GEMM narrow (DCN's cross layers: ``32768 x 3456`` into a rank of 512), that pass costs
about what FP8 saves on the GEMM. :func:`castin_gemm` reads the bf16 activation tile by tile
and casts each tile in registers with the slot's static scale, codes bit for bit the static
cast's (:func:`loka_train.kernels.triton_tensorwise._codes`), before the FP8 ``tl.dot``: no pass
writes the codes, the GEMM reads twice the activation's bytes. With ``amax`` the programs of
the first column of output tiles also reduce the activation's amax (``tl.atomic_max``), which
the static scale's fit check needs (``kernels.static_scales``); this kernel runs no check and no
recast: it measures whether the form pays before the sites take it.

Timed per problem ``M x K x N`` (``a`` ``(M, K)`` bf16, the weight's codes ``(N, K)``): bf16
``torch.mm`` (cuBLAS); ``torch._scaled_mm`` on codes cast beforehand (the GEMM alone); the static
cast then ``torch._scaled_mm`` (as the sites run it); :func:`castin_gemm` with and without the
amax. Medians of ``triton.testing.do_bench`` (us). With ``--tma`` also
:func:`castin_gemm_tma` (the same cast, persistent, each operand's tiles brought in by the copy
engine) on each of ``TMA_CONFIGS``, with the same kernel on codes cast beforehand: how near its
mainloop comes to cuBLAS's, and what the cast in its loads adds.

    python -m bench.castin_gemm --out DIR [--shapes 32768x3456x512,32768x3456x1024] [--fmt e4m3] [--tma]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.static_scales import check_slot
from loka_train.kernels.triton_gemm import _gemm_config
from loka_train.kernels.triton_kernels import (
    INTERPRETED,
    _grouped_tile,
    _sw_round_args,
    _triton_fmt,
)
from loka_train.kernels.triton_tensorwise import _codes

__all__ = ["castin_gemm", "castin_gemm_reference", "main"]


@triton.jit
def _castin_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, sb_ptr, amax_ptr, M, N, K,
    FP8_MAX: tl.constexpr, Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
    A_E5M2: tl.constexpr, AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_in = offs_m < M
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] + (offs_n % N).to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    amax = tl.zeros((), tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        x = tl.load(a_ptrs, mask=m_in[:, None] & (offs_k[None, :] < k_left), other=0.0).to(tl.float32)
        if AMAX:
            if pid_n == 0:
                amax = tl.maximum(amax, tl.max(tl.where(x != x, float("inf"), tl.abs(x))))
        q = _codes(x, scale_ptr, FP8_MAX, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, False)
        if A_E5M2:
            a = q.to(tl.float8e5)
        else:
            a = q.to(tl.float8e4nv)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if AMAX:
        if pid_n == 0:
            tl.atomic_max(amax_ptr, amax)
    acc = acc * (tl.load(scale_ptr) * tl.load(sb_ptr))
    c_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=m_in[:, None] & (offs_n[None, :] < N))


CONFIGS = [
    _gemm_config(128, 256, 64, 8, 3),
    _gemm_config(128, 256, 128, 8, 2),
    _gemm_config(256, 128, 64, 8, 3),
    _gemm_config(128, 128, 128, 8, 3),
    _gemm_config(128, 128, 64, 4, 4),
    _gemm_config(128, 128, 128, 4, 3),
    _gemm_config(64, 256, 128, 4, 3),
]
"""Tiles tried on the GPU (the autotuner keeps the fastest per problem)."""

_tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "A_E5M2", "AMAX"], reset_to_zero=["amax_ptr"])(_castin_gemm_kernel)


def _check_operands(name: str, a: Tensor, slot: Tensor, fmt: Fp8Format, b: Tensor) -> Fp8Format:
    """``fmt`` as a Triton format, after refusing a bad slot, shapes that do not match or a
    non-contiguous operand (``name`` in the message)."""
    fmt = _triton_fmt(fmt)
    check_slot(slot, a.device)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name} needs a (M, K) and b (N, K), got {tuple(a.shape)}, {tuple(b.shape)}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"{name} needs contiguous operands")
    return fmt


def castin_gemm(a: Tensor, slot: Tensor, fmt: Fp8Format, b: Tensor, b_scale: Tensor, *,
                amax: bool = False) -> tuple[Tensor, Tensor]:
    """``(a / s) @ (b * b_scale)^T * s`` with ``a``'s codes cast in the GEMM's loads.

    Args:
        a: ``(M, K)`` bf16 (or fp32), contiguous: the activation.
        slot: its static-scale slot (``kernels.static_scales``) holding a scale (read, not updated).
        fmt: ``a``'s codes' format (e4m3; e5m2 for a gradient).
        b: ``(N, K)`` FP8 codes, contiguous: the weight, cast beforehand.
        b_scale: ``b``'s tensor-wise dequantization scale (one element).
        amax: also reduce ``a``'s amax (inf where a value is not finite).

    Returns:
        ``(c, amax)``: ``c`` ``(M, N)`` bf16; ``amax`` a one-element fp32 tensor (zero without
        ``amax``).

    Raises:
        ValueError: for shapes that do not match, a non-contiguous operand or a bad slot.
    """
    fmt = _check_operands("castin_gemm", a, slot, fmt, b)
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), device=a.device, dtype=torch.bfloat16)
    out_amax = torch.zeros(1, device=a.device, dtype=torch.float32)
    sw = _sw_round_args(fmt.dtype)
    args = (a, b, c, slot, b_scale.float().reshape(1), out_amax, m, n, k)
    flags = dict(FP8_MAX=fmt.max, Q_MANT=sw["MANT"], Q_SUB_MAGIC=sw["SUB_MAGIC"], Q_MIN_NORMAL=sw["MIN_NORMAL"],
                 A_E5M2=fmt is Fp8Format.E5M2, AMAX=amax)
    if INTERPRETED or a.device.type == "cpu":
        cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
        _castin_gemm_kernel[(triton.cdiv(m, 32) * triton.cdiv(n, 32),)](*args, **flags, **cfg)
    else:
        _tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    return c, out_amax


@triton.jit
def _castin_tma_kernel(
    a_desc, a_ptr, b_desc, c_desc, scale_ptr, sb_ptr, M, N, K,
    FP8_MAX: tl.constexpr, Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
    A_E5M2: tl.constexpr, CAST: tl.constexpr, SATFINITE: tl.constexpr, A_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    PAIR: tl.constexpr,
):
    """Persistent form of :func:`_castin_gemm_kernel`: the copy engine brings each operand's
    tiles in (tensor descriptors), each program walks output tiles ``NUM_PROGRAMS`` apart in the
    grouped order. With ``CAST`` the activation's tiles are bf16 and cast in registers as the
    static cast casts them (``_codes``: a power-of-two scale, as every static scale is,
    multiplies by its reciprocal); without, they are codes already (the GEMM's own speed, for
    comparison). ``SATFINITE`` (GPU only): the product by the scale's reciprocal goes to the
    format as it is, the conversion's own saturation (``cvt.rn.satfinite``) standing in for the
    clamp: the same codes where the scale is a power of two. ``A_TMA`` off: the activation's
    tiles come through plain loads (``a_ptr``) instead of the copy engine. ``PAIR``: a program's
    output tile is two column tiles wide, two accumulators fed by one cast of each activation
    tile (the cast runs once per ``2 * BLOCK_N`` columns instead of once per ``BLOCK_N``)."""
    start = tl.program_id(0)
    inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N * (2 if PAIR else 1))
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    out_scale = tl.load(scale_ptr) * tl.load(sb_ptr)
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        col = pid_n * BLOCK_N * (2 if PAIR else 1)
        for kk in range(k_tiles):
            if A_TMA:
                x = a_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            else:
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
                x = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
                            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            if CAST and SATFINITE:
                if A_E5M2:
                    a = (x.to(tl.float32) * inv).to(tl.float8e5)
                else:
                    a = (x.to(tl.float32) * inv).to(tl.float8e4nv)
            elif CAST:
                q = _codes(x.to(tl.float32), scale_ptr, FP8_MAX, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, False)
                if A_E5M2:
                    a = q.to(tl.float8e5)
                else:
                    a = q.to(tl.float8e4nv)
            else:
                a = x
            b = b_desc.load([col, kk * BLOCK_K])
            # Promoted to fp32 every BLOCK_K, as torch._scaled_mm accumulates without fast
            # accumulation (Triton's default on Hopper never promotes an FP8 dot).
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            if PAIR:
                b2 = b_desc.load([col + BLOCK_N, kk * BLOCK_K])
                acc2 = tl.dot(a, b2.T, acc2, max_num_imprecise_acc=BLOCK_K)
        c_desc.store([pid_m * BLOCK_M, col], (acc * out_scale).to(c_desc.dtype))
        if PAIR:
            c_desc.store([pid_m * BLOCK_M, col + BLOCK_N], (acc2 * out_scale).to(c_desc.dtype))


TMA_CONFIGS = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, PAIR)
    (128, 256, 64, 8, 8, 4, 0),
    (128, 256, 64, 8, 8, 3, 0),
    (64, 256, 64, 8, 8, 4, 1),
    (64, 256, 64, 8, 8, 3, 1),
    (64, 256, 128, 8, 8, 2, 1),
    (64, 256, 64, 8, 4, 4, 1),
    (128, 128, 64, 8, 8, 4, 1),
    (128, 128, 128, 8, 8, 3, 1),
]
"""Tiles :func:`castin_gemm_tma` is timed with on the GPU (``--tma``), each reported."""


def castin_gemm_tma(a: Tensor, slot: Tensor, fmt: Fp8Format, b: Tensor, b_scale: Tensor, *,
                    config: tuple[int, ...] = TMA_CONFIGS[0], num_programs: int | None = None,
                    cast: bool = True, satfinite: bool = False, a_tma: bool = True) -> Tensor:
    """:func:`castin_gemm` through the copy engine, persistent, on one tile config (no amax).

    ``a``: ``(M, K)`` bf16 with ``cast`` (cast with the slot's scale), else ``a``'s codes
    already in ``fmt``; ``b``: ``(N, K)``
    FP8 codes; ``config``: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``;
    ``num_programs``: the persistent grid (default: one per multiprocessor, on the CPU 4);
    ``satfinite`` and ``a_tma``: the kernel's ``SATFINITE`` and ``A_TMA``.
    Returns ``c`` ``(M, N)`` bf16.

    Raises:
        ValueError: for shapes that do not match, a non-contiguous operand, or a row not a
            multiple of 16 bytes (what a tensor descriptor needs).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    fmt = _check_operands("castin_gemm_tma", a, slot, fmt, b)
    m, k = a.shape
    n = b.shape[0]
    if k % 16 or n % 8:
        raise ValueError(f"castin_gemm_tma needs K a multiple of 16 and N of 8 (tensor descriptors), got K={k}, N={n}")
    bm, bn, bk, group, warps, stages, pair = (*config, 0)[:7]
    c = torch.empty((m, n), device=a.device, dtype=torch.bfloat16)
    sw = _sw_round_args(fmt.dtype)
    if num_programs is None:
        num_programs = 4 if a.device.type == "cpu" else torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(num_programs, triton.cdiv(m, bm) * triton.cdiv(n, bn * (2 if pair else 1))),)
    if satfinite and a.device.type == "cpu":
        raise ValueError("castin_gemm_tma(satfinite=True) relies on the GPU's saturating conversion")
    _castin_tma_kernel[grid](
        TensorDescriptor.from_tensor(a, [bm, bk]), a, TensorDescriptor.from_tensor(b, [bn, bk]),
        TensorDescriptor.from_tensor(c, [bm, bn]), slot, b_scale.float().reshape(1), m, n, k,
        FP8_MAX=fmt.max, Q_MANT=sw["MANT"], Q_SUB_MAGIC=sw["SUB_MAGIC"], Q_MIN_NORMAL=sw["MIN_NORMAL"],
        A_E5M2=fmt is Fp8Format.E5M2, CAST=cast, SATFINITE=satfinite, A_TMA=a_tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group, NUM_PROGRAMS=grid[0], PAIR=bool(pair), num_warps=warps, num_stages=stages,
    )
    return c


def castin_gemm_reference(a: Tensor, slot: Tensor, fmt: Fp8Format, b: Tensor, b_scale: Tensor) -> Tensor:
    """:func:`castin_gemm`'s result in PyTorch: the static cast's codes
    (``static_scales.quantize_static_reference`` on a copy of the slot: where the slot's scale
    does not fit ``a``, the dynamic cast's, which the kernel does not run), dequantized, times
    ``b``'s, in fp32, as bf16."""
    from loka_train.kernels.static_scales import quantize_static_reference

    q, s = quantize_static_reference(a, slot.clone(), fmt)
    return ((q.float() * s) @ (b.float() * b_scale.float()).t()).to(torch.bfloat16)


def _problem(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a problem as MxKxN, e.g. 32768x3456x512") from None
    if min(m, k, n) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return m, k, n


def _problems(text: str) -> list[tuple[int, int, int]]:
    """``--shapes``: problems ``MxKxN``, comma-separated."""
    out = [_problem(v) for v in text.split(",") if v]
    if not out:
        raise argparse.ArgumentTypeError("give at least one problem MxKxN")
    return out


def run(m: int, k: int, n: int, fmt: Fp8Format, *, tma: bool = False) -> dict[str, Any]:
    """Times of one problem (module docstring) and the castin result's largest difference from
    the static cast then ``torch._scaled_mm``, relative to that result's largest magnitude; with
    ``tma`` also :func:`castin_gemm_tma` and its GEMM on codes, on each of ``TMA_CONFIGS``."""
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Scaling, quantize

    dev = torch.device("cuda")
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = torch.randn(n, k, device=dev).to(torch.bfloat16) / k**0.5
    wq = quantize(w, Fp8Format.E4M3, Scaling.TENSORWISE)
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=dev)[0]
    tt.tensorwise_quant_static(a, slot, fmt=fmt)  # seeds the slot
    q, s, _ = tt.tensorwise_quant_static(a, slot, fmt=fmt)

    def scaled(qa: Tensor, sa: Tensor) -> Tensor:
        return torch._scaled_mm(qa, wq.data.t(), scale_a=sa.reshape(()).float(), scale_b=wq.scale.reshape(()).float(),
                                out_dtype=torch.bfloat16)

    ref = scaled(q, s)
    got, got_amax = castin_gemm(a, slot, fmt, wq.data, wq.scale, amax=True)
    rel = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    rel_tma: dict[str, float] = {}
    same: dict[str, bool] = {}
    amax_ok = float(got_amax) == float(a.float().abs().max())
    variants = {
        "bf16 torch.mm": lambda: a @ w.t(),
        "torch._scaled_mm on codes cast beforehand (GEMM alone)": lambda: scaled(q, s),
        "static cast then torch._scaled_mm (as the sites run it)":
            lambda: scaled(*tt.tensorwise_quant_static(a, slot, fmt=fmt)[:2]),
        "castin_gemm": lambda: castin_gemm(a, slot, fmt, wq.data, wq.scale),
        "castin_gemm with the amax": lambda: castin_gemm(a, slot, fmt, wq.data, wq.scale, amax=True),
    }
    if tma:
        for cfg in TMA_CONFIGS:
            tag = "x".join(str(v) for v in cfg)
            try:
                got_tma = castin_gemm_tma(a, slot, fmt, wq.data, wq.scale, config=cfg)
                got_codes = castin_gemm_tma(q, slot, fmt, wq.data, wq.scale, config=cfg, cast=False)
            except Exception as exc:  # a tile that does not fit this GPU's shared memory
                print(f"{m}x{k}x{n} tma {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rel_tma[tag] = float((got_tma.float() - ref.float()).abs().max() / ref.float().abs().max())
            rel_tma[tag + " codes"] = float((got_codes.float() - ref.float()).abs().max() / ref.float().abs().max())
            variants[f"castin_gemm_tma {tag}"] = functools.partial(
                castin_gemm_tma, a, slot, fmt, wq.data, wq.scale, config=cfg)
            variants[f"tma GEMM on codes {tag}"] = functools.partial(
                castin_gemm_tma, q, slot, fmt, wq.data, wq.scale, config=cfg, cast=False)
            for form, kw in (("satfinite", dict(satfinite=True)),
                             ("satfinite, plain loads", dict(satfinite=True, a_tma=False))):
                got_form = castin_gemm_tma(a, slot, fmt, wq.data, wq.scale, config=cfg, **kw)  # type: ignore[arg-type]
                rel_tma[f"{tag} {form}"] = float(
                    (got_form.float() - ref.float()).abs().max() / ref.float().abs().max())
                same[f"{tag} {form}"] = bool(torch.equal(got_form, got_tma))
                variants[f"castin_gemm_tma {tag} {form}"] = functools.partial(
                    castin_gemm_tma, a, slot, fmt, wq.data, wq.scale, config=cfg, **kw)
    times = {}
    for name, fn in variants.items():
        fn()
        times[name] = round(do_bench(fn) * 1e3, 1)
        print(f"{m}x{k}x{n} {fmt.value} {name}: {times[name]} us", flush=True)
    return {"m": m, "k": k, "n": n, "fmt": fmt.value, "us": times, "rel_diff_vs_scaled_mm": rel,
            "amax_matches": amax_ok, "rel_diff_tma": rel_tma, "same_as_tma_cast": same, "configs": {str(key): str(cfg) for key, cfg in _tuned.cache.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", type=_problems, default="32768x3456x512,32768x3456x1024,32768x4096x4096",
                    help="problems MxKxN, comma-separated")
    ap.add_argument("--fmt", choices=["e4m3", "e5m2"], default="e4m3", help="the activation's codes")
    ap.add_argument("--tma", action="store_true",
                    help="also time castin_gemm_tma and its GEMM on codes on each of TMA_CONFIGS")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run(m, k, n, Fp8Format(args.fmt), tma=args.tma) for m, k, n in args.shapes]
    (args.out / "castin_gemm.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "rows": rows}, indent=1))
    lines = ["| M x K x N | fmt | variant | us | diff from the cast then `_scaled_mm` |", "|---|---|---|---|---|"]
    for r in rows:
        diffs = {"castin_gemm": r["rel_diff_vs_scaled_mm"]} | {
            f"castin_gemm_tma {t}": d for t, d in r["rel_diff_tma"].items() if not t.endswith(" codes")} | {
            f"tma GEMM on codes {t[:-len(' codes')]}": d for t, d in r["rel_diff_tma"].items() if t.endswith(" codes")}
        for name, us in r["us"].items():
            diff = f"{diffs[name]:.1e}" if name in diffs else ""
            key = name.removeprefix("castin_gemm_tma ")
            if key in r["same_as_tma_cast"]:
                diff += ", bit for bit the clamped cast's" if r["same_as_tma_cast"][key] else ", NOT the clamped cast's"
            lines.append(f"| {r['m']} x {r['k']} x {r['n']} | {r['fmt']} | {name} | {us} | {diff} |")
        lines.append(f"| {r['m']} x {r['k']} x {r['n']} | {r['fmt']} | castin_gemm's amax is the activation's | "
                     f"{r['amax_matches']} | |")
    (args.out / "castin_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
