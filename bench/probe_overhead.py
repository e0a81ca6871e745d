"""Probe overhead on a DLRM-like MLP stack: step time with and without the Probe.

The model is the dense part of MLPerf DLRM (Criteo 1TB): bottom MLP 13-512-256-128, top MLP
479-1024-1024-512-256-1 (479 = 128 + 351 dot-interaction features, fed here as random
inputs), bf16 autocast on CUDA, Adagrad. Every Linear is a probe site (9 sites, 27 GEMMs).
Embeddings and the all-to-all are left out, so the step is *shorter* than a full DLRM step and
the overhead percentage here is an upper bound of the one on the full model.

Measured, in alternating repeats (median of the paired ratios):
* ``base``: plain training steps;
* ``probe``: the same steps with the Probe attached at the given sampling (default: the
  ProbeConfig defaults), including ``begin_step`` on every step and ``reduce()`` every
  ``interval`` steps;
* the cost of one sampled step and of one ``reduce()`` in isolation, and the overhead they
  imply at the configured sampling (``overhead_pct_modelled``: less noisy than the direct
  figure, since the step time itself drifts by several percent between runs);
* whether CUDA-graph replays of the measurements give the same statistics as eager ones;
* on CUDA, whether a sampled step runs without any host sync
  (``torch.cuda.set_sync_debug_mode("error")`` around the hooks' work).

Writes a JSON with the figures (``--out``) and prints it.

Usage:
    python -m bench.probe_overhead                  # GPU, defaults
    python -m bench.probe_overhead --dry-run        # CPU, tiny, a few seconds
    python -m bench.probe_overhead --every-k 50 --sites-per-step 3 --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loka_train.probe import Probe, ProbeConfig

ROOT = Path(__file__).resolve().parents[1]

DLRM_BOTTOM = (13, 512, 256, 128)
DLRM_TOP = (479, 1024, 1024, 512, 256, 1)
TINY_BOTTOM = (13, 32, 16)
TINY_TOP = (48, 32, 16, 1)


class MlpStack(nn.Module):
    """Bottom MLP on dense features, top MLP on [bottom output, interaction features]."""

    def __init__(self, bottom: tuple[int, ...], top: tuple[int, ...]) -> None:
        super().__init__()
        self.bottom = self._mlp(bottom, last_relu=True)
        self.top = self._mlp(top, last_relu=False)
        self.num_interaction = top[0] - bottom[-1]

    @staticmethod
    def _mlp(sizes: tuple[int, ...], *, last_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(d_in, d_out))
            if last_relu or i < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def forward(self, dense_BD: torch.Tensor, interaction_BI: torch.Tensor) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense_BD), interaction_BI], dim=1)).squeeze(1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_step(model: MlpStack, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, ...]], device: torch.device):
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    loss_fn = nn.BCEWithLogitsLoss()

    def step(i: int) -> None:
        dense, inter, labels = batches[i % len(batches)]
        with autocast:
            logits = model(dense, inter)
        loss = loss_fn(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _timed(step, steps: range, device: torch.device, before=None, after=None) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for i in steps:
        if before is not None:
            before(i)
        step(i)
        if after is not None:
            after(i)
    _sync(device)
    return time.perf_counter() - t0


def graph_vs_eager_diff(eager: Probe, graphed: Probe, site: str) -> dict[str, float]:
    """Per role, the largest |difference| of the window statistics of two probes that observed
    the same GEMMs (inf if they filled different window slots, NaN if a statistic is NaN)."""
    out: dict[str, float] = {}
    for role in ("forward", "grad_input", "grad_weight"):
        ge, gg = eager.window_stats(site, role), graphed.window_stats(site, role)
        valid = ge["valid"]
        if not torch.equal(valid, gg["valid"]) or not bool(valid.any()):
            out[role] = math.inf
            continue
        # Filled slots only: unfilled ones hold amax = -inf, whose difference is NaN, and
        # Python's max() silently drops a NaN that is not its first argument.
        diffs = [
            float((ge[k][valid] - gg[k][valid]).abs().max())
            for k in ("sqnr_db", "underflow_a", "amax_a", "outlier_ratio_a")
        ]
        out[role] = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.dry_run else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; use --dry-run (CPU, tiny) or --device cpu")
    torch.manual_seed(0)
    bottom, top = (TINY_BOTTOM, TINY_TOP) if args.dry_run else (DLRM_BOTTOM, DLRM_TOP)
    batch = 64 if args.dry_run else args.batch
    overrides: dict[str, Any] = {}
    if args.every_k is not None:
        overrides["every_k_steps"] = args.every_k
    if args.interval is not None:
        overrides["interval"] = args.interval
    if args.sites_per_step is not None:
        overrides["sites_per_step"] = args.sites_per_step
    if args.dry_run:
        overrides.setdefault("every_k_steps", 5)
        overrides.setdefault("interval", 10)
        overrides["min_samples"] = 1
    cfg = ProbeConfig(**overrides)
    steps = args.steps or (20 if args.dry_run else max(2 * cfg.interval, 10 * cfg.every_k_steps))

    model = MlpStack(bottom, top).to(device)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    batches = [
        (
            torch.randn(batch, bottom[0], device=device),
            torch.randn(batch, model.num_interaction, device=device),
            torch.randint(0, 2, (batch,), device=device).float(),
        )
        for _ in range(4)
    ]
    step = _make_step(model, opt, batches, device)
    probe = Probe(cfg, device=device)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]

    def attach() -> list:
        return [probe.attach(m, name) for name, m in linears]

    def before(i: int) -> None:
        probe.begin_step(i)

    def after(i: int) -> None:
        if probe.should_reduce(i):
            probe.reduce()

    # Warm up both paths (allocator, cuBLAS handles, CUDA graph captures for every site).
    _timed(step, range(args.warmup), device)
    handles = attach()
    _timed(step, range(args.warmup), device, lambda i: probe.begin_step(i * cfg.every_k_steps), None)
    probe.reduce()
    for h in handles:
        h.remove()

    # Paired runs: the step time drifts between runs by several percent (CPU-bound launch
    # path), so the overhead is the median of per-pair ratios, not a ratio of medians.
    base_times, probe_times = [], []
    for _ in range(args.repeats):
        base_times.append(_timed(step, range(steps), device))
        handles = attach()
        probe_times.append(_timed(step, range(steps), device, before, after))
        for h in handles:
            h.remove()
    ratios = [p / b for p, b in zip(probe_times, base_times, strict=True)]
    base_s = statistics.median(base_times)

    # Isolated costs, each paired with plain steps run right before it: hooks on an unsampled
    # step, a sampled step (the sites scheduled at step 0), one reduce().
    n_iso = 5 if args.dry_run else 50
    plain_s = _timed(step, range(n_iso), device) / n_iso
    handles = attach()
    unsampled_s = _timed(step, range(n_iso), device, lambda i: probe.begin_step(1), None) / n_iso
    plain2_s = _timed(step, range(n_iso), device) / n_iso
    sampled_s = _timed(step, range(n_iso), device, lambda i: probe.begin_step(0), None) / n_iso
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        probe.reduce()
    _sync(device)
    reduce_s = (time.perf_counter() - t0) / 5
    sampled_sites = sum(probe.should_sample(0, name) for name, _ in linears)

    sync_free: dict[str, bool | str] | None = None
    if device.type == "cuda":
        # Whole sampled training step (model + optimizer + probe hooks), then the probe's
        # hot path alone on device tensors, each under "error" sync-debug mode.
        name0, lin0 = linears[0]
        x_check = batches[0][0]
        # The dtypes the training step's hooks see (bf16 autocast: the Linear's output, hence its
        # gradient, is bf16; its input is the fp32 batch), so the probe replays the graphs
        # captured in warm-up: an fp32 gradient would be a new shape key, i.e. a capture (a
        # first-sample cost, not the hot path) inside the sync check.
        dy_check = torch.randn(batch, lin0.out_features, device=device, dtype=torch.bfloat16)
        checks = {
            "sampled_train_step": lambda: step(0),
            "probe_observe_only": lambda: (
                probe.observe_forward(name0, x_check, lin0.weight.detach()),
                probe.observe_backward(name0, dy_check, x_check, lin0.weight.detach()),
            ),
        }
        sync_free = {}
        for label, fn in checks.items():
            probe.begin_step(0)
            _sync(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                sync_free[label] = True
            except RuntimeError as exc:  # the message names the syncing call
                sync_free[label] = str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Graph replays and eager measurement give the same statistics.
        eager = Probe(ProbeConfig(**{**overrides, "cuda_graphs": False}), device=device)
        graphed = Probe(cfg, device=device)
        w_check = lin0.weight.detach()
        for p in (eager, graphed):
            p.register_site(name0)
            for i in range(3):  # the first graphed call captures, later ones replay
                p.begin_step(i * cfg.every_k_steps)
                xi = torch.randn(batch, lin0.in_features, device=device, generator=torch.Generator(device).manual_seed(i))
                p.observe_backward(name0, dy_check, xi, w_check)
                p.observe_forward(name0, xi, w_check)
            p.reduce()
        sync_free["graph_vs_eager_max_abs_diff"] = graph_vs_eager_diff(eager, graphed, name0)  # type: ignore[assignment]
    for h in handles:
        h.remove()

    sampled_per_run = sum(1 for i in range(steps) if i % cfg.every_k_steps == 0)
    reduces_per_run = sum(1 for i in range(steps) if probe.should_reduce(i))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "batch": batch,
        "mlp_bottom": list(bottom),
        "mlp_top": list(top),
        "num_sites": len(linears),
        "probe_config": {
            "every_k_steps": cfg.every_k_steps,
            "sites_per_step": cfg.sites_per_step,
            "interval": cfg.interval,
            "window": cfg.window,
            "candidates": [c.name for c in probe.candidates],
        },
        "steps_per_run": steps,
        "repeats": args.repeats,
        "sampled_steps_per_run": sampled_per_run,
        "reduces_per_run": reduces_per_run,
        "base_step_ms": 1e3 * base_s / steps,
        "overhead_pct_measured": 100.0 * (statistics.median(ratios) - 1.0),
        "overhead_pct_pairs": [100.0 * (r - 1.0) for r in ratios],
        "base_runs_s": base_times,
        "probe_runs_s": probe_times,
        "plain_step_ms": 1e3 * plain_s,
        "unsampled_step_with_hooks_ms": 1e3 * unsampled_s,
        "sampled_step_ms": 1e3 * sampled_s,
        "sites_per_sampled_step": sampled_sites,
        "sampled_step_extra_ms": 1e3 * (sampled_s - plain2_s),
        "reduce_ms": 1e3 * reduce_s,
        # Amortized from the isolated costs: extra per sampled step and per reduce over a run
        # (hooks on unsampled steps reported separately: within noise of a plain step).
        "overhead_pct_modelled": 100.0
        * (sampled_per_run * (sampled_s - plain2_s) + reduces_per_run * reduce_s)
        / base_s,
        "hot_path_sync_free": sync_free,
        "probe_cuda_graphs": probe.report()["cuda_graphs"],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probe_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, a few steps")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8192, help="samples per step")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every-k", type=int, default=None, help="ProbeConfig.every_k_steps")
    parser.add_argument("--interval", type=int, default=None, help="ProbeConfig.interval")
    parser.add_argument("--sites-per-step", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "probe_overhead.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.warmup = min(args.warmup, 2)
        args.repeats = min(args.repeats, 2)
        torch.set_num_threads(1)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if not args.dry_run or args.out != parser.get_default("out"):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
