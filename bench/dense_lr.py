"""Dense learning rate and warm-up on CPU: the loss right after the first steps, and eval NE.

Adagrad's first step moves every dense weight by about the learning rate; this shows what
that does to MLPerf-sized towers (the loss at step 2) and what a warm-up changes.

Usage (1 process, CPU):
    .venv/bin/torchrun --standalone --nproc_per_node=1 -m bench.dense_lr --model dcn --lr 0.05 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import tempfile

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.runtime import TrainerConfig
from loka_train.runtime.trainer import Trainer

MODELS = {
    "dlrm": ModelConfig(kind="dlrm", embedding_dim=128, dense_arch_layer_sizes=[512, 256, 128],
                        over_arch_layer_sizes=[1024, 1024, 512, 256, 1]),
    "dcn": ModelConfig(kind="dcn", embedding_dim=64, dense_arch_layer_sizes=[256, 64],
                       over_arch_layer_sizes=[512, 256, 1], dcn_num_layers=3, dcn_low_rank_dim=64),
}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dense_lr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="dlrm")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=1024)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=MODELS[args.model], data=DataConfig(num_sparse=26, num_embeddings=20000),
            trainer=TrainerConfig(
                steps=args.steps, batch_size=args.batch, device="cpu", log_every=1, eval_batches=4,
                out_dir=out, tensorboard=False, progress_bar=False, checkpoint_at_end=False,
                resume="never", dense_lr=args.lr, dense_warmup_steps=args.warmup,
            ),
        )
        summary = trainer.fit()
        lines = (trainer.out_dir / "metrics.jsonl").read_text().splitlines()
        losses = [round(r["train/loss"], 3) for r in map(json.loads, lines) if "train/loss" in r]
    if trainer.rank == 0:
        print(f"{args.model} lr {args.lr} warm-up {args.warmup}: first losses {losses[:5]}, "
              f"last {losses[-3:]}, eval NE {summary['eval/ne']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
