"""2D sparse parallelism on 2 GPUs: step time and eval NE, fully sharded vs replicated tables.

Variants (same model, data and seeds; each a job under torchrun, 2 processes):

* ``dmp``: plain DistributedModelParallel, tables sharded table-wise over both GPUs;
* ``2d_fp32``: ``trainer.sharding_group_size=1`` (every GPU holds every table), replicas synced
  after every step by TorchRec's ``DMPCollection.sync`` (fp32 mean of weights and optimizer
  state);
* ``2d_loka_bf16`` / ``2d_loka_fp8``: the same, synced by LoKA's ``comm.ReplicaSync`` (the change
  since the last sync in BF16 / row-wise FP8 with error feedback; the optimizer state in fp32);
  the LoKA callback runs only its comm part.

Each job also reports the largest difference between the two ranks' embedding weights after
its last sync (0 for the 2D variants). 26 tables x dim 128, 100k rows, batch 8192 per GPU,
100 steps by default: on 2 x H100 the first two variants finished within 85 s, start-up included
(`bench/results/multigpu_h100x2_2026-11-25/sparse2d.txt`).

Run (2 GPUs):  python -m bench.sparse2d --out bench/results/sparse2d_<gpu>_<date>
Dry run (CPU): python -m bench.sparse2d --dry-run --out /tmp/sparse2d   (the ``dmp`` variant
only, tiny: 2D sparse parallelism needs CUDA; the others are listed as skipped)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: on the PYTHONPATH of the torchrun workers, which import ``bench.sparse2d``."""

VARIANTS = ("dmp", "2d_fp32", "2d_loka_bf16", "2d_loka_fp8")


def job(out: str, variant: str, steps: int, batch: int, tables: int, dim: int, rows: int) -> None:
    """One run (called on every rank by torchrun); rank 0 writes ``<out>/result.json``."""
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
    from loka_train.runtime.sparse2d import replicated_shards
    from loka_train.runtime.trainer import Trainer

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
    trainer = Trainer(
        model=ModelConfig(kind="dlrm", embedding_dim=dim, dense_arch_layer_sizes=[512, 256, dim],
                          over_arch_layer_sizes=[1024, 1024, 512, 256, 1]),
        data=DataConfig(num_sparse=tables, num_embeddings=rows, cache_batches=16),
        trainer=TrainerConfig(
            steps=steps, batch_size=batch, device="cuda" if cuda else "cpu", sharding="table_wise",
            sharding_group_size=None if variant == "dmp" else 1,
            dense_dtype="bf16" if cuda else "fp32", dense_lr=0.01, dense_warmup_steps=min(20, steps),
            log_every=max(1, steps // 4), eval_batches=4, out_dir=out, tensorboard=False,
            progress_bar=False, checkpoint_at_end=False, resume="never",
        ),
        callbacks=callbacks,
    )
    summary = trainer.fit()

    def max_replica_diff(tensors: list[torch.Tensor]) -> float:
        """Largest difference between the ranks' copies of `tensors` (every rank a replica)."""
        diffs = []
        for tensor in tensors:
            gathered = [torch.empty_like(tensor) for _ in range(trainer.world_size)]
            dist.all_gather(gathered, tensor.contiguous())
            diffs.append(max(float((g - gathered[0]).abs().max()) for g in gathered))
        return max(diffs, default=float("nan"))

    max_diff = state_diff = float("nan")
    if variant != "dmp":
        weights, states = replicated_shards(trainer.model, trainer.model.fused_optimizer)
        max_diff = max_replica_diff(list(weights.values()))
        state_diff = max_replica_diff(states)  # the fused optimizer's momentum / accumulators
    if trainer.rank == 0:
        rep = loka.comm_state.report() if loka is not None else None
        result = {
            "variant": variant, "steps_per_s": summary["train/steps_per_s"],
            "step_ms": 1000 / summary["train/steps_per_s"], "eval_ne": summary["eval/ne"],
            "train_loss": summary["train/loss"], "replica_max_abs_diff": max_diff,
            "replica_state_max_abs_diff": state_diff,
            "replica_sync_bytes_rank0": rep["channels"]["replica_sync"]["total_bytes"] if rep else None,
            "fallbacks": summary["fallbacks"], "device": str(summary["device"]),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        }
        (Path(out) / "result.json").write_text(json.dumps(result, indent=2))
    trainer.close()


def run_variant(out: Path, variant: str, steps: int, batch: int, tables: int, dim: int, rows: int) -> dict:
    """Run one variant under torchrun (2 processes); returns rank 0's result."""
    run_dir = out / variant
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "bench.sparse2d", "--out", str(out), "--job", str(run_dir), variant, str(steps), str(batch),
           str(tables), str(dim), str(rows)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse2d", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--job", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        out, variant, steps, batch, tables, dim, rows = args.job
        job(out, variant, int(steps), int(batch), int(tables), int(dim), int(rows))
        return 0
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.dry_run:
        import torch

        args.steps, args.batch, args.tables, args.dim, args.rows = 8, 64, 4, 8, 200
        if not torch.cuda.is_available():
            skipped = [v for v in variants if v != "dmp"]
            if skipped:
                print(f"dry run on CPU: skipping {skipped} (2D sparse parallelism needs CUDA)")
            variants = [v for v in variants if v == "dmp"]
    out = Path(args.out)
    results = []
    for variant in variants:
        r = run_variant(out, variant, args.steps, args.batch, args.tables, args.dim, args.rows)
        results.append(r)
        print(f"{variant}: {r['step_ms']:.2f} ms/step, NE {r['eval_ne']:.5f}, "
              f"replicas differ by {r['replica_max_abs_diff']:.3g}", flush=True)
    if not results:
        return 0
    base = results[0]
    lines = [f"# 2D sparse parallelism, 2 GPUs ({base['gpu']}, torch {base['torch']})", "",
             f"Command: `python -m bench.sparse2d {' '.join(sys.argv[1:])}` ({args.tables} tables x {args.dim}, "
             f"{args.rows} rows, batch {args.batch}/GPU, {args.steps} steps, table-wise).", "",
             f"| variant | ms/step | vs {base['variant']} | eval NE | NE vs {base['variant']} | replica max diff | sync MB/step (rank 0) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        sync = r["replica_sync_bytes_rank0"]
        sync_mb = f"{sync / args.steps / 1e6:.2f}" if sync is not None else "n/a"
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['step_ms'] / base['step_ms']:.2f}x | "
                     f"{r['eval_ne']:.5f} | {(r['eval_ne'] - base['eval_ne']) / base['eval_ne']:+.3%} | "
                     f"{r['replica_max_abs_diff']:.3g} | {sync_mb} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse2d.md").write_text("\n".join(lines) + "\n")
    (out / "sparse2d.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
