"""Inference benchmark: a trained model served in bf16, compiled bf16, torchao's float8
inference recipe and LoKA's export, on one device, from the same checkpoint.

    python -m bench.inference --configs wukong,dcn,dlrm --batches 512,2048,8192 --out DIR
    python -m bench.inference --run runs/<run> --batches 4096 --out DIR   # a run of yours

Per config: a short LoKA training run (``--train-steps``, the aggressive preset with the
benchmark's sizes, compile + CUDA graphs on a GPU; or ``--run``, an existing run directory),
then each variant of its checkpoint (``loka_train.export.load_trained``):

* ``bf16``: the trained weights in their own modules (no LoKA site), bf16 autocast, eager;
* ``bf16+compile``: the same under ``torch.compile`` (the reference of every ratio);
* ``torchao`` (``+compile``): torchao's float8 inference recipe (``quantize_`` with
  ``Float8DynamicActivationFloat8WeightConfig``, row-wise) on the dense Linears whose dims are
  multiples of 16, the logit layer excluded; "not run" where torchao does not import;
* ``loka`` / ``loka+compile``: ``loka_train.export.serve`` with the run's plans (FP8 weights
  quantized once).

For each batch size: ``--warmup`` calls, then ``--iters`` timed forwards on held-out batches
(``torch.no_grad``, bf16 autocast; each call timed on the host between two device
synchronisations, so latency is per call): p50 and p99 latency (with 50 calls, the p99 is the
slowest) and throughput (batch / p50). NE and AUC of each
variant on ``--eval-batches`` held-out batches of the first batch size. Writes
``inference.json`` and ``inference.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.e2e.variants import CONFIGS, DATA, DRY_CONFIGS, DRY_DATA, Composer
from loka_train.data import make_dataset
from loka_train.data.metrics import auc, normalized_entropy
from loka_train.export import ServeConfig, load_trained, serve
from loka_train.job import JobConfig, run_job

logger = logging.getLogger(__name__)

VARIANTS = ("bf16", "bf16+compile", "torchao+compile", "loka", "loka+compile")
REFERENCE = "bf16+compile"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for inference.json and inference.md")
    p.add_argument("--configs", default="wukong", help="comma-separated: dlrm, dcn, wukong (ignored with --run)")
    p.add_argument("--run", default=None, help="serve this run directory's latest checkpoint instead of training one")
    p.add_argument("--batches", default="512,2048,8192", help="comma-separated batch sizes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--train-steps", type=int, default=300, help="steps of the training run per config")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny models and data (CPU tests)")
    args = p.parse_args(argv)
    args.config_names = [c for c in args.configs.split(",") if c]
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    args.variant_names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variant_names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    bad = sorted(set(args.config_names) - set(CONFIGS))
    if bad and args.run is None:
        raise SystemExit(f"--configs: unknown {bad}; choose from {sorted(CONFIGS)}")
    if min(args.batch_sizes, default=0) < 1 or args.iters < 1 or args.warmup < 0:
        raise SystemExit("--batches must be >= 1 each, --iters >= 1, --warmup >= 0")
    return args


def train_run(composer: Composer, args: argparse.Namespace, config: str, root: Path) -> tuple[JobConfig, Path]:
    """A short LoKA training run of `config` with a checkpoint at its end; its job and directory."""
    gpu = args.device == "cuda"
    configs, data = (DRY_CONFIGS, DRY_DATA) if args.dry_run else (CONFIGS, DATA)
    job = composer.job([
        *configs[config], *data, f"trainer={'gpu' if gpu else 'cpu'}", f"trainer.device={args.device}",
        f"trainer.steps={args.train_steps}", f"trainer.batch_size={args.batch_sizes[-1] if not args.dry_run else 32}",
        "trainer.eval_batches=1", "trainer.eval_every=0", "trainer.checkpoint_at_end=true", "trainer.resume=never",
        f"trainer.out_dir={root / config}", "trainer.tensorboard=false", "trainer.progress_bar=false",
        *(["trainer.dense_dtype=bf16", "trainer.compile_dense=true", "trainer.cuda_graphs=true"] if gpu else []),
        "loka=aggressive",
    ])
    run_job(job)
    return job, root / config / "latest"


def build(variant: str, job: JobConfig, run: Path, device: torch.device) -> tuple[nn.Module | None, str]:
    """The model of `variant` (called as ``model(dense, sparse) -> logits``), or None and why not."""
    if variant.startswith("bf16") or variant.startswith("torchao"):
        plain = replace(job, loka=replace(job.loka, enabled=False))  # the trained weights, no site
        model = load_trained(plain, run, device=device).model.model
        if variant.startswith("torchao"):
            why = _torchao(model)
            if why:
                return None, why
    else:
        trained = load_trained(job, run, device=device)
        model = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="bf16")).model
    if variant.endswith("+compile"):
        model = torch.compile(model)
    return model, ""


def _torchao(model: nn.Module) -> str:
    """Apply torchao's float8 inference recipe in place; why not, where it cannot."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
    except Exception as exc:  # any import failure: the variant is not run, with the reason
        return f"not run: torchao float8 inference does not import ({type(exc).__name__}: {exc})"
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = linears[-1][0] if linears else None

    def fits(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn != last
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    for _, linear in linears:  # the dense layers only: the embedding tables stay as trained
        linear.to(torch.bfloat16)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=fits)
    return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(model: nn.Module, batches: list[Any], args: argparse.Namespace, device: torch.device) -> list[float]:
    """Seconds of each timed call (after the warm-up), one batch after another."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    times = []
    with torch.no_grad(), autocast:
        for i in range(args.warmup + args.iters):
            b = batches[i % len(batches)]
            _sync(device)
            t0 = time.perf_counter()
            model(b.dense_features, b.sparse_features)
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    return times


def quality(model: nn.Module, batches: list[Any], device: torch.device) -> dict[str, float]:
    logits, labels = [], []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for b in batches:
            logits.append(model(b.dense_features, b.sparse_features).float().reshape(-1))
            labels.append(b.labels.float())
    lg, lb = torch.cat(logits).cpu(), torch.cat(labels).cpu()
    return {"ne": normalized_entropy(lg, lb), "auc": auc(lg, lb)}


def bench_config(args: argparse.Namespace, config: str, job: JobConfig, run: Path) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    rows = []
    for variant in args.variant_names:
        model, why = build(variant, job, run, device)
        row: dict[str, Any] = {"config": config, "variant": variant, "status": "ok" if model is not None else why}
        if model is not None:
            for b in args.batch_sizes:
                data = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=b)
                batches = [x.to(device) for x in data.batches(0, max(1, min(4, args.eval_batches)))]
                times = sorted(time_calls(model, batches, args, device))
                p50 = statistics.median(times)
                p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
                row[f"b{b}"] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "samples_per_s": b / p50}
            first = args.batch_sizes[0]
            data = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=first)
            row.update(quality(model, [x.to(device) for x in data.batches(0, args.eval_batches)], device))
        rows.append(row)
        logger.info("%s %s: %s", config, variant, {k: v for k, v in row.items() if k not in ("config", "variant")})
        del model
    ref = next((r for r in rows if r["variant"] == REFERENCE and r["status"] == "ok"), None)
    for r in rows:
        if ref is None or r["status"] != "ok":
            continue
        r["ne_delta_rel_vs_ref"] = r["ne"] / ref["ne"] - 1
        for b in args.batch_sizes:
            r[f"b{b}"]["speedup_vs_ref"] = r[f"b{b}"]["samples_per_s"] / ref[f"b{b}"]["samples_per_s"]
    return rows


def render(result: dict[str, Any]) -> str:
    args = result["args"]
    lines = [f"# Inference: {result['device']}", "", f"- command: `{result['command']}`", "",
             "Throughput (samples/s) and latency (p50 / p99 ms) per batch size; ratios against "
             f"{REFERENCE} of the same config; NE and AUC on held-out batches of batch {args['batch_sizes'][0]}.", ""]
    head = "| config | variant | " + " | ".join(f"b{b}: samples/s (x), p50 / p99 ms" for b in args["batch_sizes"])
    lines += [head + " | NE (vs ref) | AUC |", "|" + "---|" * (4 + len(args["batch_sizes"]))]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['variant']} | {r['status']} |" + " |" * (len(args["batch_sizes"]) + 1))
            continue
        cells = []
        for b in args["batch_sizes"]:
            c = r[f"b{b}"]
            x = f" ({c['speedup_vs_ref']:.2f}x)" if "speedup_vs_ref" in c else ""
            cells.append(f"{c['samples_per_s']:,.0f}{x}, {c['p50_ms']:.2f} / {c['p99_ms']:.2f}")
        delta = f" ({r['ne_delta_rel_vs_ref']:+.3%})" if "ne_delta_rel_vs_ref" in r else ""
        lines.append(f"| {r['config']} | {r['variant']} | " + " | ".join(cells) + f" | {r['ne']:.5f}{delta} | {r['auc']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    from bench.e2e.cli import init_process_group

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="inference_") as tmp:
        if args.run is not None:
            from launch.export import run_config

            rows += bench_config(args, "run", run_config(args.run), Path(args.run))
        else:
            init_process_group(device.type)
            composer = Composer(stack)
            for config in args.config_names:
                job, run = train_run(composer, args, config, Path(tmp))
                rows += bench_config(args, config, job, run)
    result = {
        "command": "python -m bench.inference " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
    }
    (out / "inference.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "inference.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
