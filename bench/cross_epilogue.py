"""What DCN's cross-layer tail costs after its second GEMM, and in that GEMM's epilogue, on the GPU.

Layer ``l`` computes ``x_{l+1} = x0 * (u W^T + b) + x_l`` (``u`` ``(M, R)``, ``x0``, ``x_l``
``(M, N)`` fp32) and the next layer reads ``x_{l+1}``'s bf16 copy. Timed per problem ``M x R x N``:

* bf16: ``F.linear(u, W)`` then ``x0 * (z + b) + x_l`` and its copy compiled (TorchRec's
  formula, as the bf16 reference runs it);
* FP8 as the sites run it: ``torch._scaled_mm`` with the bias, then ``torch.addcmul`` and the copy
  compiled (``mods.interaction.CrossNet``'s epilogue fusion);
* :func:`loka_train.kernels.triton_cross.cross_epilogue_gemm` on each tile config: the tail in
  the GEMM's epilogue, ``z`` written for the backward and never read back.

The fused results are compared with the FP8 path's (``z`` and ``x_{l+1}``, largest difference
relative to the largest magnitude: the two GEMMs accumulate in different orders). Medians of
``triton.testing.do_bench`` (us).

    python -m bench.cross_epilogue --out DIR [--shapes 32768x512x3456,32768x512x1024]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.castin_gemm import _problems
from loka_train.kernels.triton_cross import CROSS_CONFIGS, cross_epilogue_gemm

__all__ = ["main", "run"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def run(m: int, r: int, n: int) -> dict[str, Any]:
    """Times and differences of one problem (module docstring)."""
    from triton.testing import do_bench

    from loka_train.kernels.formats import Fp8Format, Scaling, quantize

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    u = torch.randn(m, r, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, r, device=dev, generator=g) / r**0.5).to(torch.bfloat16)
    b = (torch.randn(n, device=dev, generator=g) / 10).to(torch.bfloat16)
    x0 = torch.randn(m, n, device=dev, generator=g)
    xl = torch.randn(m, n, device=dev, generator=g)
    uq = quantize(u, Fp8Format.E4M3, Scaling.TENSORWISE)
    wq = quantize(w, Fp8Format.E4M3, Scaling.TENSORWISE)

    @torch.compile(fullgraph=True)
    def bf16_tail(z: torch.Tensor, x0: torch.Tensor, xl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = x0 * (z + b) + xl
        return out, out.to(torch.bfloat16)

    @torch.compile(fullgraph=True)
    def fp8_tail(z: torch.Tensor, x0: torch.Tensor, xl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.addcmul(xl, x0, z)
        return out, out.to(torch.bfloat16)

    def bf16() -> Any:
        return bf16_tail(F.linear(u, w), x0, xl)

    def scaled() -> torch.Tensor:
        return torch._scaled_mm(uq.data, wq.data.t(), scale_a=uq.scale.reshape(()).float(),
                                scale_b=wq.scale.reshape(()).float(), bias=b, out_dtype=torch.bfloat16)

    def fp8() -> Any:
        z = scaled()
        return z, *fp8_tail(z, x0, xl)

    z_ref, out_ref, _ = fp8()
    variants: dict[str, Any] = {
        "bf16 F.linear then the compiled formula and copy": bf16,
        "FP8 _scaled_mm (GEMM alone)": scaled,
        "FP8 _scaled_mm then compiled addcmul and copy (the sites' form)": fp8,
    }
    diffs: dict[str, dict[str, float]] = {}
    for cfg in CROSS_CONFIGS:
        tag = "x".join(str(v) for v in cfg)
        try:
            z, out, _ = cross_epilogue_gemm(uq.data, uq.scale, wq.data, wq.scale, b, x0, xl, config=cfg)
        except Exception as exc:  # a tile that does not fit this GPU's shared memory
            print(f"{m}x{r}x{n} {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        diffs[tag] = {"z": _rel(z, z_ref), "x_next": _rel(out, out_ref)}
        variants[f"cross_epilogue_gemm {tag}"] = functools.partial(
            cross_epilogue_gemm, uq.data, uq.scale, wq.data, wq.scale, b, x0, xl, config=cfg)
    times = {}
    for name, fn in variants.items():
        fn()
        times[name] = round(do_bench(fn) * 1e3, 1)
        print(f"{m}x{r}x{n} {name}: {times[name]} us", flush=True)
    return {"m": m, "r": r, "n": n, "us": times, "rel_diff_vs_fp8": diffs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", type=_problems, default="32768x512x3456,32768x512x1024",
                    help="problems MxRxN (rows, rank, width), comma-separated")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run(m, r, n) for m, r, n in args.shapes]
    (args.out / "cross_epilogue.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    lines = ["| M x R x N | variant | us | z / x_next diff from the sites' FP8 form |", "|---|---|---|---|"]
    for row in rows:
        for name, us in row["us"].items():
            d = row["rel_diff_vs_fp8"].get(name.removeprefix("cross_epilogue_gemm "))
            diff = f"{d['z']:.1e} / {d['x_next']:.1e}" if d else ""
            lines.append(f"| {row['m']} x {row['r']} x {row['n']} | {name} | {us} | {diff} |")
    (args.out / "cross_epilogue.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
