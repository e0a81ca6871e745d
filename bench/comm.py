"""Embedding all-to-all precision on 2 GPUs: throughput, NE and bytes for FP32, BF16, FP8.

Comm-heavy setting: 52 tables x dim 128, 100k rows each, table-wise sharded over 2 GPUs,
batch 16384 per GPU, TorchRec DLRM (MLPerf-like towers), fused row-wise Adagrad. For each
precision the same job (same data, seeds) runs under torchrun; the LoKA callback installs
only the comm codecs (no FP8 compute sites, no probe) so the comm precision is the only
difference. The 16 train batches are generated once and cycled (data.cache_batches) so that
the CPU input pipeline stays out of the timing; eval NE is on fresh held-out batches. Bytes are counted by the codec in encode (what each rank puts on the wire).

NE by the paired, decayed protocol (``--ne-from N0 --ne-steps M --seeds S``, as
``bench.e2e``'s ``--ne-from`` / ``--ne-decay 1``): one base job trains N0 steps with
TorchRec's own FP32 all-to-all (no codec) and saves a checkpoint that every other job shares;
then, for each precision and seed s < S, a job starts a new run from that checkpoint and
trains M more steps with both learning rates decaying to 0 over them (trainer.lr_decay_*),
then evaluates NE on the same held-out batches. The continuations of seed s all train on the
same fresh train batches, those of the steps N0 + s*M onwards of the stream (the RNG state
comes from the checkpoint, so the data is what tells seeds apart); the NE delta against
FP32 is taken per seed and averaged, with its standard error over seeds. Throughput stays
what the timed job measures (its cached batches): the continuations generate every batch
on the CPU, which bounds their step rate.

Run (2 GPUs):  python -m bench.comm --out bench/results/comm_a2a_h200x2_<date>
NE protocol:   python -m bench.comm --steps 60 --ne-from 200 --ne-steps 100 --seeds 2 --out DIR
Dry run (CPU): python -m bench.comm --dry-run --out /tmp/comm [--ne-from 4 --ne-steps 4 --seeds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: on the PYTHONPATH of the torchrun workers, which import ``bench.comm``."""

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
"""What ``--precisions`` may list (``loka_train.comm.CommPrecision``'s values)."""


class _ShiftedTrain:
    """A train split read `offset` steps further on: step s trains on the source's batch
    s + offset (``--seeds``: each seed's continuations see their own stretch of the stream)."""

    def __init__(self, source: Any, offset: int) -> None:
        self.source = source
        self.offset = offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def batch(self, step: int) -> Any:
        return self.source.batch(step + self.offset)

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Any]:
        return self.source.batches(start_step + self.offset, num_steps)


@contextlib.contextmanager
def shifted_train_data(offset: int) -> Iterator[None]:
    """Trainers built inside read their train split `offset` steps further on (eval unchanged)."""
    import loka_train.runtime.trainer as trainer_module

    original = trainer_module.make_dataset

    def make(cfg: Any, *, split: str, rank: int, world_size: int, batch_size: int) -> Any:
        ds = original(cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size)
        return _ShiftedTrain(ds, offset) if split == "train" and offset else ds

    trainer_module.make_dataset = make  # type: ignore[assignment]
    try:
        yield
    finally:
        trainer_module.make_dataset = original


def job(spec: dict[str, Any]) -> None:
    """One run (called on every rank by torchrun), as `spec` says (`main` writes it): ``out``;
    ``precision`` of both all-to-alls, or None for no codec (the ``--ne-from`` base);
    ``steps`` (the last step, counted from 0 of the base run); the sizes ``batch``, ``tables``,
    ``dim``, ``rows``; ``eval_batches``; ``cache_batches`` (0: a fresh batch every step);
    ``warmup`` (dense warm-up steps); ``resume`` (a checkpoint to start a new run from, or
    None); ``decay_start`` / ``decay_steps`` (trainer.lr_decay_*); ``data_offset``;
    ``seed``; ``checkpoint_at_end``."""
    import torch

    from loka_train.comm import CommConfig, CommPrecision
    from loka_train.data import DataConfig
    from loka_train.dispatch import DispatchConfig
    from loka_train.models import ModelConfig
    from loka_train.mods.config import ModsConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.plugin.config import LokaConfig
    from loka_train.probe import ProbeConfig
    from loka_train.runtime import TrainerConfig
    from loka_train.runtime.callbacks import Callback
    from loka_train.runtime.trainer import Trainer

    class StartStep(Callback):
        """The step training starts from, once any checkpoint is restored."""

        start: int | None = None

        def on_train_start(self, trainer: Any) -> None:
            self.start = trainer.step

    out, precision, steps, dim = spec["out"], spec["precision"], spec["steps"], spec["dim"]
    loka = None
    if precision is not None:
        p = CommPrecision(precision)
        loka = LokaCallback(LokaConfig(
            enabled=True, mods=ModsConfig(enabled=False), probe=ProbeConfig(enabled=False),
            dispatch=DispatchConfig(enabled=False), comm_enabled=True,
            comm=CommConfig(a2a_forward=p, a2a_backward=p, row_dim=dim),
        ))
    started = StartStep()
    cuda = torch.cuda.is_available()
    resume = spec["resume"]
    with shifted_train_data(spec["data_offset"]):
        trainer = Trainer(
            model=ModelConfig(kind="dlrm", embedding_dim=dim, dense_arch_layer_sizes=[512, 256, dim],
                              over_arch_layer_sizes=[1024, 1024, 512, 256, 1]),
            data=DataConfig(num_sparse=spec["tables"], num_embeddings=spec["rows"],
                            cache_batches=spec["cache_batches"]),
            trainer=TrainerConfig(
                steps=steps, batch_size=spec["batch"], device="cuda" if cuda else "cpu",
                sharding="table_wise", dense_dtype="bf16" if cuda else "fp32", dense_lr=0.01,
                dense_warmup_steps=spec["warmup"], lr_decay_start=spec["decay_start"],
                lr_decay_steps=spec["decay_steps"], seed=spec["seed"],
                log_every=max(1, steps // 4), eval_batches=spec["eval_batches"], out_dir=out,
                tensorboard=False, progress_bar=False, checkpoint_at_end=spec["checkpoint_at_end"],
                resume=resume if resume is not None else "never",
                # The base run has no LoKA callback, so its checkpoint holds no LoKA state.
                resume_new_callbacks=resume is not None,
            ),
            callbacks=[*([loka] if loka is not None else []), started],
        )
    summary = trainer.fit()
    if trainer.rank == 0:
        result: dict[str, Any] = {
            "precision": precision, "seed": spec["seed"], "steps_per_s": summary["train/steps_per_s"],
            "samples_per_s": summary["train/steps_per_s"] * summary["global_batch"],
            "eval_ne": summary["eval/ne"], "eval_auc": summary["eval/auc"], "train_loss": summary["train/loss"],
            "start_step": started.start, "steps": summary["steps"], "resumed_from": resume,
            "data_offset": spec["data_offset"], "run_dir": str(trainer.out_dir),
            "device": str(summary["device"]),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        }
        if loka is not None:
            rep = loka.comm_state.report()
            a2a = {c: rep["channels"][c]["total_bytes"] for c in ("a2a_fwd", "a2a_bwd")}
            trained = summary["steps"] - (started.start or 0)
            result["a2a_bytes_per_step_rank0"] = {c: b / trained for c, b in a2a.items()}
            result["fallbacks"] = rep["fallbacks"]
        (Path(out) / "result.json").write_text(json.dumps(result, indent=2))
    trainer.close()


_ABORTED = "Signal 6 (SIGABRT)"
"""How torchrun reports a worker that aborted in native code ("terminate called without an active
exception", seen in about one CPU test run in ten, while the processes start or as they exit)."""


def run_job(spec: dict[str, Any], module: str = "bench.comm", nprocs: int = 2) -> dict[str, Any] | None:
    """Run `spec` under torchrun on `nprocs` processes, as `module`'s ``--job``; its result (rank
    0's ``<spec["out"]>/result.json``), or None (its output printed) when it failed. A worker that
    aborted in native code is not a failed measurement where rank 0 had written its result (it
    needs every rank up to its end): the result says so (``aborted_at_exit``). A job whose worker
    aborted before that runs once more; the result then says so (``retried``). Either abort is
    printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
           "-m", module, "--out", spec["out"], "--job", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    result_path = Path(spec["out"]) / "result.json"
    notes: dict[str, str] = {}
    for attempt in range(2):
        result_path.unlink(missing_ok=True)  # a stale result would pass for this run's
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        if _ABORTED not in proc.stderr:
            return None
        if result_path.exists():
            notes["aborted_at_exit"] = f"a worker aborted (exit status {proc.returncode}) after the result was written"
            print(f"{module}: {spec['out']}: {notes['aborted_at_exit']}", file=sys.stderr)
            break
        if attempt:
            return None
        notes["retried"] = f"a worker aborted (exit status {proc.returncode}); ran again"
        print(f"{module}: {spec['out']}: {notes['retried']}", file=sys.stderr)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return {**result, **notes}


def abort_notes(labelled: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The Markdown lines that name the jobs a worker's abort touched (`run_job`'s ``retried``
    and ``aborted_at_exit``), from (label, result) pairs; none where no job was.

    >>> abort_notes([("fp8", {"retried": "ran again"}), ("bf16", {})])
    ['', 'Jobs whose worker aborted in native code: fp8: ran again.']
    """
    said = [f"{label}: {r[key]}" for label, r in labelled for key in ("retried", "aborted_at_exit") if key in r]
    return ["", "Jobs whose worker aborted in native code: " + "; ".join(said) + "."] if said else []


def paired_ne(results: list[dict[str, Any]], key: str = "precision", base: str = "fp32") -> None:
    """Add to each row (named by its `key`) its protocol figures, from its ``ne_by_seed`` runs:
    ``ne_mean``, each run's ``ne_delta_vs_<base>`` (relative to the `base` row's run of the same
    seed), their mean ``ne_delta_vs_<base>_mean`` and its standard error over seeds
    ``ne_delta_vs_<base>_stderr`` (None with one seed).

    >>> rows = [{"precision": "fp32", "ne_by_seed": [{"seed": 0, "eval_ne": 0.5}, {"seed": 1, "eval_ne": 0.4}]},
    ...         {"precision": "fp8", "ne_by_seed": [{"seed": 0, "eval_ne": 0.51}, {"seed": 1, "eval_ne": 0.4}]}]
    >>> paired_ne(rows)
    >>> [round(d["ne_delta_vs_fp32"], 6) for d in rows[1]["ne_by_seed"]], round(rows[1]["ne_delta_vs_fp32_stderr"], 6)
    ([0.02, 0.0], 0.01)
    """
    name = f"ne_delta_vs_{base}"
    ref = {r["seed"]: r["eval_ne"] for r in next(row for row in results if row[key] == base)["ne_by_seed"]}
    for row in results:
        for r in row["ne_by_seed"]:
            r[name] = (r["eval_ne"] - ref[r["seed"]]) / ref[r["seed"]]
        _summarize_seeds(row, name)


def _summarize_seeds(row: dict[str, Any], name: str) -> None:
    """A row's ``ne_mean`` and the mean and standard error (None with one seed) of its runs'
    per-seed `name` deltas."""
    runs = row["ne_by_seed"]
    deltas = [r[name] for r in runs]
    row["ne_mean"] = statistics.fmean(r["eval_ne"] for r in runs)
    row[f"{name}_mean"] = statistics.fmean(deltas)
    row[f"{name}_stderr"] = statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else None


def merge(dirs: list[str], out: Path) -> int:
    """Join the NE seeds of earlier runs' folders (`dirs`, each with the comm.json and
    ne_base.json of an ``--ne-from`` run) into one table under `out`. Each seed's delta is
    paired with the FP32 continuation of its own run, so runs from different base checkpoints
    join; throughput and bytes are the first folder's. Seeds must be distinct across folders."""
    runs = [json.loads((Path(d) / "comm.json").read_text()) for d in dirs]
    bases = [json.loads((Path(d) / "ne_base.json").read_text()) for d in dirs]
    if any("ne_by_seed" not in r for rows in runs for r in rows):
        raise SystemExit("--merge joins runs made with --ne-from: a folder has no NE seeds")
    results = [dict(r) for r in runs[0]]
    for rows in runs[1:]:
        by_precision = {r["precision"]: r for r in rows}
        if set(by_precision) != {r["precision"] for r in results}:
            raise SystemExit(f"--merge: the folders ran different precisions ({sorted(by_precision)} against "
                             f"{[r['precision'] for r in results]}); merge runs of the same precisions")
        for r in results:
            r["ne_by_seed"] = r["ne_by_seed"] + by_precision[r["precision"]]["ne_by_seed"]
    seeds = [c["seed"] for c in results[0]["ne_by_seed"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: seeds {seeds} repeat across folders; run them with distinct --first-seed")
    for rows in runs:
        paired_ne(rows)  # each folder's deltas against its own FP32 continuations (dicts shared with `results`)
    for r in results:
        _summarize_seeds(r, "ne_delta_vs_fp32")
    base = results[0]
    lines = [f"# Embedding all-to-all precision, NE seeds joined ({base['gpu']}, torch {base['torch']})", "",
             f"Command: `python -m bench.comm --out {out} --merge {' '.join(dirs)}`.", "",
             "Each folder's base run (FP32 comm) and the seeds continued from it: "
             + "; ".join(f"{d}: base NE {b['eval_ne']:.5f} at step {b['steps']}, seeds "
                         f"{[c['seed'] for c in rows[0]['ne_by_seed']]}" for d, b, rows in zip(dirs, bases, runs))
             + ". NE vs FP32 is the mean of the per-seed deltas (each against its own run's FP32 "
               "continuation) +- its standard error; samples/s and bytes are the first folder's.", "",
             "| precision | samples/s | NE vs FP32 (paired) | per seed |", "|---|---|---|---|"]
    for r in results:
        se = r["ne_delta_vs_fp32_stderr"]
        per_seed = ", ".join(f"{c['seed']}: {c['ne_delta_vs_fp32']:+.4%}" for c in r["ne_by_seed"])
        lines.append(f"| {r['precision']} | {r['samples_per_s']:.0f} | {r['ne_delta_vs_fp32_mean']:+.4%}"
                     + (f" +- {se:.4%}" if se is not None else "") + f" | {per_seed} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.md").write_text("\n".join(lines) + "\n")
    (out / "comm.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--tables", type=int, default=52)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--precisions", default="fp32,bf16,fp8",
                        help=f"comma-separated, run in this order; any of {','.join(PRECISIONS)}")
    parser.add_argument("--ne-from", type=int, default=0, metavar="N0",
                        help="NE by the paired protocol: a base job trains N0 steps with FP32 comm and "
                             "saves the checkpoint every precision and seed continues from (0: off, the "
                             "timed job's own eval NE)")
    parser.add_argument("--ne-steps", type=int, default=None, metavar="M",
                        help="with --ne-from: steps of each continuation, over which both learning rates "
                             "decay to 0 (default 200; dry run 4)")
    parser.add_argument("--seeds", type=int, default=None, metavar="S",
                        help="with --ne-from: continuations per precision, seed s on the train batches of "
                             "steps N0 + s*M onwards (default 3; dry run 2)")
    parser.add_argument("--first-seed", type=int, default=0, metavar="K",
                        help="with --ne-from: the seeds are K .. K+S-1 (runs with distinct seeds can be "
                             "joined by --merge)")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="join the NE seeds of earlier --out folders (each paired against its own "
                             "FP32 continuations) into one table under --out; runs nothing")
    parser.add_argument("--eval-batches", type=int, default=16,
                        help="held-out batches per rank for NE (default 16)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 gloo processes, tiny sizes")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        job(json.loads(args.job))
        return 0
    if args.merge:
        return merge(args.merge, Path(args.out))
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        parser.error(f"--precisions: unknown {unknown}; choose from {','.join(PRECISIONS)}")
    if args.ne_from < 0:
        parser.error("--ne-from must be >= 0 (0: no NE protocol)")
    if args.ne_from and "fp32" not in precisions:
        parser.error("--ne-from pairs every precision's NE with FP32's: add fp32 to --precisions")
    if not args.ne_from and (args.ne_steps is not None or args.seeds is not None):
        parser.error("--ne-steps and --seeds shape the NE protocol: add --ne-from N0")
    if args.dry_run:
        args.steps, args.batch, args.tables, args.dim, args.rows = 8, 64, 4, 8, 200
    args.ne_steps = args.ne_steps if args.ne_steps is not None else (4 if args.dry_run else 200)
    args.seeds = args.seeds if args.seeds is not None else (2 if args.dry_run else 3)
    if args.ne_from and (args.ne_steps < 2 or args.seeds < 1 or args.first_seed < 0):
        parser.error("--ne-steps must be >= 2 (the decay needs 2 steps), --seeds >= 1, --first-seed >= 0")
    out = Path(args.out)
    sizes = {"batch": args.batch, "tables": args.tables, "dim": args.dim, "rows": args.rows,
             "eval_batches": args.eval_batches}
    base_run = None
    if args.ne_from:
        # TorchRec's own all-to-all, no codec: its checkpoint holds no LoKA state that could
        # set the continuations' comm precision.
        base_run = run_job({**sizes, "out": str(out / "ne_base"), "precision": None, "steps": args.ne_from,
                            "cache_batches": 0, "warmup": min(20, args.ne_from), "resume": None,
                            "decay_start": 0, "decay_steps": 0, "data_offset": 0, "seed": 0,
                            "checkpoint_at_end": True})
        if base_run is None:
            return 1
        print(f"NE base (FP32 comm): checkpoint at step {base_run['steps']}, NE {base_run['eval_ne']:.5f}", flush=True)
    results = []
    for prec in precisions:
        # The timed job: 16 cached batches, since the CPU data generator would otherwise bound the step rate.
        r = run_job({**sizes, "out": str(out / prec), "precision": prec, "steps": args.steps, "cache_batches": 16,
                     "warmup": min(20, args.steps), "resume": None, "decay_start": 0, "decay_steps": 0,
                     "data_offset": 0, "seed": 0, "checkpoint_at_end": False})
        if r is None:
            return 1
        results.append(r)
        print(f"{prec}: {r['samples_per_s']:.0f} samples/s, NE {r['eval_ne']:.5f}, "
              f"a2a fwd {r['a2a_bytes_per_step_rank0']['a2a_fwd'] / 1e6:.2f} MB/step", flush=True)
        if base_run is None:
            continue
        r["ne_by_seed"] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            end = args.ne_from + args.ne_steps
            cont = run_job({**sizes, "out": str(out / prec / f"ne_seed{seed}"), "precision": prec, "steps": end,
                            "cache_batches": 0, "warmup": min(20, args.ne_from), "resume": base_run["run_dir"],
                            "decay_start": args.ne_from, "decay_steps": args.ne_steps,
                            "data_offset": seed * args.ne_steps, "seed": seed, "checkpoint_at_end": False})
            if cont is None:
                return 1
            r["ne_by_seed"].append(cont)
            print(f"{prec} seed {seed}: steps {cont['start_step']}-{cont['steps']} from the base checkpoint, "
                  f"NE {cont['eval_ne']:.5f}", flush=True)
    if base_run is not None:
        paired_ne(results)
    base = results[0]
    lines = [f"# Embedding all-to-all precision, 2 GPUs ({base['gpu']}, torch {base['torch']})", "",
             f"Command: `python -m bench.comm {' '.join(sys.argv[1:] if argv is None else argv)}` "
             f"({args.tables} tables x {args.dim}, "
             f"{args.rows} rows, batch {args.batch}/GPU, {args.steps} steps, table-wise).", ""]
    if base_run is None:
        lines += ["| precision | samples/s | vs FP32 | eval NE | NE vs FP32 | a2a fwd MB/step | a2a bwd MB/step |",
                  "|---|---|---|---|---|---|---|"]
    else:
        lines += [f"NE: paired, decayed protocol. A base run with FP32 comm to step {args.ne_from} (NE "
                  f"{base_run['eval_ne']:.5f}); from its checkpoint each precision trains {args.ne_steps} "
                  f"steps per seed ({args.seeds} seeds from {args.first_seed}: the train batches of steps {args.ne_from} + "
                  f"seed x {args.ne_steps} onwards) with both learning rates decaying to 0, then evaluates "
                  f"{args.eval_batches} held-out batches per GPU. NE is the mean over seeds; NE vs FP32 the "
                  "mean of the per-seed deltas +- its standard error. samples/s: the timed runs "
                  f"({args.steps} steps on 16 cached batches).", "",
                  "| precision | samples/s | vs FP32 | NE | NE vs FP32 (paired) | a2a fwd MB/step | a2a bwd MB/step |",
                  "|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["a2a_bytes_per_step_rank0"]
        if base_run is None:
            ne = f"{r['eval_ne']:.5f} | {(r['eval_ne'] - base['eval_ne']) / base['eval_ne']:+.3%}"
        else:
            se = r["ne_delta_vs_fp32_stderr"]
            ne = f"{r['ne_mean']:.5f} | {r['ne_delta_vs_fp32_mean']:+.4%}" + (f" +- {se:.4%}" if se is not None else "")
        lines.append(f"| {r['precision']} | {r['samples_per_s']:.0f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
                     f"{ne} | {b['a2a_fwd'] / 1e6:.2f} | {b['a2a_bwd'] / 1e6:.2f} |")
    labelled = [(r["precision"], r) for r in results]
    labelled += [(f"{r['precision']} seed {c['seed']}", c) for r in results for c in r.get("ne_by_seed", [])]
    if base_run is not None:
        labelled.append(("NE base", base_run))
    lines += abort_notes(labelled)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.md").write_text("\n".join(lines) + "\n")
    (out / "comm.json").write_text(json.dumps(results, indent=2))
    if base_run is not None:
        (out / "ne_base.json").write_text(json.dumps(base_run, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
