"""The per-GEMM ledger at named shapes, without a model: each GEMM role in bf16 and with every
FP8 candidate (scaling x backend), the GEMM alone and each operand's quantization as a site
runs it, and the bandwidth each quantizer reaches.

Shapes are (M, K, N) of a Linear's forward at batch ``--batch``; the backward GEMMs follow
(grad-input ``M x N x K``, grad-weight ``N x M x K``). The default set is the large GEMMs of the
Wukong-style config (over-arch and MLPs) and DCN's top MLP.

Usage (GPU):
    python -m bench.ledger_shapes --out $OUT/ledger_shapes --batch 32768
    python -m bench.ledger_shapes --out /tmp/ls --batch 32 --shapes dcn_top.1 --backends emulated  # CPU, seconds
Writes ``ledger.json`` and ``ledger.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch

from loka_train.dispatch.ledger import LedgerGemm, measure_ledger
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan

ROLES = ("forward", "grad_input", "grad_weight")

SHAPES: dict[str, tuple[int, int]] = {
    # (K, N) of the Linear; M is the batch.
    "over_arch.0": (4096, 4096),
    "over_arch.1": (4096, 2048),
    "wukong_mlp.out": (4096, 2048),
    "wukong_mlp.in": (512, 4096),
    "over_arch.2": (2048, 1024),
    "dcn_top.0": (1024, 1024),
    "dcn_top.1": (1024, 512),
}


def role_shape(role: str, m: int, k: int, n: int) -> tuple[int, int, int]:
    return {"forward": (m, k, n), "grad_input": (m, n, k), "grad_weight": (n, m, k)}[role]


def candidates(role: str, backends: list[str], scalings: list[Scaling]) -> tuple[GemmPlan, ...]:
    """Every FP8 candidate of ``role``: that GEMM of each whole-site plan."""
    return tuple(getattr(plan, role) for plan in site_plans(backends, scalings))


def site_plans(backends: list[str], scalings: list[Scaling]) -> list[LinearPlan]:
    """Whole-site plans (all three GEMMs in FP8 with one scaling and backend)."""
    out = []
    for scaling in scalings:
        for backend in backends:
            for fmt_bwd in (None, LinearPlan.fp8().forward.fmt):
                try:
                    plan = LinearPlan.fp8(scaling=scaling, backend=backend) if fmt_bwd is None else \
                        LinearPlan.fp8(fmt_bwd=fmt_bwd, scaling=scaling, backend=backend)
                except ValueError:
                    continue
                out.append(plan)
                break
    return out


def site_table(ledger_rows: list, batch: int) -> list[str]:
    """Per shape and whole-site plan: the three GEMMs with the quantization the site pays
    (tensor-wise payloads reused across GEMMs) against high precision."""
    groups: dict[tuple[str, str], list] = {}
    for row in ledger_rows:
        name, _, plan = row.site.partition("|")
        groups.setdefault((name, plan), []).append(row)
    lines = ["| shape | site plan | high ms | FP8 GEMMs ms | quant ms | FP8 total ms | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for (name, plan), rows in groups.items():
        if len(rows) != 3 or any(r.chosen is None for r in rows):
            lines.append(f"| {name} | {plan} | failed: {'; '.join(f for r in rows for f in r.failures)[:160]} | | | | |")
            continue
        high = sum(r.high_ms for r in rows)
        gemm = sum(r.chosen.gemm_ms for r in rows)
        quant = sum(r.chosen.quant_ms for r in rows)
        lines.append(f"| {name} | {plan} | {high:.3f} | {gemm:.3f} | {quant:.3f} | {gemm + quant:.3f} | {high / (gemm + quant):.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32768)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--backends", nargs="*", default=["torch_scaled_mm", "triton", "fbgemm_rowwise"])
    ap.add_argument("--scalings", nargs="*", default=["tensorwise", "rowwise"])
    ap.add_argument("--zero-half", action="store_true",
                    help="activations and gradients half zeros, as behind a ReLU (a GEMM's speed can "
                         "depend on its data; default: dense random values)")
    ap.add_argument("--dynamic-scales", action="store_true",
                    help="tensor-wise x and dY with dynamic scales (an amax pass each); default: static "
                         "scales, as both presets run them (loka.mods.static_scales), their transposed "
                         "writes timed so too")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scalings = [Scaling(s) for s in args.scalings]
    gemms = []
    for name in args.shapes:
        k, n = SHAPES[name]
        for role in ROLES:
            cands = candidates(role, args.backends, scalings)
            gemms.append(LedgerGemm(name, role, role_shape(role, args.batch, k, n), GemmPlan(), cands))
    ledger = measure_ledger(gemms, device=device, zero_half=args.zero_half, static_scales=not args.dynamic_scales)
    # Whole sites: every GEMM of the layer under one plan, so tensor-wise reuse counts.
    site_gemms = []
    for name in args.shapes:
        k, n = SHAPES[name]
        for plan in site_plans(args.backends, scalings):
            label = f"{name}|{plan.forward.scaling.value}@{plan.forward.backend}"
            for role in ROLES:
                p = getattr(plan, role)
                site_gemms.append(LedgerGemm(label, role, role_shape(role, args.batch, k, n), p, (p,), plan))
    sites = measure_ledger(site_gemms, device=device, zero_half=args.zero_half,
                           static_scales=not args.dynamic_scales)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = ledger.to_dict()
    # Bandwidth of each quantizer: bf16 read once, FP8 written once.
    lines = ["| shape | GEMM | plan | FP8 GEMM ms | speed-up alone | quant a ms (GB/s) | quant b ms (GB/s) | speed-up as paid |",
             "|---|---|---|---|---|---|---|---|"]
    for row in ledger.rows:
        m, k, n = row.shape
        for t in sorted(row.fp8, key=lambda t: t.total_ms):
            def gbs(ms: float, elems: int) -> str:
                return "reused" if ms == 0 else f"{ms:.3f} ({3 * elems / ms / 1e6:.0f})"
            lines.append(
                f"| {row.site} {'x'.join(map(str, row.shape))} | {row.role} | {t.plan} | {t.gemm_ms:.3f} | "
                f"{row.high_ms / t.gemm_ms:.2f}x | {gbs(t.quant_a_ms, m * k)} | {gbs(t.quant_b_ms, n * k)} | "
                f"{row.high_ms / t.total_ms if t.total_ms > 0 else math.inf:.2f}x |"
            )
        for f in row.failures:
            lines.append(f"| {row.site} | {row.role} | failed: {f[:120]} | | | | | |")
    md = [
        f"# Ledger at named shapes, batch {args.batch}",
        "",
        f"Command: `python -m bench.ledger_shapes {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"{ledger.device}; torch {torch.__version__}; {platform.node()}.",
        "",
        ledger.markdown(),
        "",
        "## Whole sites (one plan for all three GEMMs, tensor-wise payloads reused)",
        "",
        *site_table(sites.rows, args.batch),
        "",
        "## Every candidate",
        "",
        *lines,
    ]
    result["sites"] = sites.to_dict()
    result.update(batch=args.batch, torch=torch.__version__, command=vars(args))
    (out / "ledger.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "ledger.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
