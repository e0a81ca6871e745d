"""Launch forms of the static-scale cast that writes both layouts (``loka::tensorwise_quant_static``
with ``both``), each launch timed on its own and against the device's copy bandwidth, on the GPU.

The static cast is three launches: the cast pass (codes of both layouts and one amax a program),
one program that checks the slot's scale against the amax (``_static_check_kernel``) and the
gated recast (its programs read the gate and exit where the scale fits). This benchmark times
each launch alone (CUDA-graph replays, median microseconds), the whole cast as the package runs
it, and persistent forms of the cast pass: a grid of a few programs per multiprocessor that loop
over the tiles (``tl.range`` with ``num_stages`` loads in flight), which also leaves the check
one amax per program to read instead of one per tile. Every form's payloads, scale and slot are
checked bit for bit against the package's before it is timed. The floor is a device-to-device
copy moving the same bytes (``copy`` rows: read ``x``, write as many bytes as the casts do).

    python -m bench.cast_variants --out DIR [--m 32768] [--ks 4096,2048,1024]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

from loka_train.kernels.triton_tensorwise import _codes, _input, _tile_amax

PERSISTENT = list(itertools.product((32, 64), (128,), (4, 8), (1, 3), (2, 4, 8)))
"""(rows, columns, warps, num_stages, programs per multiprocessor) of the persistent cast."""


@triton.jit
def _cast_both_persistent(x_ptr, scale_ptr, q_ptr, qt_ptr, R, C, partial_ptr,
                          FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
                          FMA_DIV: tl.constexpr, STAGES: tl.constexpr):
    """The package's two-layout tile cast (contiguous input) on a persistent grid: program ``p``
    casts tiles ``p, p + P, ...`` and stores one amax, of all its tiles."""
    tiles_c = tl.cdiv(C, BLOCK_C)
    num_tiles = tl.cdiv(R, BLOCK_R) * tiles_c
    amax = tl.zeros((), tl.float32)
    for t in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=STAGES):
        rows = (t // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (t % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = rows[:, None].to(tl.int64) * C + cols[None, :]
        x = _input(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), False)
        q = _codes(x, scale_ptr, FP8_MAX, Q_MANT, Q_SUB_MAGIC, Q_MIN_NORMAL, FMA_DIV).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + offs, q, mask=mask)
        tl.store(qt_ptr + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)
        amax = tl.maximum(amax, _tile_amax(x))
    tl.store(partial_ptr + tl.program_id(0), amax)


def _graph_us(fn: Any) -> float:
    """Median microseconds of ``fn`` replayed as a CUDA graph."""
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200) * 1e3


def _bench_k(m: int, k: int, rows: list[dict]) -> None:
    import torch

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format
    from loka_train.kernels.triton_kernels import _sw_round_args

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    fmt_ = tt._triton_fmt(Fp8Format.E4M3.value)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def row(name: str, us: float, nbytes: int) -> None:
        rows.append({"m": m, "k": k, "kernel": name, "us": us, "tb_s": nbytes / (us * 1e-6) / 1e12})

    # The floor: a copy reading x once and writing 2 bytes an element (the two FP8 payloads).
    dst = torch.empty_like(x)
    row("copy bf16 -> bf16 (4 B/elem)", _graph_us(lambda: dst.copy_(x)), 4 * n)
    half = torch.empty(m * k // 2, device="cuda", dtype=torch.bfloat16)
    flat = x.view(-1)
    row("copy half of x (3 B/elem of x: read 2, write 1)", _graph_us(lambda: half.copy_(flat[: n // 2])), 2 * n)

    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    tt.tensorwise_quant_static(x, slot, both=True)  # seeds the slot
    ref_slot = slot.clone()
    ref_q, ref_s, ref_qt = tt.tensorwise_quant_static(x, ref_slot, both=True)
    assert float(ref_slot[ss.FALLBACKS]) == 0, "the seeded slot recast"
    row("package: static, both layouts (3 launches)",
        _graph_us(lambda: tt.tensorwise_quant_static(x, slot, both=True)), 4 * n)

    # The package's launches one by one.
    q = torch.empty_like(ref_q)
    q_t = torch.empty_like(ref_qt)
    num_tiles = tt._num_programs(x, True)
    partial = torch.empty(num_tiles, device=x.device, dtype=torch.float32)
    scale = torch.empty((), device=x.device, dtype=torch.float32)
    gate = torch.empty((), device=x.device, dtype=torch.int32)
    row("  launch 1: cast pass (tiles)", _graph_us(lambda: tt._cast(x, slot, q, q_t, fmt_, partial=partial)), 4 * n)

    def check(p: Any, count: int) -> None:
        tt._static_check_kernel[(1,)](
            p, count, slot, scale, gate, tt._reciprocal(fmt_.max), FP8_MAX=fmt_.max,
            HEADROOM=ss.headroom(Fp8Format.E4M3), RECIPROCAL=True, BLOCK=tt._FINAL_BLOCK, num_warps=4)

    row(f"  launch 2: check ({num_tiles} partials)", _graph_us(lambda: check(partial, num_tiles)), 4 * num_tiles)
    check(partial, num_tiles)
    row("  launch 3: gated recast (gate 0)", _graph_us(lambda: tt._cast(x, scale, q, q_t, fmt_, gate=gate)), 1)

    qr = _sw_round_args(q.dtype)
    for (br, bc, warps, stages, per_sm) in PERSISTENT:
        name = f"persistent {br}x{bc}, {warps} warps, {stages} stages, {per_sm}/SM"
        try:
            grid = min(sms * per_sm, tt._cdiv(m, br) * tt._cdiv(k, bc))
            part = torch.empty(grid, device=x.device, dtype=torch.float32)

            def cast(br: int = br, bc: int = bc, warps: int = warps, stages: int = stages, grid: int = grid,
                     part: Any = part) -> None:
                _cast_both_persistent[(grid,)](
                    x, slot, q, q_t, m, k, part, FP8_MAX=fmt_.max, BLOCK_R=br, BLOCK_C=bc, Q_MANT=qr["MANT"],
                    Q_SUB_MAGIC=qr["SUB_MAGIC"], Q_MIN_NORMAL=qr["MIN_NORMAL"], FMA_DIV=True, STAGES=stages,
                    num_warps=warps)

            q.zero_()
            q_t.zero_()
            cast()
            if not (torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
                    and torch.equal(q_t.view(torch.uint8), ref_qt.view(torch.uint8))
                    and float(part.max()) == float(partial.max())):
                raise AssertionError("payloads or amax differ from the package's")
            us = _graph_us(cast)
            check_us = _graph_us(lambda part=part, grid=grid: check(part, grid))
            row(name, us, 4 * n)
            rows[-1]["check_us"] = check_us
        except Exception as exc:  # a configuration that fails is reported, not fatal
            rows.append({"m": m, "k": k, "kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    del ref_s


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.cast_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--m", type=int, default=32768)
    ap.add_argument("--ks", default="4096,2048,1024")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for k in (int(v) for v in args.ks.split(",")):
        _bench_k(args.m, k, rows)
    gpu = torch.cuda.get_device_name()
    (args.out / "cast_variants.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    lines = [f"# Static two-layout cast: launches and persistent forms ({gpu}, CUDA-graph replays)", "",
             "| M | K | kernel | us | TB/s (min bytes) | check us |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['error']} | - | - |")
        else:
            chk = f"{r['check_us']:.1f}" if "check_us" in r else "-"
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['us']:.1f} | {r['tb_s']:.2f} | {chk} |")
    (args.out / "cast_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
