"""Host overhead of an FP8 site against the plain ``nn.Linear`` it replaces.

Small shapes (default 32 x 64 -> 64) so that the kernels cost next to nothing and the time is
the Python and launch overhead that a launch-bound DLRM step pays per site. Measured: forward
under ``no_grad`` and forward + backward, median of repeated timed loops, for ``nn.Linear``,
the site in high precision and the site with each FP8 plan the device runs; and the cost of
a ``record_function`` range with no profiler running (why ``utils.profiling.profiled``).

Usage:
    python -m bench.site_overhead                 # CPU or the current CUDA device
    python -m bench.site_overhead --m 8192 --k 512 --n 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import Fp8Linear


def _timed(fn, device: torch.device, calls: int, repeats: int) -> float:
    """Median microseconds per call over `repeats` loops of `calls` calls."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.site_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.m, args.k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(args.m, args.n, device=device, dtype=dtype)
    backends = ("torch_scaled_mm", "triton", "fbgemm_rowwise") if device.type == "cuda" else ("emulated", "torch_scaled_mm")
    modules: dict[str, nn.Module] = {"nn.Linear": nn.Linear(args.k, args.n, device=device, dtype=dtype)}
    site = Fp8Linear.from_linear(nn.Linear(args.k, args.n, device=device, dtype=dtype), pad_to_multiple=16)
    modules["site high"] = site
    for backend in backends:
        for scaling in (Scaling.ROWWISE, Scaling.TENSORWISE):
            plan = LinearPlan.fp8(Fp8Format.E4M3, Fp8Format.E5M2, scaling=scaling, backend=backend)
            fp8 = Fp8Linear.from_linear(nn.Linear(args.k, args.n, device=device, dtype=dtype), pad_to_multiple=16)
            try:
                fp8.set_plan(plan)
                fp8(x).backward(g)
            except (RuntimeError, ValueError) as exc:
                print(f"site fp8 {backend}/{scaling.value}: not run ({exc})")
                continue
            modules[f"site fp8 {backend}/{scaling.value}"] = fp8
    def plain_range() -> None:
        with torch.profiler.record_function("loka/bench"):
            pass

    rf = _timed(plain_range, torch.device("cpu"), args.calls * 10, args.repeats)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (1 thread)"
    print(f"{name}, torch {torch.__version__}, x {args.m}x{args.k} -> {args.n}, {dtype}")
    print(f"torch.profiler.record_function with no profiler running: {rf:.2f} us per range")
    print(f"{'module':34s} {'fwd no_grad us':>15s} {'fwd+bwd us':>12s}")
    base = None
    for label, mod in modules.items():
        with torch.no_grad():
            fwd = _timed(lambda mod=mod: mod(x), device, args.calls, args.repeats)
        both = _timed(lambda mod=mod: mod(x).backward(g), device, args.calls, args.repeats)
        base = base or (fwd, both)
        print(f"{label:34s} {fwd:15.1f} {both:12.1f}   (+{fwd - base[0]:.1f} / +{both - base[1]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
