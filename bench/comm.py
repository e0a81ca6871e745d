"""Embedding all-to-all precision on 2 GPUs: throughput, NE and bytes for FP32, BF16, FP8.

Comm-heavy setting: 52 tables x dim 128, 100k rows each, table-wise sharded over 2 GPUs,
batch 16384 per GPU, TorchRec DLRM (MLPerf-like towers), fused row-wise Adagrad. For each
precision the same job (same data, seeds) runs under torchrun; the LoKA callback installs
only the comm codecs (no FP8 compute sites, no probe) so the comm precision is the only
difference. The 16 train batches are generated once and cycled (data.cache_batches) so that
the CPU input pipeline stays out of the timing; eval NE is on fresh held-out batches. Bytes are counted by the codec in encode (what each rank puts on the wire).

Run (2 GPUs):  python -m bench.comm --out bench/results/comm_a2a_h200x2_<date>
Dry run (CPU): python -m bench.comm --dry-run --out /tmp/comm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: on the PYTHONPATH of the torchrun workers, which import ``bench.comm``."""


def job(out: str, precision: str, steps: int, batch: int, tables: int, dim: int, rows: int) -> None:
    """One run (called on every rank by torchrun)."""
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
    from loka_train.runtime.trainer import Trainer

    p = CommPrecision(precision)
    loka = LokaCallback(LokaConfig(
        enabled=True, mods=ModsConfig(enabled=False), probe=ProbeConfig(enabled=False),
        dispatch=DispatchConfig(enabled=False), comm_enabled=True,
        comm=CommConfig(a2a_forward=p, a2a_backward=p, row_dim=dim),
    ))
    cuda = torch.cuda.is_available()
    trainer = Trainer(
        model=ModelConfig(kind="dlrm", embedding_dim=dim, dense_arch_layer_sizes=[512, 256, dim],
                          over_arch_layer_sizes=[1024, 1024, 512, 256, 1]),
        # 16 cached batches: the CPU data generator would otherwise bound the step rate.
        data=DataConfig(num_sparse=tables, num_embeddings=rows, cache_batches=16),
        trainer=TrainerConfig(
            steps=steps, batch_size=batch, device="cuda" if cuda else "cpu", sharding="table_wise",
            dense_dtype="bf16" if cuda else "fp32", dense_lr=0.01, dense_warmup_steps=min(20, steps),
            log_every=max(1, steps // 4), eval_batches=4, out_dir=out, tensorboard=False,
            progress_bar=False, checkpoint_at_end=False, resume="never",
        ),
        callbacks=[loka],
    )
    summary = trainer.fit()
    if trainer.rank == 0:
        rep = loka.comm_state.report()
        a2a = {c: rep["channels"][c]["total_bytes"] for c in ("a2a_fwd", "a2a_bwd")}
        result = {
            "precision": precision, "steps_per_s": summary["train/steps_per_s"],
            "samples_per_s": summary["train/steps_per_s"] * summary["global_batch"],
            "eval_ne": summary["eval/ne"], "train_loss": summary["train/loss"],
            "a2a_bytes_per_step_rank0": {c: b / steps for c, b in a2a.items()},
            "fallbacks": rep["fallbacks"], "device": str(summary["device"]),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        }
        (Path(out) / "result.json").write_text(json.dumps(result, indent=2))
    trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--tables", type=int, default=52)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--precisions", default="fp32,bf16,fp8")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--job", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        out, prec, steps, batch, tables, dim, rows = args.job
        job(out, prec, int(steps), int(batch), int(tables), int(dim), int(rows))
        return 0
    if args.dry_run:
        args.steps, args.batch, args.tables, args.dim, args.rows = 8, 64, 4, 8, 200
    out = Path(args.out)
    results = []
    for prec in args.precisions.split(","):
        run_dir = out / prec
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "bench.comm", "--out", str(out), "--job", str(run_dir), prec, str(args.steps), str(args.batch),
               str(args.tables), str(args.dim), str(args.rows)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        results.append(json.loads((run_dir / "result.json").read_text()))
        r = results[-1]
        print(f"{prec}: {r['samples_per_s']:.0f} samples/s, NE {r['eval_ne']:.5f}, "
              f"a2a fwd {r['a2a_bytes_per_step_rank0']['a2a_fwd'] / 1e6:.2f} MB/step", flush=True)
    base = results[0]
    lines = [f"# Embedding all-to-all precision, 2 GPUs ({base['gpu']}, torch {base['torch']})", "",
             f"Command: `python -m bench.comm {' '.join(sys.argv[1:])}` ({args.tables} tables x {args.dim}, "
             f"{args.rows} rows, batch {args.batch}/GPU, {args.steps} steps, table-wise).", "",
             "| precision | samples/s | vs FP32 | eval NE | NE vs FP32 | a2a fwd MB/step | a2a bwd MB/step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["a2a_bytes_per_step_rank0"]
        lines.append(f"| {r['precision']} | {r['samples_per_s']:.0f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
                     f"{r['eval_ne']:.5f} | {(r['eval_ne'] - base['eval_ne']) / base['eval_ne']:+.3%} | "
                     f"{b['a2a_fwd'] / 1e6:.2f} | {b['a2a_bwd'] / 1e6:.2f} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.md").write_text("\n".join(lines) + "\n")
    (out / "comm.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
