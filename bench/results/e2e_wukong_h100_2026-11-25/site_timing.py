"""Wukong's xt_proj sites timed two ways on a GPU: Dispatch's per-GEMM micro-benchmark
(``GemmTimer.estimate``: high precision, tensor-wise FP8 with and without reused operands,
row-wise FP8) and the real ``FusedLinearSite`` forward + backward under bf16 autocast (eager,
10 steps after 3 warm-up steps, CUDA events).

Usage (GPU): python bench/results/e2e_wukong_h100_2026-11-25/site_timing.py
"""

import torch
from torch import nn

from loka_train.dispatch.timing import GemmTimer
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.mods.site import FusedLinearSite

DEV = torch.device("cuda")
M = 4194304  # batch 32768 x 128 rows of the projection
TIMER = GemmTimer(timing="measure", device=DEV, out_dtype=torch.bfloat16, graphed=True)
TW = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
RW = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="torch_scaled_mm")


def site_ms(site: FusedLinearSite, k: int) -> float:
    x = torch.randn(M, k, device=DEV, requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (y,) = site(x)
        y.backward(torch.ones_like(y))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 10


def main() -> None:
    for k, n in [(27, 64), (32, 32)]:
        shapes = {"forward": (M, k, n), "grad_input": (M, n, k), "grad_weight": (n, M, k)}
        for role, shape in shapes.items():
            reuse = (role == "grad_weight", role != "forward")
            hi = TIMER.estimate(role, shape, None) * 1e3
            tw = TIMER.estimate(role, shape, getattr(TW, role)) * 1e3
            tw_reuse = TIMER.estimate(role, shape, getattr(TW, role), reuse) * 1e3
            rw = TIMER.estimate(role, shape, getattr(RW, role)) * 1e3
            print(f"timer K={k} N={n} {role} {shape}: high {hi:.3f} tw {tw:.3f} tw-reuse {tw_reuse:.3f} rw {rw:.3f} ms")
        lin = nn.Linear(k, n, bias=False).to(DEV)
        for name, plan in [("high", LinearPlan.high_precision()), ("tw", TW), ("rw", RW)]:
            site = FusedLinearSite([lin], plan=plan, pad_to_multiple=16)
            try:
                print(f"site K={k} N={n} {name}: fwd+bwd {site_ms(site, k):.3f} ms (eager)")
            except Exception as exc:  # a plan the site cannot run is reported, not fatal
                print(f"site K={k} N={n} {name}: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
