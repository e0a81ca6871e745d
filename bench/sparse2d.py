"""2D sparse parallelism: step time and NE, fully sharded against replicated tables.

Variants (same model, data and seeds; each a job under torchrun on ``--nprocs`` processes, one
per GPU):

* ``dmp``: plain DistributedModelParallel, tables sharded table-wise over every GPU;
* ``2d_fp32``: ``trainer.sharding_group_size=--group-size`` (tables sharded within groups of
  that many GPUs and replicated across the groups: 1 on 2 GPUs is two full replicas, 2 on 4 GPUs
  is "2 x 2"), replicas synced after every step by TorchRec's ``DMPCollection.sync`` (fp32 mean
  of weights and optimizer state);
* ``2d_loka_bf16`` / ``2d_loka_fp8``: the same, synced by LoKA's ``comm.ReplicaSync`` (the change
  since the last sync in BF16 / row-wise FP8 with error feedback; the optimizer state in fp32);
  the LoKA callback runs only its comm part.

Step time comes from a timed job per variant: ``--steps`` steps on 16 cached batches (the CPU
data generator would otherwise bound the step rate). Each job also reports the largest
difference between the replicas' embedding weights and optimizer state after its last sync (0
for the 2D variants), then times 12 more syncs alone (``sync ms``: the median of those that do
not measure their change; ``sampled sync ms``: of those that do, every ``comm.sample_every``-th of
LoKA's), which says what a sync costs apart from the step around it.

NE by the paired, decayed protocol (``--ne-from N0 --ne-steps M --seeds S``, as ``bench.comm``):
a fully sharded DMP base run trains N0 steps and saves a checkpoint; for each variant and seed
s < S a job starts a new run from it (the 2D variants copy its tables into their shards:
``checkpoint.load_by_copy``) and trains M more steps on the train batches of steps N0 + s*M
onwards, both learning rates decaying to 0, then evaluates ``--eval-batches`` held-out batches.
Without ``--ne-from`` the jobs train M steps from scratch (data and model seeded with s), the
learning rates decaying over the second half: runs that short are chaotic (one variant's seeds
differed by up to 15% in NE), so they cannot compare the syncs. The NE delta against ``dmp``
is taken per seed and averaged, with its standard error over seeds (``bench.comm.paired_ne``);
the LoKA-synced variants are also paired against ``2d_fp32``, the same replicated training with
TorchRec's exact sync (what LoKA's compressed sync changes, apart from what replicating the
tables changes).

26 tables x dim 128, 100k rows, batch 8192 per GPU, 100 timed steps by default: on 2 x H100 the
first two timed variants finished within 85 s, start-up included
(`bench/results/multigpu_h100x2_2026-11-25/sparse2d.txt`).

Run (2 GPUs):  python -m bench.sparse2d --out bench/results/sparse2d_<gpu>_<date> [--seeds 4 --ne-from 200 --ne-steps 100]
Run (4 GPUs, 2 x 2):  python -m bench.sparse2d --nprocs 4 --group-size 2 --out DIR
Dry run (CPU): python -m bench.sparse2d --dry-run --out /tmp/sparse2d [--seeds 2]  (the ``dmp``
variant only, tiny: 2D sparse parallelism needs CUDA; the others are listed as skipped)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.comm import abort_notes, paired_ne, run_job, shifted_train_data

VARIANTS = ("dmp", "2d_fp32", "2d_loka_bf16", "2d_loka_fp8")


def job(spec: dict[str, Any]) -> None:
    """One run (called on every rank by torchrun), as `spec` says (`main` writes it): ``out``,
    ``variant``, ``steps``, ``group_size`` (of the 2D variants), the sizes ``batch``, ``tables``,
    ``dim``, ``rows``, ``cache_batches`` (0: a fresh batch every step), ``seed`` (model and data),
    ``decay_start`` / ``decay_steps`` (trainer.lr_decay_*); optional: ``resume`` (a checkpoint to
    start a new run from), ``checkpoint_at_end``, ``data_offset`` (train batches read that many
    steps further on), ``eval_batches`` (4), ``warmup`` (dense warm-up steps, min(20, steps)),
    ``time_syncs`` (time and profile syncs after training, default true), ``data_seed`` (the
    synthetic task, default ``seed``), ``resume_in_place`` (a 2D run resumes through DCP into its
    live tensors instead of by copy); rank 0 writes
    ``<out>/result.json``."""
    import torch
    import torch.distributed as dist

    from loka_train.comm import CommConfig
    from loka_train.data import DataConfig
    from loka_train.dispatch import DispatchConfig
    from loka_train.models import ModelConfig
    from loka_train.mods.config import ModsConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.plugin.config import LokaConfig
    from loka_train.probe import ProbeConfig
    from loka_train.runtime import TrainerConfig
    from loka_train.runtime.callbacks import Callback
    from loka_train.runtime.sparse2d import (
        replica_process_group,
        replicated_shards,
        shards_not_live,
    )
    from loka_train.runtime.trainer import Trainer

    out, variant, steps, dim = spec["out"], spec["variant"], spec["steps"], spec["dim"]
    cuda = torch.cuda.is_available()
    callbacks = []
    loka = None
    if variant.startswith("2d_loka_"):
        loka = LokaCallback(LokaConfig(
            enabled=True, mods=ModsConfig(enabled=False), probe=ProbeConfig(enabled=False),
            dispatch=DispatchConfig(enabled=False), comm_enabled=True,
            comm=CommConfig(replica_sync=variant.removeprefix("2d_loka_"), row_dim=dim),
        ))
        callbacks.append(loka)
    class StartStep(Callback):
        """The step training starts from, once any checkpoint is restored."""

        start: int | None = None

        def on_train_start(self, trainer: Any) -> None:
            self.start = trainer.step

    class InPlaceTrainer(Trainer):
        """Resumes through DCP loading into the live tensors, also under 2D (``resume_in_place``:
        whether DCP loads TorchRec's LocalShardsWrapper DTensors in place on this stack)."""

        def _resumes_by_copy(self) -> bool:
            return False

    started = StartStep()
    resume = spec.get("resume")
    with shifted_train_data(spec.get("data_offset", 0)):
        trainer = (InPlaceTrainer if spec.get("resume_in_place") else Trainer)(
            model=ModelConfig(kind="dlrm", embedding_dim=dim, dense_arch_layer_sizes=[512, 256, dim],
                              over_arch_layer_sizes=[1024, 1024, 512, 256, 1]),
            # The data seed picks the synthetic task (teacher, features): continuations keep
            # their base run's and differ by `data_offset` only.
            data=DataConfig(num_sparse=spec["tables"], num_embeddings=spec["rows"],
                            cache_batches=spec["cache_batches"], seed=spec.get("data_seed", spec["seed"])),
            trainer=TrainerConfig(
                steps=steps, batch_size=spec["batch"], device="cuda" if cuda else "cpu", sharding="table_wise",
                sharding_group_size=None if variant == "dmp" else spec["group_size"], seed=spec["seed"],
                lr_decay_start=spec["decay_start"], lr_decay_steps=spec["decay_steps"],
                dense_dtype="bf16" if cuda else "fp32", dense_lr=0.01,
                dense_warmup_steps=spec.get("warmup", min(20, steps)),
                log_every=max(1, steps // 4), eval_batches=spec.get("eval_batches", 4), out_dir=out,
                tensorboard=False, progress_bar=False, checkpoint_at_end=spec.get("checkpoint_at_end", False),
                resume=resume if resume is not None else "never",
                # The base run has no LoKA callback, so its checkpoint holds no LoKA state.
                resume_new_callbacks=resume is not None,
            ),
            callbacks=[*callbacks, started],
        )
    summary = trainer.fit()

    def max_replica_diff(tensors: list[torch.Tensor], group: Any) -> float:
        """Largest difference between the copies of `tensors` held by the ranks of `group` (this
        rank's replica group: the ranks holding the same shards)."""
        diffs = []
        size = dist.get_world_size(group)
        for tensor in tensors:
            gathered = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(gathered, tensor.contiguous(), group=group)
            diffs.append(max(float((g - gathered[0]).abs().max()) for g in gathered))
        return max(diffs, default=float("nan"))

    max_diff = state_diff = float("nan")
    not_live = shards_not_live(trainer.model, trainer.model.fused_optimizer)
    if variant != "dmp":
        assert trainer.sparse2d is not None  # a 2D variant
        group = replica_process_group(trainer.model, trainer.sparse2d, trainer.rank)
        weights, states = replicated_shards(trainer.model, trainer.model.fused_optimizer)
        max_diff = max_replica_diff(list(weights.values()), group)
        state_diff = max_replica_diff(states, group)  # the fused optimizer's momentum / accumulators
        # Every rank's largest difference, to rank 0 (its own replica group is one of several).
        worst = torch.tensor([max_diff, state_diff], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        max_diff, state_diff = (float(v) for v in worst)
    # The bytes the training's syncs sent, before the timed syncs below add theirs.
    rep = loka.comm_state.report() if loka is not None else None
    timing = variant != "dmp" and spec.get("time_syncs", True)
    syncs = time_syncs(trainer, loka, count=12) if timing else []
    sync_kernels = profile_sync(trainer, loka) if timing else []
    if trainer.rank == 0:
        result = {
            "variant": variant, "seed": spec["seed"], "nprocs": trainer.world_size,
            "group_size": None if variant == "dmp" else spec["group_size"], "steps": steps,
            "steps_per_s": summary["train/steps_per_s"],
            "step_ms": 1000 / summary["train/steps_per_s"], "eval_ne": summary["eval/ne"],
            "train_loss": summary["train/loss"], "replica_max_abs_diff": max_diff,
            "start_step": started.start, "resumed_from": resume, "data_offset": spec.get("data_offset", 0),
            "run_dir": str(trainer.out_dir),
            "replica_state_max_abs_diff": state_diff,
            "replica_sync_bytes_rank0": rep["channels"]["replica_sync"]["total_bytes"] if rep else None,
            "syncs_timed": syncs, **sync_summary(syncs), "shards_not_live": not_live,
            "sync_kernels": sync_kernels,
            "fallbacks": summary["fallbacks"], "device": str(summary["device"]),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        }
        (Path(out) / "result.json").write_text(json.dumps(result, indent=2))
    trainer.close()


def time_syncs(trainer: Any, loka: Any, *, count: int) -> list[dict[str, Any]]:
    """`count` replica syncs more after training, each timed alone (host wall time between two
    device synchronizations, in ms), and whether it measured its change (LoKA's sync measures
    every ``comm.sample_every``-th one): what a sync costs in the step, apart from the step.
    The replicas stay identical (every replica applies the same mean)."""
    import time

    import torch

    cuda = torch.cuda.is_available()
    syncer = getattr(loka, "replica_syncer", None)  # None where TorchRec's own sync stays
    timed = []
    for _ in range(count):
        sampled = syncer is not None and syncer.next_sync_measures
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.replica_sync(trainer.step - 1)
        if cuda:
            torch.cuda.synchronize()
        timed.append({"ms": (time.perf_counter() - start) * 1e3, "sampled": sampled})
    return timed


def profile_sync(trainer: Any, loka: Any) -> list[dict[str, Any]]:
    """The GPU time of one sync that does not measure its change, by kernel (torch.profiler; the
    12 longest, in ms): where a sync's time goes. Empty without CUDA."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return []
    syncer = getattr(loka, "replica_syncer", None)  # None where TorchRec's own sync stays
    while syncer is not None and syncer.next_sync_measures:
        trainer.replica_sync(trainer.step - 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.replica_sync(trainer.step - 1)
        torch.cuda.synchronize()
    by_kernel: dict[str, list[float]] = {}
    for e in prof.events():  # kernels and copies on the GPU; record_function ranges are not kernel time
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            ms_calls = by_kernel.setdefault(e.name[:120], [0.0, 0])
            ms_calls[0] += e.time_range.elapsed_us() / 1e3
            ms_calls[1] += 1
    rows: list[dict[str, Any]] = [{"kernel": name, "ms": ms, "calls": int(calls)} for name, (ms, calls) in by_kernel.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:12]


def sync_summary(syncs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median ms of the timed syncs that did not measure their change and of those that
    did (None where there were none).

    >>> sync_summary([{"ms": 2.0, "sampled": False}, {"ms": 4.0, "sampled": False}, {"ms": 30.0, "sampled": True}])
    {'sync_ms': 3.0, 'sampled_sync_ms': 30.0}
    """
    import statistics

    plain = [s["ms"] for s in syncs if not s["sampled"]]
    sampled = [s["ms"] for s in syncs if s["sampled"]]
    return {"sync_ms": statistics.median(plain) if plain else None,
            "sampled_sync_ms": statistics.median(sampled) if sampled else None}


def run_variant(out: Path, variant: str, steps: int, batch: int, tables: int, dim: int, rows: int, *,
                nprocs: int = 2, group_size: int = 1, seed: int = 0, cache_batches: int = 16,
                decay_start: int = 0, decay_steps: int = 0, **more: Any) -> dict[str, Any]:
    """Run one variant under torchrun (`nprocs` processes) in the folder `out`; rank 0's result.
    `more`: the optional keys of `job`'s spec."""
    spec = {"out": str(out), "variant": variant, "steps": steps, "batch": batch, "tables": tables,
            "dim": dim, "rows": rows, "group_size": group_size, "seed": seed, "cache_batches": cache_batches,
            "decay_start": decay_start, "decay_steps": decay_steps, **more}
    result = run_job(spec, module="bench.sparse2d", nprocs=nprocs)
    if result is None:
        raise RuntimeError(f"bench.sparse2d: {variant} failed (its output is printed above)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse2d", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nprocs", type=int, default=2, help="processes (GPUs) per job (default 2)")
    parser.add_argument("--group-size", type=int, default=1,
                        help="trainer.sharding_group_size of the 2D variants; divides --nprocs (default 1)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant (default 100)")
    parser.add_argument("--batch", type=int, default=8192, help="per-GPU batch (default 8192)")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", type=int, default=0, metavar="S",
                        help="NE jobs per variant, paired by seed against dmp (default 0: no NE protocol)")
    parser.add_argument("--ne-steps", type=int, default=200, metavar="M",
                        help="steps of each NE job: from scratch, the learning rates decaying over the second "
                             "half; with --ne-from, over all of them (default 200)")
    parser.add_argument("--ne-from", type=int, default=0, metavar="N0",
                        help="NE jobs continue a base run: fully sharded DMP trains N0 steps and saves the "
                             "checkpoint every variant and seed resumes from (2D ones by copy); 0: from scratch")
    parser.add_argument("--eval-batches", type=int, default=4,
                        help="held-out batches per rank for NE (default 4)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        job(json.loads(args.job))
        return 0
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.nprocs < 2 or args.group_size < 1 or args.nprocs % args.group_size or args.group_size == args.nprocs:
        parser.error(f"--group-size {args.group_size} must divide --nprocs {args.nprocs} (>= 2) and be smaller: "
                     "the 2D variants need at least two replica groups")
    if args.seeds < 0 or (args.seeds and args.ne_steps < 4):
        parser.error("--seeds must be >= 0 and --ne-steps >= 4 (the decay takes its second half)")
    if args.ne_from < 0 or (args.ne_from and not args.seeds):
        parser.error("--ne-from N0 (>= 0) is the base run of the NE protocol: add --seeds S")
    if args.seeds and "dmp" not in variants:
        parser.error("--seeds: the NE deltas are taken against dmp; add it to --variants")
    if args.dry_run:
        import torch

        args.steps, args.batch, args.tables, args.dim, args.rows = 8, 64, 4, 8, 200
        args.ne_steps = min(args.ne_steps, 8)
        if not torch.cuda.is_available():
            skipped = [v for v in variants if v != "dmp"]
            if skipped:
                print(f"dry run on CPU: skipping {skipped} (2D sparse parallelism needs CUDA)")
            variants = [v for v in variants if v == "dmp"]
    variants.sort(key=lambda v: v != "dmp")  # dmp first: the reference of every ratio
    out = Path(args.out)
    sizes = {"batch": args.batch, "tables": args.tables, "dim": args.dim, "rows": args.rows,
             "nprocs": args.nprocs, "group_size": args.group_size}
    results: list[dict[str, Any]] = []
    base_run = None
    if args.ne_from:
        base_run = run_variant(out / "ne_base", "dmp", args.ne_from, **sizes, cache_batches=0,
                               checkpoint_at_end=True, eval_batches=args.eval_batches)
        print(f"NE base (dmp): checkpoint at step {base_run['steps']}, NE {base_run['eval_ne']:.5f}", flush=True)
    for variant in variants:
        r = run_variant(out / variant, variant, args.steps, **sizes)
        results.append(r)
        print(f"{variant}: {r['step_ms']:.2f} ms/step, replicas differ by {r['replica_max_abs_diff']:.3g}", flush=True)
        r["ne_by_seed"] = []
        for seed in range(args.seeds):
            if base_run is None:  # from scratch, decayed over the second half
                half = args.ne_steps // 2
                schedule = {"decay_start": args.ne_steps - half, "decay_steps": half}
                steps = args.ne_steps
            else:  # from the base checkpoint, decayed over every step, each seed on its own batches
                schedule = {"decay_start": args.ne_from, "decay_steps": args.ne_steps, "resume": base_run["run_dir"],
                            "data_offset": seed * args.ne_steps, "data_seed": 0, "warmup": min(20, args.ne_from)}
                steps = args.ne_from + args.ne_steps
            ne = run_variant(out / variant / f"ne_seed{seed}", variant, steps, **sizes, seed=seed, cache_batches=0,
                             eval_batches=args.eval_batches, time_syncs=False, **schedule)
            r["ne_by_seed"].append(ne)
            print(f"{variant} seed {seed}: NE {ne['eval_ne']:.5f}", flush=True)
        # Rewritten after every variant: a run cut short keeps the variants it finished.
        if args.seeds:
            paired_ne(results, key="variant", base="dmp")
            if any(r["variant"] == "2d_fp32" for r in results):
                paired_ne(results, key="variant", base="2d_fp32")
        lines = table(results, args, sys.argv[1:] if argv is None else argv)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sparse2d.md").write_text("\n".join(lines) + "\n")
        (out / "sparse2d.json").write_text(json.dumps(results, indent=2))
    if results:
        print("\n".join(lines))
    return 0


def _delta_cell(row: dict[str, Any], base: str) -> str:
    """``+x% +- se`` of a row's paired NE delta against `base`, or ``-`` where not computed."""
    mean = row.get(f"ne_delta_vs_{base}_mean")
    if mean is None:
        return "-"
    se = row[f"ne_delta_vs_{base}_stderr"]
    return f"{mean:+.4%}" + (f" +- {se:.4%}" if se is not None else "")


def _ms_cell(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def table(results: list[dict[str, Any]], args: argparse.Namespace, argv: list[str]) -> list[str]:
    """sparse2d.md: one row per variant, ratios against the first (``dmp`` where it ran)."""
    base = results[0]
    layout = f"{args.nprocs} GPUs, 2D groups of {args.group_size}"
    lines = [f"# 2D sparse parallelism, {layout} ({base['gpu']}, torch {base['torch']})", "",
             f"Command: `python -m bench.sparse2d {' '.join(argv)}` ({args.tables} tables x {args.dim}, "
             f"{args.rows} rows, batch {args.batch}/GPU, {args.steps} timed steps on 16 cached batches, "
             "table-wise).", ""]
    if args.seeds and args.ne_from:
        lines += [f"NE: paired, decayed protocol ({args.seeds} seeds). A fully sharded DMP base run trains "
                  f"{args.ne_from} steps and saves a checkpoint; every variant and seed s starts a new run from it "
                  f"(the 2D variants copy its tables into their shards) and trains {args.ne_steps} more steps on the "
                  f"train batches of steps {args.ne_from} + s x {args.ne_steps} onwards, both learning rates decaying "
                  f"to 0, then evaluates {args.eval_batches} held-out batches per GPU. NE is the mean over seeds; NE "
                  "vs dmp (and vs 2d_fp32, the same replicated training synced exactly) the mean of the per-seed "
                  "deltas +- its standard error.", ""]
    elif args.seeds:
        lines += [f"NE: paired by seed ({args.seeds} seeds): each variant trains {args.ne_steps} steps from scratch "
                  "on fresh batches of the seed's stream, both learning rates decaying to 0 over the second "
                  "half, then evaluates the same held-out batches; NE is the mean over seeds, NE vs dmp (and vs "
                  "2d_fp32, the same replicated training synced exactly) the "
                  "mean of the per-seed deltas +- its standard error. Runs this short from scratch are chaotic: "
                  "prefer --ne-from.", ""]
    if args.seeds:
        lines += [f"| variant | ms/step | speed vs {base['variant']} | NE | NE vs dmp (paired) | NE vs 2d_fp32 (paired) "
                  "| replica max diff "
                  "| sync MB/step (rank 0) | sync ms | sampled sync ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["NE: not measured (the timed jobs repeat 16 batches; add `--seeds`).", "",
                  f"| variant | ms/step | speed vs {base['variant']} | replica max diff | sync MB/step (rank 0) "
                  "| sync ms | sampled sync ms |",
                  "|---|---|---|---|---|---|---|"]
    for r in results:
        sync = r["replica_sync_bytes_rank0"]
        sync_mb = f"{sync / r['steps'] / 1e6:.2f}" if sync is not None else "n/a"
        ne = ""
        if args.seeds:
            ne = f" {r['ne_mean']:.5f} | {_delta_cell(r, 'dmp')} | {_delta_cell(r, '2d_fp32')} |"
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {base['step_ms'] / r['step_ms']:.2f}x |{ne} "
                     f"{r['replica_max_abs_diff']:.3g} | {sync_mb} | {_ms_cell(r.get('sync_ms'))} | "
                     f"{_ms_cell(r.get('sampled_sync_ms'))} |")
    for r in results:
        if r.get("shards_not_live"):
            lines += ["", f"**{r['variant']}: the shards {r['shards_not_live']} are copies, not the model's "
                      "tensors: its replica max diff says nothing about the model.**"]
        if r.get("sync_kernels"):
            lines += ["", f"{r['variant']}: GPU time of one unsampled sync on rank 0, by kernel (torch.profiler):", "",
                      "| kernel | ms | calls |", "|---|---|---|"]
            lines += [f"| `{k['kernel']}` | {k['ms']:.3f} | {k['calls']} |" for k in r["sync_kernels"]]
    lines += abort_notes([(r["variant"], r) for r in results]
                         + [(f"{r['variant']} seed {c['seed']}", c) for r in results for c in r["ne_by_seed"]])
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
