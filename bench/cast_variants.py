"""Launch forms of the static-scale casts (``loka::tensorwise_quant_static``, one layout and both),
timed launch by launch and against the device's copy bandwidth, on the GPU.

The static cast is three launches: the cast pass (the codes and one amax a program), one program
that checks the slot's scale against the amaxes (``_static_check_kernel``) and the gated recast
(its programs read the gate and exit where the scale fits). The cast pass runs on a persistent
grid (``triton_tensorwise._PROGRAMS_PER_SM`` programs a multiprocessor, each looping over tiles
with ``_STAGES`` loads in flight), which also leaves the check one amax a program to read. This
benchmark sweeps those two settings and the tile (rows, columns, warps) of the two-layout cast;
``per-tile grid`` is one program a tile (a cap no grid reaches). Every configuration's payloads,
scale and slot are checked bit for bit against the PyTorch reference before it is timed (CUDA-graph
replays, median microseconds). The floor is a device-to-device copy moving as many bytes.

    python -m bench.cast_variants --out DIR [--m 32768] [--ks 4096,512]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

PER_TILE = 1 << 30
"""A programs-a-multiprocessor cap no grid reaches: one program a tile."""
GRIDS = [(PER_TILE, 1), (2, 3), (4, 1), (4, 3), (8, 3)]
"""(programs a multiprocessor, stages) of the cast pass."""
TILES = [(32, 128, 4), (64, 128, 4)]
"""(rows, columns, warps) of the two-layout cast."""


def _graph_us(fn: Any) -> float:
    """Median microseconds of ``fn`` replayed as a CUDA graph."""
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200) * 1e3


def _set(tt: Any, per_sm: int, stages: int, tile: tuple[int, int, int] | None) -> None:
    tt._PROGRAMS_PER_SM, tt._STAGES = per_sm, stages
    if tile is not None:
        tt._TILE_R, tt._TILE_C, tt._BOTH_WARPS = tile


def _bench_k(m: int, k: int, rows: list[dict]) -> None:
    import torch

    from bench.quant_tiles import checked_static_slot
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    fmt_ = tt._triton_fmt(Fp8Format.E4M3.value)

    def row(name: str, us: float, nbytes: int, **extra: Any) -> None:
        rows.append({"m": m, "k": k, "kernel": name, "us": us, "tb_s": nbytes / (us * 1e-6) / 1e12, **extra})
        print(f"{m} x {k} | {name} | {us:.1f} us | {rows[-1]['tb_s']:.2f} TB/s | {extra}", flush=True)

    dst = torch.empty_like(x)
    row("copy bf16 -> bf16", _graph_us(lambda: dst.copy_(x)), 4 * n)

    defaults = (tt._PROGRAMS_PER_SM, tt._STAGES, (tt._TILE_R, tt._TILE_C, tt._BOTH_WARPS))
    for both in (True, False):
        for (per_sm, stages), tile in itertools.product(GRIDS, TILES if both else [None]):
            grid = "per-tile grid" if per_sm == PER_TILE else f"{per_sm}/SM, {stages} stages"
            shape = f"{tile[0]}x{tile[1]}, {tile[2]} warps" if tile else "blocks of 8192, 8 warps"
            name = f"static {'both layouts' if both else 'one layout'}: {grid}, {shape}"
            try:
                _set(tt, per_sm, stages, tile)
                slot, q, q_t = checked_static_slot(x, both)
                whole = _graph_us(lambda slot=slot, both=both: tt.tensorwise_quant_static(x, slot, both=both))
                qq = torch.empty_like(q)
                qqt = torch.empty_like(q_t) if both else None
                programs = tt._num_programs(x, both)
                partial = torch.empty(programs, device=x.device, dtype=torch.float32)
                cast = _graph_us(lambda slot=slot, qq=qq, qqt=qqt, partial=partial: tt._cast(
                    x, slot, qq, qqt, fmt_, partial=partial))
                row(name, whole, (4 if both else 3) * n, cast_us=cast, programs=programs)
            except Exception as exc:  # a configuration that fails is reported, not fatal
                rows.append({"m": m, "k": k, "kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(f"{m} x {k} | {name} | {rows[-1]['error']}", flush=True)
            finally:
                _set(tt, *defaults)


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.cast_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--m", type=int, default=32768)
    ap.add_argument("--ks", default="4096,512")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for k in (int(v) for v in args.ks.split(",")):
        _bench_k(args.m, k, rows)
    gpu = torch.cuda.get_device_name()
    (args.out / "cast_variants.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    lines = [f"# Static-scale casts by launch form ({gpu}, CUDA-graph replays, median us)", "",
             "| M | K | kernel | whole cast us | TB/s (min bytes) | cast pass us | programs |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['error']} | - | - | - |")
        else:
            cast = f"{r['cast_us']:.1f}" if "cast_us" in r else "-"
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['us']:.1f} | {r['tb_s']:.2f} | {cast} | "
                         f"{r.get('programs', '-')} |")
    (args.out / "cast_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
