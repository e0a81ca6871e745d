"""One job of the multi-GPU integration tests, launched by torchrun (nccl).

Usage: torchrun --nproc_per_node=N tests/gpu/_multigpu_job.py OUT SHARDING STEPS GLOBAL_BATCH [RESUME]
Writes OUT/rank{r}_{full|resumed}.pt with the plans at every LoKA interval, the losses (by step)
and the summary; with RESUME (a checkpoint directory) the run starts from it. Checkpoints every
20 steps, all kept. Without CUDA it runs on CPU with gloo (a local dry run of the same code path).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loka_train.data import DataConfig  # noqa: E402
from loka_train.models import ModelConfig  # noqa: E402
from loka_train.plugin.callback import LokaCallback  # noqa: E402
from loka_train.runtime import TrainerConfig  # noqa: E402
from loka_train.runtime.trainer import Trainer  # noqa: E402
from tests.dist._loka import PlanRecorder, preset  # noqa: E402

DENSE_LR = 0.005
"""Adagrad's first step moves every weight by about the learning rate (g / sqrt(g^2)); with
the default 0.05 this DCN's 1728-wide layers blow the loss up to ~1e5 at step 2 (seen on the
2 x H200 run and on CPU), and the chaotic recovery amplifies every rounding difference."""


def main() -> None:
    out, sharding, steps, global_batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    loka = LokaCallback(
        preset(
            "aggressive",
            "loka.probe.every_k_steps=2", "loka.probe.interval=20", "loka.probe.window=8",
            "loka.comm.policy_interval=20", "loka.comm.sample_every=2",
            # Triton's autotuning would dominate these short jobs' wall time; the kernels
            # have their own GPU tests.
            "loka.dispatch.backends=[torch_scaled_mm,fbgemm_rowwise,emulated]",
        )
    )
    recorder = PlanRecorder(loka)
    trainer = Trainer(
        model=ModelConfig(kind="dcn", embedding_dim=64, dense_arch_layer_sizes=[256, 64],
                          over_arch_layer_sizes=[512, 256, 1], dcn_num_layers=3, dcn_low_rank_dim=64),
        data=DataConfig(num_embeddings=100_000),
        trainer=TrainerConfig(
            steps=steps, batch_size=global_batch // world, device="cuda" if cuda else "cpu", sharding=sharding,
            log_every=1, eval_every=0, eval_batches=4, out_dir=out, tensorboard=False,
            progress_bar=False, checkpoint_every=20, keep_checkpoints=steps // 20 + 1,
            resume=resume or "never",
            dense_lr=DENSE_LR, dense_warmup_steps=10,
        ),
        callbacks=[loka, recorder],
    )
    summary = trainer.fit()
    torch.save(
        {"plans": recorder.plans, "losses": recorder.losses, "loss_by_step": recorder.loss_by_step,
         "summary": summary,
         "comm": loka.comm_state.report() if loka.comm_state is not None else None},
        Path(out) / f"rank{dist.get_rank()}_{'resumed' if resume else 'full'}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
