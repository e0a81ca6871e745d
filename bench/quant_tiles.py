"""Tile shapes of the tensor-wise quantizer that writes both layouts (``loka::tensorwise_quant_both``,
and in the sweep the static-scale cast with each tile too),
timed against the one-layout tensor-wise quantizer, the transposing one and the static-scale one
(``loka::tensorwise_quant_static``, where its scale fits and where it recasts), on the GPU.

Each configuration's output is checked bit for bit against the one-layout quantizer's payload
(or the static path's reference) and its transpose before it is timed
(``triton.testing.do_bench``, median microseconds). The bandwidth column counts the bytes each
kernel moves at least: its reads of the bf16 input (two for a dynamic scale, one for a static
scale that fits, two for a recast) and its writes of the FP8 payloads.

    python -m bench.quant_tiles --out DIR [--m 32768] [--ks 4096,2048,512] [--no-sweep] [--contexts] [--rowwise]
    python -m bench.quant_tiles --best DIR/quant_tiles.json   # prints "ROWS COLS WARPS" of the
                                                              # fastest configuration at the largest K
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIGS = [(r, c, w) for (r, c), w in itertools.product(((32, 128), (64, 64), (64, 128), (128, 64), (128, 128)), (4, 8))]
"""(rows, columns, warps) of one program of the two-layout cast."""


def checked_static_slot(x: Any, both: bool) -> tuple[Any, Any, Any]:
    """A static-scale slot seeded on ``x`` and the cast ``(q, q_t)`` it then gives, checked bit for
    bit against the PyTorch reference (payload, transpose, scale, slot; no recast)."""
    import torch

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format

    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    tt.tensorwise_quant_static(x, slot, both=both)  # seeds the slot
    ref_slot = slot.clone()
    q, s, q_t = tt.tensorwise_quant_static(x, slot, both=both)
    rq, rs = ss.quantize_static_reference(x, ref_slot, Fp8Format.E4M3)
    same_t = q_t is None or torch.equal(q_t.view(torch.uint8), rq.t().contiguous().view(torch.uint8))
    if not (torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs) and same_t
            and torch.equal(slot, ref_slot) and float(slot[ss.FALLBACKS]) == 0):
        raise AssertionError(f"static-scale payload ({'both layouts' if both else 'one layout'}) differs from "
                             "the reference")
    return slot, q, q_t


def _bench_static(x: Any, row: Callable[[str, float, int], None]) -> None:
    """The static-scale quantizer (``loka::tensorwise_quant_static``) where its scale fits (one
    read of ``x``) and where it does not (the recast: a second cast pass), each checked bit for
    bit against the PyTorch reference first."""
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt

    n = x.numel()
    for both in (False, True):
        layouts = "both layouts" if both else "one layout"
        slot, _, _ = checked_static_slot(x, both)
        # Bytes moved at least: read bf16 once, write one or two FP8 payloads.
        row(f"static scale fits ({layouts})",
            do_bench(lambda slot=slot, both=both: tt.tensorwise_quant_static(x, slot, both=both)) * 1e3,
            (4 if both else 3) * n)

        # A stale power-of-two scale far too large for x: every call recasts (and re-seeds, so
        # reset it each time); a recast reads x twice and writes the payloads twice.
        stale = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]

        def recast(stale: Any = stale, both: bool = both) -> None:
            stale[ss.SCALE] = 2.0**20
            tt.tensorwise_quant_static(x, stale, both=both)

        row(f"static scale recast ({layouts})", do_bench(recast) * 1e3, (8 if both else 6) * n)


DATA = {
    "randn": lambda t: t,
    "relu": lambda t: t.clamp_min(0),
    "grad 1e-6": lambda t: t * 1e-6,
}
"""Operand data of ``--contexts``: what the training step feeds the two-layout cast (activations
behind a ReLU, gradients of a small magnitude) beside the benchmark's standard normal."""


def _bench_contexts(m: int, k: int, rows: list[dict]) -> None:
    """The two-layout cast, dynamic and static, per data kind and format, alone and right after
    a bf16 GEMM of the step's size (the difference of the two timings): whether the data, the
    format or a GPU kept busy by GEMMs explains a cast slower in the step than alone."""
    import torch
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format

    base = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    gemm_us = do_bench(lambda: a @ w) * 1e3
    for data, make in DATA.items():
        x = make(base).contiguous()
        for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
            slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
            tt.tensorwise_quant_static(x, slot, fmt=fmt, both=True)  # seeds
            runs = {
                "dynamic": lambda x=x, fmt=fmt: tt.tensorwise_quant_both(x, fmt=fmt),
                "static": lambda x=x, fmt=fmt, slot=slot: tt.tensorwise_quant_static(x, slot, fmt=fmt, both=True),
            }
            for kind, run in runs.items():
                alone = do_bench(run) * 1e3
                after = do_bench(lambda run=run: (a @ w, run())) * 1e3 - gemm_us
                nbytes = (6 if kind == "dynamic" else 4) * x.numel()  # the dynamic cast reads x twice
                rows.append({"m": m, "k": k, "kernel": f"two layouts, {kind}, {data}, {fmt.value}", "us": alone,
                             "tb_s": nbytes / (alone * 1e-6) / 1e12, "us_after_gemm": after})
            if float(slot[ss.FALLBACKS]):
                rows.append({"m": m, "k": k, "kernel": f"static, {data}, {fmt.value}",
                             "error": f"{int(slot[ss.FALLBACKS])} recasts while timed"})


def _bench_k(m: int, k: int, rows: list[dict], sweep: bool = True) -> None:
    import torch
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_block as tb
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    ref_q, ref_s = tt.tensorwise_quant(x)
    amax = x.float().abs().amax().reshape(1)

    def row(name: str, us: float, nbytes: int) -> None:
        rows.append({"m": m, "k": k, "kernel": name, "us": us, "tb_s": nbytes / (us * 1e-6) / 1e12})

    row("tensorwise (one layout)", do_bench(lambda: tt.tensorwise_quant(x)) * 1e3, 5 * n)
    row("transposed tensorwise (amax given)", do_bench(lambda: tb.transposed_quant(x, amax=amax)) * 1e3, 3 * n)
    _bench_static(x, row)
    defaults = (tt._TILE_R, tt._TILE_C, tt._BOTH_WARPS)
    for tile_r, tile_c, warps in CONFIGS if sweep else [defaults]:
        name = f"both layouts {tile_r}x{tile_c}, {warps} warps"
        tt._TILE_R, tt._TILE_C, tt._BOTH_WARPS = tile_r, tile_c, warps
        try:
            q, s, q_t = tt.tensorwise_quant_both(x)
            same = (torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
                    and torch.equal(q_t.view(torch.uint8), ref_q.t().contiguous().view(torch.uint8)))
            if not same:
                raise AssertionError("payload differs from the one-layout quantizer's")
            row(name, do_bench(lambda: tt.tensorwise_quant_both(x)) * 1e3, 6 * n)
            if sweep:  # the same tile for the static-scale cast (one read, amax partials on the way)
                slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
                tt.tensorwise_quant_static(x, slot, both=True)  # seeds
                ref_slot = slot.clone()
                sq, sscale, sq_t = tt.tensorwise_quant_static(x, slot, both=True)
                rq, rs = ss.quantize_static_reference(x, ref_slot, Fp8Format.E4M3)
                if not (sq_t is not None and torch.equal(sq.view(torch.uint8), rq.view(torch.uint8))
                        and torch.equal(sscale, rs) and float(slot[ss.FALLBACKS]) == 0
                        and torch.equal(sq_t.view(torch.uint8), rq.t().contiguous().view(torch.uint8))):
                    raise AssertionError(f"static {tile_r}x{tile_c}, {warps} warps: payload differs from the reference")
                row(f"static {tile_r}x{tile_c}, {warps} warps",
                    do_bench(lambda slot=slot: tt.tensorwise_quant_static(x, slot, both=True)) * 1e3, 4 * n)
        except Exception as exc:  # a configuration that fails is reported, not fatal
            rows.append({"m": m, "k": k, "kernel": name, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            tt._TILE_R, tt._TILE_C, tt._BOTH_WARPS = defaults


ROWWISE_CONFIGS = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16)]
"""(rows, warps) of one program of the row-wise quantizer (``loka::rowwise_quant``) that
``--rowwise`` times; the kernel holds whole rows."""


def _bench_rowwise(m: int, k: int, rows: list[dict]) -> None:
    """The row-wise quantizer per launch configuration, on a plain bf16 ``x`` and with the
    ReLU-backward gate (``dZ = dY * (Y > 0)``), each checked bit for bit against the default
    configuration's output before it is timed."""
    import torch
    from triton.testing import do_bench

    from loka_train.kernels import triton_kernels as tk

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    default = tk._quant_launch_params
    runs = {"plain": lambda: tk.fused_rowwise_quant(x), "gated": lambda: tk.fused_rowwise_quant(x, gate=gate)}
    refs = {name: run()[:2] for name, run in runs.items()}
    block_k = tk._next_pow2(k)
    for block_m, warps in ROWWISE_CONFIGS:
        tk._quant_launch_params = lambda k_, bm=block_m, w=warps: (bm, tk._next_pow2(k_), w)
        try:
            for name, run in runs.items():
                label = f"row-wise {name} {block_m}x{block_k}, {warps} warps"
                try:
                    q, scale = run()[:2]
                    if not (torch.equal(q.view(torch.uint8), refs[name][0].view(torch.uint8))
                            and torch.equal(scale, refs[name][1])):
                        raise AssertionError("payload differs from the default configuration's")
                    nbytes = (5 if name == "gated" else 3) * x.numel()  # bf16 x (and gate) read, FP8 written
                    us = do_bench(run) * 1e3
                    rows.append({"m": m, "k": k, "kernel": label, "us": us, "tb_s": nbytes / (us * 1e-6) / 1e12})
                except Exception as exc:  # a configuration that fails is reported, not fatal
                    rows.append({"m": m, "k": k, "kernel": label, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            tk._quant_launch_params = default


_SWEEP_ROW = re.compile(r"both layouts (\d+)x(\d+), (\d+) warps")
"""The name of a tile sweep's row (``--contexts`` rows are named otherwise)."""


def best_config(rows: list[dict]) -> tuple[int, int, int]:
    """(rows, columns, warps) of the fastest two-layout configuration at the largest K timed."""
    k = max(r["k"] for r in rows)
    timed = [(r, m) for r in rows if r["k"] == k and "us" in r and (m := _SWEEP_ROW.fullmatch(r["kernel"]))]
    if not timed:
        raise SystemExit(f"no two-layout configuration was timed at K={k}")
    _, best = min(timed, key=lambda rm: rm[0]["us"])
    return int(best[1]), int(best[2]), int(best[3])


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.quant_tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--best", type=Path, metavar="JSON", help="print the fastest configuration of a result")
    ap.add_argument("--m", type=int, default=32768)
    ap.add_argument("--ks", default="4096,2048,512")
    ap.add_argument("--no-sweep", action="store_true", help="only the default tile of the two-layout cast")
    ap.add_argument("--rowwise", action="store_true",
                    help="also the row-wise quantizer per launch configuration (rows a program, warps)")
    ap.add_argument("--contexts", action="store_true",
                    help="also the two-layout cast per data kind and format, alone and after a GEMM")
    args = ap.parse_args(argv)
    if args.best is not None:
        print(*best_config(json.loads(args.best.read_text())["rows"]))
        return
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for k in (int(v) for v in args.ks.split(",")):
        _bench_k(args.m, k, rows, sweep=not args.no_sweep)
        if args.contexts:
            _bench_contexts(args.m, k, rows)
        if args.rowwise:
            _bench_rowwise(args.m, k, rows)
    gpu = torch.cuda.get_device_name()
    (args.out / "quant_tiles.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    lines = [f"# Two-layout tensor-wise quantizer tiles ({gpu})", "",
             "| M | K | kernel | us | TB/s (min bytes) | us right after a GEMM |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['error']} | - | - |")
        else:
            after = f"{r['us_after_gemm']:.1f}" if "us_after_gemm" in r else "-"
            lines.append(f"| {r['m']} | {r['k']} | {r['kernel']} | {r['us']:.1f} | {r['tb_s']:.2f} | {after} |")
    (args.out / "quant_tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
