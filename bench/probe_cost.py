"""What one Probe sample of one GEMM costs on the GPU, by role and by kernel.

At a site's real shapes (default: Wukong's over-arch 0, 32768 x 4096 -> 4096, bf16 operands),
each role's sample (the full-operand counts and row selection, then the statistics and shadow
GEMMs of every candidate of the preset on the selected rows) runs ``--iters`` times after a
warm-up, each role alone, then the site's three roles in a row as a training step runs them,
with the grad-weight taking over the full reads of X and dY that the forward and grad-input
made (``probe.sampling.FullPasses``) and with every role reading its own ("site, full reads
shared / not shared": what the shared reads save); CUDA events give its time, and a profiler
pass groups its kernels by name; on any device, the aten operators one
sample dispatches are counted, and those that are not views (each a kernel launch on a GPU: on
the small, row-cut operands of a sample their number, not their bytes, sets its cost). Eager
(``Probe.observe`` as a sampled eager step calls it) and, with ``--graphed``, as the capture of
a sampled module replays it (no nested measurement graph).

Usage:
    python -m bench.probe_cost --out $OUT/probe_cost.json
    python -m bench.probe_cost --preset safe --shape 32768,4096,2048
    python -m bench.probe_cost --max-cols none     # every output feature (probe.max_cols=None)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loka_train.plugin.config import LokaConfig
from loka_train.probe import Probe
from loka_train.probe.sampling import FullPasses
from loka_train.utils.capture import replay_hooks

_ROLE_OPERANDS = ("forward", "grad_input", "grad_weight")


def _operands(role: str, x_MK: torch.Tensor, w_NK: torch.Tensor, dy_MN: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return {"forward": (x_MK, w_NK), "grad_input": (dy_MN, w_NK), "grad_weight": (dy_MN, x_MK)}[role]


def _sample(probe: Probe, role: str, a: torch.Tensor, b: torch.Tensor, *, deferred: bool) -> None:
    if deferred:
        with replay_hooks(keep=False):  # the kernels a capture records, not the slot write
            probe.observe("site", role, a, b)
    else:
        probe.observe("site", role, a, b)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, and those that are not views (each of
    which launches a kernel on a GPU; a view only makes a new tensor header)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.computing = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        self.computing += not func.is_view
        return func(*args, **(kwargs or {}))


def _measure(sample: Any, device: torch.device, args: argparse.Namespace, key: str) -> dict[str, Any]:
    """``sample()`` after ``args.warmup`` runs: CUDA-event times of ``args.iters`` runs, its
    kernels by name from one profiled run (CUDA), and the aten operators of one run."""
    for _ in range(args.warmup):
        sample()
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sample()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    kernels: dict[str, float] = defaultdict(float)
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sample()
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            if evt.device_time_total > 0:
                kernels[evt.key[:90]] += evt.device_time_total / 1000.0
    counter = _OpCounter()
    with counter:
        sample()
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    result = {
        "aten_ops": counter.count,
        "aten_ops_not_views": counter.computing,
        "ms_median": sorted(times)[len(times) // 2] if times else None,
        "kernel_ms_total": sum(kernels.values()),
        "top_kernels_ms": top,
    }
    print(f"{key}: {result['ms_median']} ms, {counter.count} aten ops ({counter.computing} not views); "
          "top kernels:", flush=True)
    for name, ms in top:
        print(f"    {ms:8.3f} ms  {name}", flush=True)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    M, K, N = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device=device).manual_seed(0)
    x_MK = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    dy_MN = (torch.randn(M, N, device=device, generator=gen) * 1e-3).to(torch.bfloat16)
    w_NK = torch.randn(N, K, device=device, generator=gen) * K**-0.5
    cfg = LokaConfig.preset(args.preset).probe
    if args.max_cols is not None:
        cfg = dataclasses.replace(cfg, max_cols=None if args.max_cols == "none" else int(args.max_cols))
    out: dict[str, Any] = {"shape": [M, K, N], "preset": args.preset, "max_cols": cfg.max_cols,
                           "device": str(device),
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                           "candidates": None, "roles": {}, "site": {}}
    for deferred in (False, True) if args.graphed else (False,):
        probe = Probe(cfg, device=device)
        probe.register_site("site", weight_shape=(N, K))
        out["candidates"] = [str(c) for c in probe.candidates]
        for role in _ROLE_OPERANDS:
            a, b = _operands(role, x_MK, w_NK, dy_MN)
            sample = partial(_sample, probe, role, a, b, deferred=deferred)
            probe.begin_step(0)  # the first sampled step samples every site
            key = f"{role}{' (graphed)' if deferred else ''}"
            out["roles"][key] = _measure(sample, device, args, key)
        if not deferred:
            # The site's three roles as a sampled step runs them: grad-weight takes over the full
            # reads of X and dY that forward and grad-input made (probe.sampling.FullPasses),
            # against each role reading its operands itself (``share=False``).
            for shared in (True, False):
                probe._passes = FullPasses(share=shared)

                def site_step(probe: Probe = probe) -> None:
                    probe.begin_step(0)
                    for role in _ROLE_OPERANDS:
                        _sample(probe, role, *_operands(role, x_MK, w_NK, dy_MN), deferred=False)

                key = f"site, full reads {'shared' if shared else 'not shared'}"
                out["site"][key] = _measure(site_step, device, args, key)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="32768,4096,4096", help="M,K,N of the site's forward GEMM")
    p.add_argument("--preset", default="aggressive", choices=("safe", "aggressive"), help="the Probe's candidates")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=12, help="kernels listed per role")
    p.add_argument("--graphed", action="store_true", help="also the form a sampled module's capture records")
    p.add_argument("--max-cols", default=None, metavar="N|none",
                   help="probe.max_cols (default: the preset's); none measures every output feature")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --shape 256,64,32 (plumbing only)")
        return 2
    result = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
