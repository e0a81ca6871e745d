"""The benchmark's command line: its arguments and ``main``, what ``python -m bench.e2e`` runs.

Example (CPU, tiny, well under a minute)::

    python -m bench.e2e --out /tmp/e2e --dry-run --configs dlrm --variants bf16,loka_safe

or from Python, ``main(["--out", "/tmp/e2e", "--dry-run"])``; ``--render DIR`` rewrites
``DIR/e2e.md`` from ``DIR/e2e.json`` and runs nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import bench.e2e
from bench.e2e.isolate import run_isolated
from bench.e2e.protocol import Runs, progress, run_grid, train_steps
from bench.e2e.report import environment, render, report_data, write_report
from bench.e2e.variants import (
    CONFIGS,
    DEFAULT_VARIANTS,
    canonical_name,
    resolve_variants,
    torchao_status,
    with_loka_overrides,
)

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line `argv` (``sys.argv[1:]`` when None), checked, with every default filled
    in (the dry run's where ``--dry-run``) and the lists split (``config_names``,
    ``batch_sizes``, ``variant_names``, ``profile_names``)."""
    # No abbreviations: --isolate hands each child the command line with some options replaced.
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=bench.e2e.__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="directory for e2e.json and e2e.md")
    p.add_argument("--render", type=Path, metavar="DIR",
                   help="run nothing: rewrite DIR/e2e.md (ratios, targets, tables) from DIR/e2e.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes and steps, emulated FP8")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (default), or cpu: the real model configs on the CPU with emulated FP8, "
                        "for NE questions without a GPU (slow: use small --batches); the dry run is cpu")
    p.add_argument("--configs", default="dlrm,dcn,wukong", help="comma-separated subset of dlrm,dcn,wukong")
    p.add_argument("--batches", default=None, help="per-GPU batch sizes, comma-separated (default 8192; dry run 64)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated variants")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; dry run 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 100; dry run 4)")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps after the timed ones (default 5; dry run 2)")
    p.add_argument("--no-profile", action="store_true", help="no profiler window (and no extra steps)")
    p.add_argument("--ledger", action="store_true",
                   help="LoKA variants measure the per-GEMM ledger after training (loka.ledger=true): "
                        "in the JSON and the report, with the step speed-ups it predicts")
    p.add_argument("--profile-variants", default="bf16,loka_aggressive", help="variants whose steps are profiled")
    p.add_argument("--loka-override", action="append", default=[], metavar="KEY=VALUE",
                   help="a hydra override of the preset for every loka_safe / loka_aggressive variant "
                        "(repeatable), e.g. loka.probe.sites_per_step=2; its decision run takes it too")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also write each profiled window (first round) as a gzipped Chrome trace "
                        "DIR/<config>_b<batch>_<variant>.json.gz, for perfetto / chrome://tracing")
    p.add_argument("--pyprofile", default=None, metavar="DIR",
                   help="also run cProfile over each profiled window (first round) and write the host "
                        "functions by own time and by cumulative time to DIR/py_<config>_b<batch>_<variant>.txt "
                        "(Python host work the torch profiler does not show: callbacks, pipelines)")
    p.add_argument("--warm-run", action="store_true",
                   help="before the first measured run, run the first variant once (20 timed steps, "
                        "from step 0) and keep it out of the results, so no variant pays for the "
                        "process's first run (on an H100, host-bound DLRM ran slower in a process's "
                        "first runs)")
    p.add_argument("--memory-trace", action="store_true",
                   help="CUDA: record the allocator's events with Python stacks from the start of each run and "
                        "report what was allocated at its peak, by owner (slows the host: not for speed figures)")
    p.add_argument("--step-diag", action="store_true",
                   help="record per timed step its host time and the CUDA allocator's cudaMalloc / "
                        "cudaFree calls and retries (one memory_stats() call per step); the report lists "
                        "the slow steps with them (where a mean above the median comes from)")
    p.add_argument("--ne-steps", type=int, default=None,
                   help="train this many steps in all before the eval NE (untimed after the timed and "
                        "profiled ones; default 2000, dry run 0: no more than those), so NE is compared "
                        "past the first, chaotic steps; a LoKA run is then evaluated a second time with its FP8 "
                        "forwards in high precision (eval_ne_forwards_high: the NE its forwards cost at "
                        "evaluation, apart from what FP8 changed in training)")
    p.add_argument("--ne-from", type=int, default=0, metavar="N0",
                   help="paired continuations: per seed, --ne-base trains N0 steps and saves a checkpoint; "
                        "every variant resumes that checkpoint (trainer.resume_new_callbacks) and runs its "
                        "warm-up, timed and profiled steps, and --ne-steps in all, from there; a LoKA "
                        "variant's decision run resumes it too (its plans from the Probe's statistics of the "
                        "steps after N0; with --decide-once, of the first seed's checkpoint). The variants of one seed then differ only in the steps after N0 (0: "
                        "every run from step 0)")
    p.add_argument("--ne-decay", type=float, default=0.0, metavar="F",
                   help="decay both learning rates over the last fraction F of every variant's n steps "
                        "(trainer.lr_decay_*, power 2: the first of them at the full rate, the last at "
                        "(1/n)^2 of it), so each run ends in a basin and not wherever constant-rate noise "
                        "leaves it (0: constant rates; the --ne-from base never decays)")
    p.add_argument("--ne-base", default="bf16",
                   help="the variant that trains the shared checkpoint of --ne-from (no LoKA, no torchao)")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches for NE (default 32; dry run 2)")
    p.add_argument("--decide-steps", type=int, default=None, help="LoKA decision run length (default 30; dry run 8)")
    p.add_argument("--decide-interval", type=int, default=None, help="probe interval of the decision run (default 5; dry run 2)")
    p.add_argument("--cache-batches", type=int, default=None,
                   help="distinct train batches, cycled (data.cache_batches); default: one per step "
                        "of the longest run, so no batch repeats and eval NE is not overfitting")
    p.add_argument("--fp8-backend", default=None, help="backend of fp8_everywhere (default torch_scaled_mm; dry run emulated)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; dry run aot_eager)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every variant this many times, in rounds whose order rotates (A B C, "
                        "B C A, C A B, ...; balanced when N is a multiple of the number of "
                        "variants), the i-th round with trainer.seed=i for all variants; the report "
                        "gives the median step time over rounds and the mean eval NE with its "
                        "spread: one GPU run is not deterministic (NE moved +-3.5%% between "
                        "identical H100 runs after 200 steps, up to 1.2%% after 2000)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="trainer.seed of the first round (round i: first seed + i)")
    p.add_argument("--share-decisions", action="store_true",
                   help="LoKA variants that differ only in how plans run (+static, +dynamic, +nofold, +bits, +nobits, +foldgrad, +tail, +notail, +rotate, +tilegrid, +compilesampled, +eagersampled, +compile, +pageable) share "
                        "one decision run per config, batch and seed: the first decides, the others take its "
                        "plans, so they compare the option on the same plans (and spend one decision run)")
    p.add_argument("--decide-once", action="store_true",
                   help="--share-decisions across seeds too: one decision run per config and batch (the "
                        "first seed's), whose plans every seed's runs take: for an NE protocol over seeds "
                        "that compares numerics on the same plans, at one ~3 min decision run instead of one "
                        "a seed")
    p.add_argument("--decisions", default=None, metavar="DIR",
                   help="keep every decision run's decided state in DIR and take one from there when it "
                        "holds it (the same config, batch, seed or --decide-once, preset and overrides, "
                        "decision length, interval and --ne-from): the runs of --isolate's processes and "
                        "of later calls then time and measure the NE of the same plans")
    p.add_argument("--isolate", action="store_true",
                   help="run every (variant, round) in a fresh process, in the rotated order, and "
                        "merge their records: on an H100 a host-bound variant's step time moved by "
                        "up to 1.8x between rounds of one process (bench/results/"
                        "sampled_replay_h100_2026-11-25/NOTES.md); each child's output is under "
                        "OUT/runs/")
    p.add_argument("--timing", choices=("sync", "events"), default=None,
                   help="events (default on CUDA): CUDA events at step ends, no host sync, so the host "
                        "runs ahead as in a real run and a step costs its GPU time unless the host is "
                        "slower; sync (the only choice on the CPU): wall clock with torch.cuda.synchronize() at each step end, which "
                        "serializes host and GPU work and overstates host-bound steps")
    args = p.parse_args(argv)
    if args.render is not None:
        return args
    if args.out is None:
        p.error("--out DIR is required (or --render DIR)")
    dry = args.dry_run
    if args.device is None:
        args.device = "cpu" if dry else "cuda"
    elif dry and args.device != "cpu":
        raise SystemExit("--dry-run runs on the CPU: drop --device cuda")
    on_cpu = args.device == "cpu"
    if on_cpu and args.timing == "events":
        raise SystemExit("--timing events needs CUDA: use --timing sync on the CPU")
    if args.timing is None:
        args.timing = "sync" if on_cpu else "events"
    defaults = {
        "batches": "64" if dry else "8192",
        # 40 timed steps of one run could not resolve a few percent on an H100 (p10-p90 of bf16
        # Wukong 16.9-23.9 ms); NE after 60 steps was still chaotic (Wukong NE
        # moved 4% between bf16 and bf16+compile), and after 200 steps +-3.5% between identical
        # runs; after 2000 steps on 32 eval batches the same kernels stayed within about 1%
        # (SINGLE_RUN_NE_NOISE). 2000 cached batches of 8192 take ~7 GB of host memory.
        "warmup": 2 if dry else 20,
        "steps": 4 if dry else 100,
        "ne_steps": 0 if dry else 2000,
        "profile_steps": 2 if dry else 5,
        "eval_batches": 2 if dry else 32,
        "decide_steps": 8 if dry else 30,
        "decide_interval": 2 if dry else 5,
        "fp8_backend": "emulated" if on_cpu else "torch_scaled_mm",
        "compile_backend": "aot_eager" if on_cpu else "inductor",
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.no_profile:
        args.profile_steps = 0
        if args.trace or args.pyprofile:
            raise SystemExit("--trace and --pyprofile take the profiled window: drop --no-profile")
    args.train_steps = train_steps(args)
    if args.cache_batches is None:
        # Cycling a few batches let the 10k-row tables memorize them: on an H100 (16 batches of
        # 8192, 60 steps) eval NE came out 1.0-1.5 and moved 6-8% between bf16 and
        # bf16+compile, so no NE delta meant anything.
        args.cache_batches = args.ne_from + max(args.train_steps, args.decide_steps)
    for name in ("warmup", "steps", "eval_batches", "decide_steps", "decide_interval", "cache_batches", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.profile_steps < 0 or args.ne_steps < 0:
        raise SystemExit("--profile-steps and --ne-steps must be >= 0")
    if args.ne_from < 0:
        raise SystemExit("--ne-from must be >= 0 (0: no shared checkpoint)")
    args.share_decisions = args.share_decisions or args.decide_once
    if args.isolate and args.share_decisions:
        raise SystemExit("--isolate starts a fresh process per run: --share-decisions (and --decide-once) "
                         "have no decision to share")
    if args.isolate and (args.ne_from or args.warm_run):
        raise SystemExit("--isolate starts a fresh process per run: --ne-from's shared checkpoints and "
                         "--warm-run belong to one process; drop them or --isolate")
    if args.first_seed < 0:
        raise SystemExit("--first-seed must be >= 0")
    if not 0.0 <= args.ne_decay <= 1.0:
        raise SystemExit(f"--ne-decay {args.ne_decay}: a fraction of the steps, from 0 (off) to 1")
    args.config_names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.config_names if c not in CONFIGS]
    if unknown or not args.config_names:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    args.variant_names = [v for v in args.variants.split(",") if v]
    args.profile_names = {canonical_name(v) for v in args.profile_variants.split(",") if v}
    if args.trace and not args.profile_names & {canonical_name(v) for v in args.variant_names}:
        raise SystemExit("--trace writes the profiled windows, and no variant of --variants is in --profile-variants")
    return args


def _configure_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("bench.e2e").setLevel(logging.INFO)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def init_process_group(device_type: str) -> None:
    """One 1-rank group for every run (each Trainer reuses it instead of creating its own)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(0)
    fd, store = tempfile.mkstemp(prefix="e2e_pg_")
    os.close(fd)
    os.unlink(store)  # the FileStore creates it
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or ``--render`` a report) with the command line `argv`.

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status: 0, 1 when a run failed (it is recorded and the benchmark goes on),
        2 without the CUDA device asked for.
    """
    args = parse_args(argv)
    if args.render is not None:
        render(args.render)
        return 0
    _configure_logging()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.dry_run:
        # One thread: dev machines are small and shared, and a dry run checks the plumbing.
        torch.set_num_threads(1)
    elif args.device == "cuda" and not torch.cuda.is_available():
        logger.error("no CUDA device: use --dry-run (tiny) or --device cpu (real configs) on a CPU")
        return 2
    variants = with_loka_overrides(resolve_variants(args.variant_names, args.fp8_backend), args.loka_override)
    (ne_base,) = resolve_variants([args.ne_base], args.fp8_backend)
    if args.ne_from and (ne_base.loka != "off" or ne_base.torchao):
        raise SystemExit(f"--ne-base {ne_base.name}: the shared checkpoint comes from a run without LoKA or torchao")
    env = environment(args.device)
    missing = torchao_status()
    t0 = time.perf_counter()
    progress(t0, f"{env['gpu']}; torch {env['torch']}, torchrec {env['torchrec']}, torchao {env['torchao']}")
    if missing and any(v.torchao for v in variants):
        progress(t0, f"torchao variants not run: {missing}")
    runs = Runs()
    command = "python -m bench.e2e " + shlex.join(sys.argv[1:] if argv is None else argv)

    def finish() -> dict[str, Any]:
        """Ratios, targets and both files from the runs so far (rewritten after every run, so
        a benchmark cut short by a time limit still leaves its results)."""
        report = report_data(args, command=command, env=env, variants=variants, runs=runs, t0=t0)
        write_report(args.out, report)
        return report

    if args.isolate:
        run_isolated(args, sys.argv[1:] if argv is None else argv, variants, runs, t0=t0, on_run=finish)
    else:
        init_process_group(args.device)
        try:
            run_grid(args, variants, ne_base, runs, t0=t0, torchao_missing=missing, on_run=finish)
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    report = finish()
    errors = [r for r in runs.raw if r["status"] == "error"]
    progress(t0, f"wrote {args.out}/e2e.md and e2e.json: {len(runs.raw)} runs, {len(errors)} errors")
    for t in report["targets"]:
        print(f"  {t['status']:>13}  issue {t.get('issue', 9)} [{t['variant']}] {t['target']}: {t['detail']}", flush=True)
    return 1 if errors else 0
