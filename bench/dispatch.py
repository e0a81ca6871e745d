"""Dispatch versus fixed kernel choices, per site, on the GPU (issue: Dispatch acceptance).

For the GEMM sites of the DLRM, DCN and Wukong-style configs of ``bench.e2e`` (batch 8192,
bf16 autocast; the DCN cross layers' low-rank V/W and the Wukong LCB projections timed as the
Linear GEMMs they are, with their real row counts), every site is timed forward + backward in isolation with
(a) each fixed plan applied to all three of its GEMMs (high precision, FP8 row-wise on each
backend, FP8 tensor-wise on each backend that has it), and (b) the plan Dispatch picks from
its own on-device micro-benchmarks (all verdicts taken as safe here: this measures the
speed side of the decision; the Probe tests cover the safety side). The check: the chosen
plan is never slower than the best fixed choice for that site by more than 3%.

Run (GPU):  python -m bench.dispatch --out bench/results/h100_dispatch
Dry run:    python -m bench.dispatch --dry-run --out /tmp/dispatch
On an H100 the default run takes ~3-4 min, mostly compiling and autotuning the Triton GEMM
(~35 shape keys, ~9 configs each); the JSON/Markdown are rewritten after every site, so a run
stopped by a time limit keeps the sites it finished. In ~3 min calls, one config per call:
``--configs dlrm --out R/dlrm``, ``--configs dcn --out R/dcn``, ``--configs wukong --out R/wukong``.
Sites that are batched GEMMs (DLRM dot, Wukong FM bmm) are not timed here: their only FP8
backend is ``emulated``, so on a GPU Dispatch has nothing to choose for them.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loka_train.dispatch import DispatchConfig, Dispatcher
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.roles import ROLES
from loka_train.mods import Fp8Linear

CONFIGS: dict[str, list[tuple[str, int, int, int]]] = {
    # (site, K, N, rows per sample): the Linear sites of bench.e2e's configs at MLPerf-like
    # sizes, with their real shapes (one entry per distinct shape). Batched-GEMM sites (the
    # DLRM dot, the Wukong FM bmm) are left out: their only FP8 backend is `emulated`.
    "dlrm": [("bottom.0", 13, 512, 1), ("bottom.1", 512, 256, 1), ("bottom.2", 256, 128, 1),
             ("top.0", 479, 1024, 1), ("top.1", 1024, 1024, 1), ("top.2", 1024, 512, 1),
             ("top.3", 512, 256, 1)],
    "dcn": [("bottom.0", 13, 512, 1), ("bottom.1", 512, 256, 1), ("bottom.2", 256, 128, 1),
            ("cross.V", 3456, 512, 1), ("cross.W", 512, 3456, 1),
            ("top.0", 3456, 1024, 1), ("top.1", 1024, 1024, 1), ("top.2", 1024, 512, 1),
            ("top.3", 512, 256, 1)],
    "wukong": [("bottom.0", 13, 512, 1), ("bottom.1", 512, 256, 1), ("bottom.2", 256, 128, 1),
               ("fmb0.mlp.0", 432, 4096, 1), ("fmb1.mlp.0", 512, 4096, 1), ("fmb.mlp.2", 4096, 2048, 1),
               ("lcb0.xt_proj", 27, 64, 128), ("lcb1.xt_proj", 32, 32, 128),
               ("top.0", 4096, 4096, 1), ("top.1", 4096, 2048, 1), ("top.2", 2048, 1024, 1)],
}
TOLERANCE = 1.03


@dataclass
class _Safe:
    safe: bool = True
    reason: str = "assumed safe (speed benchmark)"
    sqnr_lo_db: float = math.inf
    budget_db: float = 0.0


class _AllSafe(dict):
    def get(self, key, default=None):  # type: ignore[override]
        return _Safe()


def fixed_plans(device_type: str) -> dict[str, LinearPlan]:
    plans = {"high": LinearPlan.high_precision()}
    gpu = ("triton", "fbgemm_rowwise", "torch_scaled_mm")
    for backend in gpu if device_type == "cuda" else ("emulated", "torch_scaled_mm"):
        for scaling in (Scaling.ROWWISE, Scaling.TENSORWISE):
            if backend == "fbgemm_rowwise" and scaling is Scaling.TENSORWISE:
                continue
            try:
                plans[f"fp8_{scaling.value}_{backend}"] = LinearPlan.fp8(
                    Fp8Format.E4M3, Fp8Format.E5M2, scaling=scaling, backend=backend
                )
            except ValueError:
                continue
    return plans


def time_site(site: nn.Module, x: torch.Tensor, iters: int) -> float:
    """Median seconds of forward + backward of one site (its current plan)."""
    grad = torch.randn(x.shape[0], site.out_features, device=x.device, dtype=x.dtype)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
            y = site(x)
        y.backward(grad.to(y.dtype))

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def time_plans(site: nn.Module, x: torch.Tensor, plans: dict[str, LinearPlan], iters: int,
               rounds: int, failures: list[str], name: str) -> dict[str, float]:
    """Seconds of forward + backward per plan: ``rounds`` interleaved rounds (every plan once
    per round, so a slow phase of the host or the GPU clocks hits all plans alike), the
    fastest round's median of ``iters`` each. A plan that raises is left out and recorded."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for pname, plan in plans.items():
            if pname in best and math.isinf(best[pname]):
                continue
            try:
                site.set_plan(plan)
                best[pname] = min(best.get(pname, math.inf), time_site(site, x, iters))
            except Exception as exc:  # recorded, reported, and the script exits 1; no time
                failures.append(f"{name} {pname}: {type(exc).__name__}: {exc}")
                best[pname] = math.inf
    return {p: t for p, t in best.items() if math.isfinite(t)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=50, help="timed steps per plan and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the plans (fastest kept)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--backends", default="triton,fbgemm_rowwise,torch_scaled_mm",
                        help="FP8 backends of the fixed plans and of Dispatch's candidates (GPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    batch = 64 if args.dry_run else args.batch
    iters = 2 if args.dry_run else args.iters
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    misses: list[dict] = []
    failures: list[str] = []
    plans = fixed_plans(device.type)
    if args.rounds < 1 or args.iters < 1:
        parser.error("--rounds and --iters must be >= 1")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    backends = tuple(args.backends.split(","))

    def meta() -> dict:
        return {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "batch": batch, "iters": iters, "rounds": args.rounds, "dry_run": args.dry_run,
            "command": " ".join(sys.argv),
        }

    plans = {name: plan for name, plan in plans.items() if name == "high" or device.type != "cuda"
             or plan.forward.backend in backends}
    for config, layers in ((c, CONFIGS[c]) for c in args.configs.split(",")):
        for i, (label, k, n, rows_per_sample) in enumerate(layers):
            if args.dry_run:
                k, n, rows_per_sample = min(k, 64), min(n, 64), min(rows_per_sample, 2)
            name = f"{config}.{label}"
            torch.manual_seed(i)
            linear = nn.Linear(k, n, device=device)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            x = torch.randn(batch * rows_per_sample, k, device=device, dtype=dtype, requires_grad=True)
            site = Fp8Linear.from_linear(linear, pad_to_multiple=16)
            site.site_name = name
            runnable = {p: plan for p, plan in plans.items() if site.supports_plan(plan)[0]}
            site.set_plan(LinearPlan.high_precision())
            time_site(site, x, 1)  # records the GEMM shapes
            dispatcher = Dispatcher(
                DispatchConfig(
                    objective="speed", margin=0.0, hysteresis_intervals=1,
                    scalings=("rowwise", "tensorwise"), timing="measure" if device.type == "cuda" else "cost_model",
                    backends=backends,
                    cpu_backends=("emulated",),
                ),
                device=device,
                out_dtype=torch.bfloat16,
            )
            dispatcher.register(
                name, plan=site.plan, shapes=site.gemm_shapes(), supports=site.supports_plan,
                pad_to_multiple=site.pad_to_multiple,
            )
            dispatcher.replan(step=0, verdicts=_AllSafe())
            chosen_plan = dispatcher.plans[name]
            # The chosen plan joins the interleaved rounds unless it is one of the fixed ones
            # (then it *is* that plan: same kernels, same time).
            same = next((p for p, plan in runnable.items() if plan == chosen_plan), None)
            timed = dict(runnable) if same else {**runnable, "chosen": chosen_plan}
            times = time_plans(site, x, timed, iters, args.rounds, failures, name)
            chosen = times.get(same or "chosen")
            fixed = {p: t for p, t in times.items() if p != "chosen"}
            if not fixed or chosen is None:
                failures.append(f"{name}: chosen plan {chosen_plan} or every fixed plan could not be timed")
                write_results(out, rows, misses, failures, meta(), iters)
                continue
            best_name = min(fixed, key=fixed.get)  # type: ignore[arg-type]
            ratio = chosen / fixed[best_name]
            row = {
                "site": name, "M": x.shape[0], "K": k, "N": n,
                "chosen": {r: str(getattr(chosen_plan, r)) for r in ROLES},
                "chosen_us": chosen * 1e6, "best_fixed": best_name, "best_fixed_us": fixed[best_name] * 1e6,
                "fixed_us": {p: t * 1e6 for p, t in fixed.items()}, "chosen_over_best": ratio,
            }
            rows.append(row)
            if ratio > TOLERANCE:
                misses.append(row)
            print(f"{name:18s} {x.shape[0]}x{k}x{n}: chosen {chosen * 1e6:8.1f} us, best fixed {best_name} "
                  f"{fixed[best_name] * 1e6:8.1f} us, ratio {ratio:.3f}", flush=True)
            # After every site: a run stopped by a time limit keeps what it measured.
            write_results(out, rows, misses, failures, meta(), iters)
    write_results(out, rows, misses, failures, meta(), iters)
    print(f"\n{len(rows)} sites, {len(misses)} misses, {len(failures)} failures -> {out}/dispatch.md")
    return 1 if failures else 0


def write_results(out: Path, rows: list[dict], misses: list[dict], failures: list[str],
                  meta: dict, iters: int) -> None:
    (out / "dispatch.json").write_text(json.dumps({"meta": meta, "rows": rows, "failures": failures}, indent=2))
    lines = [
        f"# Dispatch vs fixed choices ({meta['device']}, torch {meta['torch']})", "",
        f"Command: `{meta['command']}`. Forward + backward of each Linear site, bf16 autocast, "
        f"per plan the fastest of {meta.get('rounds', 1)} interleaved rounds' medians of {iters} steps "
        f"(the chosen plan, when it equals a fixed one, is that plan's time). Pass: chosen <= {TOLERANCE:.2f} x best fixed.", "",
        "| site | M x K x N | chosen (fwd / dgrad / wgrad) | chosen us | best fixed | best us | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ch = " / ".join(r["chosen"][x] for x in ROLES)
        lines.append(
            f"| {r['site']} | {r['M']}x{r['K']}x{r['N']} | {ch} | {r['chosen_us']:.1f} | "
            f"{r['best_fixed']} | {r['best_fixed_us']:.1f} | {r['chosen_over_best']:.3f} |"
        )
    lines += ["", f"Misses (> {TOLERANCE}x): {len(misses)}", ""] + [f"- {f}" for f in failures]
    (out / "dispatch.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
