"""Step-time effect of each mods adaptation on the Wukong-style and DCN dense towers (issue 5).

The dense part of each model (bottom MLP, interaction, top MLP; the embeddings are a random
``(B, F, D)`` input that receives gradients, as the EBC output would) runs forward + backward
under bf16 autocast, in these variants:

Wukong-style (``loka_train.models.wukong``):
  * ``bf16``: the unconverted model (the baseline of every speedup);
  * ``high``: converted, every site in high precision, all adaptations on; ``high -hfusion``:
    without horizontal fusion;
  * ``fp8 <backend>``: every site that can run FP8 in FP8 (row-wise e4m3 forward, e5m2
    gradients; the ``bmm`` sites stay bf16: no batched FP8 backend; see ``fp8_plan`` for the
    grad-weight GEMM of ``triton``), all adaptations on;
  * ``-fused_norm``: LayerNorm, then a separate quantization of its output (versus the fused
    LayerNorm kernel that emits the FP8 input; ``triton`` backend);
  * ``-hfusion``: FM projection, LCB and residual as three GEMMs instead of one;
  * ``+drop_bias``: biases of the FP8 Linear sites dropped;
  * ``pad 16`` / ``pad off`` on ``torch_scaled_mm`` (needs K, N % 16): with padding every
    site runs FP8; without it the ragged sites (13 dense inputs, 27 embeddings) stay bf16.
DCN (TorchRec ``DLRM_DCN``, MLPerf dense sizes): ``bf16``, ``high`` and ``fp8 <backend>`` with
the cross-layer epilogue fusion on and off.

Every row also reports the SQNR of the logits against the bf16 baseline (same parameters;
``+drop_bias`` zeroes biases, so it computes a different function and its SQNR says so).

Writes ``mods.json`` (every row, device, versions, sizes, command) and ``mods.md`` to ``--out``.
Times are medians of ``triton.testing.do_bench`` (CUDA events) in microseconds per step.

Usage:
    python -m bench.mods --out bench/results/h100_mods          # H100, ~3-4 min
    python -m bench.mods --out /tmp/m --dry-run                  # CPU, tiny, interpreter

Most of the GPU time is compiling and autotuning the Triton GEMM (~50 shape keys over both
models, ~400 configs at ~0.13 s each, plus ~100 compiles); the 15 timed variants take ~10 s.
The report is rewritten after every variant, so a run stopped by a time limit keeps what it
measured. In ~3 min calls: ``--models wukong --out R/wukong`` and ``--models dcn --out R/dcn``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.mods")

# MLPerf DLRM-DCNv2-like dense sizes; the Wukong tower uses the same embedding side.
FULL = dict(
    batch=8192, num_sparse=26, dim=128, num_dense=13,
    bottom=[512, 256, 128], top=[1024, 1024, 512, 256, 1],
    wukong_layers=2, fm_out=16, fm_rank=16, lcb_out=16, fm_hidden=2048,
    dcn_layers=3, dcn_rank=512,
)
DRY = dict(
    batch=32, num_sparse=4, dim=16, num_dense=13,
    bottom=[32, 16], top=[32, 16, 1],
    wukong_layers=2, fm_out=4, fm_rank=4, lcb_out=4, fm_hidden=32,
    dcn_layers=2, dcn_rank=8,
)


@dataclass
class Row:
    """One variant's measurement."""

    model: str
    variant: str
    backend: str
    adaptations: dict[str, Any]
    us: float | None = None
    sqnr_db: float | None = None
    num_sites: int = 0
    num_fp8_sites: int = 0
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.mods", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for mods.json and mods.md")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
    p.add_argument("--batch", type=int, default=None, help="override the batch size")
    p.add_argument("--models", default="wukong,dcn", help="comma-separated subset of wukong,dcn")
    p.add_argument("--backends", default="triton,torch_scaled_mm", help="FP8 backends to measure")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench rep time per variant and round (ms)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants (fastest kept)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.rep_ms < 1:
        p.error("--rounds and --rep-ms must be >= 1")
    return args


# ------------------------------------------------------------------------------ timing


class Timer:
    """do_bench on CUDA; a wall clock over a few steps on CPU (dry runs only)."""

    def __init__(self, device: str, rep_ms: int) -> None:
        self.device = device
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # autotune / warm up outside the timed region
        if self.device == "cuda":
            import torch
            import triton.testing

            torch.cuda.synchronize()
            return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=self.rep_ms, return_mode="median")
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return 1e6 * (time.perf_counter() - t0) / 2


# ------------------------------------------------------------------------------ models


def build_dense(kind: str, sizes: dict[str, Any], device: str):
    """The dense part of a DLRM-family model: ``forward(dense_BI, sparse_BFD) -> logits``."""
    import torch
    from torch import nn

    from loka_train.models import ModelConfig, build_model

    cfg = ModelConfig(
        kind=kind,
        embedding_dim=sizes["dim"],
        dense_arch_layer_sizes=list(sizes["bottom"]),
        over_arch_layer_sizes=list(sizes["top"]),
        dcn_num_layers=sizes["dcn_layers"],
        dcn_low_rank_dim=sizes["dcn_rank"],
        wukong_num_layers=sizes["wukong_layers"],
        wukong_num_fm_out=sizes["fm_out"],
        wukong_fm_rank=sizes["fm_rank"],
        wukong_num_lcb_out=sizes["lcb_out"],
        wukong_mlp_hidden=sizes["fm_hidden"],
    )
    feats = [f"cat_{i}" for i in range(sizes["num_sparse"])]
    rec = build_model(cfg, feature_names=feats, num_embeddings_per_feature=[8] * len(feats),
                      num_dense=sizes["num_dense"], seed=0)
    inner = rec.model

    class DenseTower(nn.Module):
        dense_arch: nn.Module
        inter_arch: nn.Module
        over_arch: nn.Module

        def __init__(self) -> None:
            super().__init__()
            self.dense_arch = inner.get_submodule("dense_arch")
            self.inter_arch = inner.get_submodule("inter_arch")
            self.over_arch = inner.get_submodule("over_arch")

        def forward(self, dense_BI: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
            dense_BD = self.dense_arch(dense_BI)
            if kind == "wukong":
                x_BND = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
                return self.over_arch(self.inter_arch(x_BND).flatten(1))
            return self.over_arch(self.inter_arch(dense_BD, sparse_BFD))

    tower = DenseTower().to(device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial LayerNorm affines and cross-layer biases
        for m in tower.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 0.2 - 0.1)
            biases = getattr(m, "bias", None)
            if isinstance(biases, nn.ParameterList):
                for b in biases:
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return tower


def make_inputs(sizes: dict[str, Any], device: str):
    import torch

    gen = torch.Generator().manual_seed(2)
    b = sizes["batch"]
    dense = torch.log1p(torch.rand(b, sizes["num_dense"], generator=gen) * 100)
    sparse = torch.randn(b, sizes["num_sparse"], sizes["dim"], generator=gen) * 0.05
    return dense.to(device), sparse.to(device).requires_grad_()


def _role_problems(site, plan, device_type: str):
    import torch

    from loka_train.kernels import GemmProblem

    out = []
    for role, (m, k, n) in site.gemm_shapes().items():
        gp = getattr(plan, role)
        if not gp.is_fp8:
            continue
        out.append((gp, GemmProblem(
            m=m, k=k, n=n, fmt=gp.fmt, fmt_b=gp.operand_b_fmt, scaling=gp.scaling,
            device_type=device_type, out_dtype=torch.float32 if role == "grad_weight" else torch.bfloat16,
            role=role, fast_accum=gp.fast_accum,
        )))
    return out


def assign_plans(model, plan, pad: int, device_type: str) -> tuple[int, int]:
    """FP8 ``plan`` on every site that can run it (shapes from the last forward), high otherwise.

    Without padding (``pad <= 1``), a site whose backend refuses its shape stays high.
    Returns (number of sites, number in FP8).
    """
    from loka_train.kernels import LinearPlan, get_backend
    from loka_train.mods import sites

    found = sites(model)
    num_fp8 = 0
    for site in found.values():
        ok, _ = site.supports_plan(plan)
        if ok and pad <= 1 and site.kind == "linear":
            ok = all(get_backend(gp.backend).supports(p)[0] for gp, p in _role_problems(site, plan, device_type))
        site.set_plan(plan if ok else LinearPlan.high_precision())
        num_fp8 += int(site.plan.forward.is_fp8)
    return len(found), num_fp8


# ----------------------------------------------------------------------------- variants


def fp8_plan(backend: str):
    """Row-wise e4m3 forward, e5m2 x e4m3 gradients, on ``backend``.

    On ``triton`` the grad-weight GEMM runs on ``torch_scaled_mm``: its operands are
    quantized along M (the batch, B * D rows for the Wukong projections), and the fused
    Triton quantizer keeps a whole row in registers (at most 16384 values), so it refuses them.
    """
    import dataclasses

    from loka_train.kernels import LinearPlan

    plan = LinearPlan.fp8(backend=backend)
    if backend == "triton":
        plan = dataclasses.replace(plan, grad_weight=LinearPlan.fp8(backend="torch_scaled_mm").grad_weight)
    return plan


def variants(kind: str, backends: list[str]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(variant name, backend or 'high'/'bf16', ModsConfig overrides or None = unconverted)."""
    out: list[tuple[str, str, dict[str, Any] | None]] = [("bf16", "bf16", None)]
    if kind == "wukong":
        out += [("high", "high", {}), ("high -hfusion", "high", {"horizontal_fusion": False})]
        for be in backends:
            out += [(f"fp8 {be}", be, {})]
            if be == "triton":
                out += [
                    (f"fp8 {be} -fused_norm", be, {"fused_norm_quant": False}),
                    (f"fp8 {be} -hfusion", be, {"horizontal_fusion": False}),
                    (f"fp8 {be} +drop_bias", be, {"drop_unstable_bias": True}),
                ]
            if be == "torch_scaled_mm":
                out += [(f"fp8 {be} pad off", be, {"pad_to_multiple": 0})]
    else:
        # The epilogue fusion engages on cross layers with an FP8 GEMM only (a high-precision
        # layer keeps TorchRec's formula, bit-identical): its effect is in the fp8 rows.
        out += [("high", "high", {})]
        for be in backends:
            out += [
                (f"fp8 {be}", be, {}),
                (f"fp8 {be} -epilogue", be, {"dcn_epilogue_fusion": False}),
            ]
    return out


def bench_model(kind: str, sizes: dict[str, Any], device: str, timer: Timer, backends: list[str], rows: list[Row],
                on_row: Callable[[], None] | None = None, rounds: int = 3) -> None:
    import torch

    from loka_train.kernels import LinearPlan, sqnr_db
    from loka_train.mods import ModsConfig, convert

    base = build_dense(kind, sizes, device)
    dense, sparse = make_inputs(sizes, device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    with torch.no_grad(), autocast:
        ref_logits = base(dense, sparse).float()

    steps: list[tuple[Row, Callable[[], None]]] = []
    for name, backend, overrides in variants(kind, backends):
        row = Row(model=kind, variant=name, backend=backend, adaptations=dict(overrides or {}))
        rows.append(row)
        try:
            model = copy.deepcopy(base)
            if overrides is not None:
                cfg = ModsConfig(**overrides)
                row.adaptations = {
                    k: getattr(cfg, k)
                    for k in ("pad_to_multiple", "fused_norm_quant", "drop_unstable_bias",
                              "horizontal_fusion", "dcn_epilogue_fusion")
                }
                convert(model, config=cfg)
                with torch.no_grad(), autocast:
                    model(dense, sparse)  # fills every site's GEMM shapes
                plan = LinearPlan.high_precision() if backend == "high" else fp8_plan(backend)
                row.num_sites, row.num_fp8_sites = assign_plans(model, plan, cfg.pad_to_multiple, device)

            def step(model=model) -> None:
                model.zero_grad(set_to_none=True)
                sparse.grad = None
                with autocast:
                    logits = model(dense, sparse)
                logits.float().sum().backward()

            with torch.no_grad(), autocast:
                row.sqnr_db = float(sqnr_db(ref_logits, model(dense, sparse).float()))
            step()  # compiles / autotunes the kernels outside the timed rounds
            steps.append((row, step))
        except Exception as e:  # a backend that cannot run here: recorded, not hidden
            row.skipped = f"error: {type(e).__name__}: {e}"
            logger.warning("%s %s: %s", kind, name, row.skipped)
        if on_row is not None:
            on_row()  # a run stopped during the set-up still reports its SQNRs and errors
    # Interleaved rounds (every variant once per round) and the fastest round kept: the step is
    # launch-bound, and a slow phase of the host must hit all variants alike. A single pass in
    # variant order once gave fused LayerNorm quantization a 0.85x "effect" and the next run 1.16x.
    for r in range(rounds):
        for row, step in steps:
            if row.skipped:
                continue
            try:
                us = timer(step)
            except Exception as e:  # recorded, not hidden: the variant has no time at all
                row.skipped = f"error: {type(e).__name__}: {e}"
                row.us = None
                logger.warning("%s %s: %s", kind, row.variant, row.skipped)
                continue
            row.us = us if row.us is None else min(row.us, us)
            row.extra.setdefault("round_us", []).append(us)
            if r == rounds - 1:
                logger.info("%s %-28s %10.1f us  sqnr %.1f dB  (%d/%d sites fp8)", kind, row.variant, row.us,
                            row.sqnr_db, row.num_fp8_sites, row.num_sites)
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_row is not None:
            on_row()  # write the report so far: a run stopped by a time limit keeps it


# ----------------------------------------------------------------------------- report


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"device": device, "python": platform.python_version(), "torch": torch.__version__}
    try:
        import torchrec

        env["torchrec"] = getattr(torchrec, "__version__", "?")
    except ImportError:
        env["torchrec"] = None
    if device == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
        import triton

        env["triton"] = triton.__version__
    return env


def _speedups(rows: list[Row]) -> None:
    for kind in {r.model for r in rows}:
        base = next((r for r in rows if r.model == kind and r.variant == "bf16" and r.us), None)
        for r in rows:
            if r.model == kind and base is not None and base.us and r.us:
                r.extra["speedup_vs_bf16"] = base.us / r.us


def _pairs(rows: list[Row]) -> list[tuple[str, str, str, float]]:
    """(model, adaptation, 'with vs without', time ratio without/with) for each switch."""
    by = {(r.model, r.variant): r.us for r in rows if r.us}
    out = []
    for (model, variant), us in by.items():
        for suffix, label in ((" -fused_norm", "fused LayerNorm quantization"),
                              (" -hfusion", "horizontal fusion"),
                              (" -epilogue", "DCN epilogue fusion"),
                              (" pad off", "padding (ragged sites FP8 vs bf16)"),
                              (" +drop_bias", "bias drop (inverse: with / without)")):
            if variant.endswith(suffix):
                base = variant[: -len(suffix)]
                on = by.get((model, base))
                if on is not None:
                    ratio = on / us if suffix == " +drop_bias" else us / on
                    out.append((model, label, f"{base} vs {variant}", ratio))
    return out


def write_report(rows: list[Row], env: dict[str, Any], sizes: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _speedups(rows)
    cmd = "python -m bench.mods " + " ".join(sys.argv[1:])
    data = {"environment": env, "command": cmd, "sizes": sizes, "rows": [asdict(r) for r in rows],
            "adaptation_effects": [dict(model=m, adaptation=a, compared=c, speedup=s) for m, a, c, s in _pairs(rows)]}
    (out / "mods.json").write_text(json.dumps(data, indent=1))
    lines = ["# mods adaptations: step time (issue 5)", ""]
    lines += [f"- device: **{env['device']}**" + (f" ({env['capability']})" if "capability" in env else "")]
    lines += [f"- torch {env['torch']}, torchrec {env.get('torchrec')}, rerun: `{cmd}`"]
    lines += [f"- sizes: `{json.dumps(sizes)}`"]
    lines += ["- dense tower only (embeddings are an input that receives gradients), forward + backward "
              "under bf16 autocast; microseconds per step: per variant the fastest of interleaved rounds' "
              "do_bench medians (each round's value in the JSON)", ""]
    lines += ["| model | variant | us / step | vs bf16 | logits SQNR vs bf16 (dB) | FP8 sites |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r.us is None:
            why = str(r.skipped or "not timed (run stopped)").replace("\n", " ").replace("|", "/")[:300]  # one table cell
            lines.append(f"| {r.model} | {r.variant} | n/a | | | {why} |")
            continue
        sp = r.extra.get("speedup_vs_bf16")
        sp_s = "n/a" if sp is None else f"{sp:.2f}x"  # None when the bf16 baseline failed
        sqnr_s = "n/a" if r.sqnr_db is None else f"{r.sqnr_db:.1f}"
        lines.append(
            f"| {r.model} | {r.variant} | {r.us:.1f} | {sp_s} | {sqnr_s} | "
            f"{r.num_fp8_sites}/{r.num_sites} |"
        )
    pairs = _pairs(rows)
    if pairs:
        lines += ["", "## Effect of each adaptation (time without / time with; > 1 means it helps)", "",
                  "| model | adaptation | compared | speedup |", "|---|---|---|---|"]
        lines += [f"| {m} | {a} | {c} | {s:.2f}x |" for m, a, c, s in pairs]
    (out / "mods.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if args.dry_run:
        device, sizes = "cpu", dict(DRY)
    else:
        if not torch.cuda.is_available():
            logger.error("no CUDA device: use --dry-run to check the script on CPU")
            return 2
        device, sizes = "cuda", dict(FULL)
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.batch:
        sizes["batch"] = args.batch
    env = environment(device)
    logger.info("environment: %s", env)
    logging.getLogger("loka_train.mods").setLevel(logging.WARNING)  # convert logs every site
    timer = Timer(device, args.rep_ms)
    backends = [b for b in args.backends.split(",") if b]
    rows: list[Row] = []
    t0 = time.time()
    for kind in [m for m in args.models.split(",") if m]:
        if kind not in ("wukong", "dcn"):
            raise SystemExit(f"--models takes wukong and/or dcn, got {kind!r}")
        bench_model(kind, sizes, device, timer, backends, rows,
                    on_row=lambda: write_report(rows, env, sizes, args.out), rounds=args.rounds)
    write_report(rows, env, sizes, args.out)
    errors = [r for r in rows if r.skipped]
    logger.info("wrote %s (%d rows, %d errors) in %.0f s", args.out, len(rows), len(errors), time.time() - t0)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
