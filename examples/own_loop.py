"""LoKA in your own TorchRec training loop (no loka_train Trainer).

Run on CPU with 2 processes:
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/own_loop.py

The LoKA callback needs five calls: `on_before_shard` (convert the dense GEMMs, maybe set
comm codecs), `on_train_start` (after DistributedModelParallel), `on_step_start` /
`on_step_end` around each step, and `on_train_end` for the report. `on_after_backward` is
not needed by LoKA. Its state goes into your checkpoint with `state_dict()`. A loop that
compiles or CUDA-graphs its dense modules must also run the modules that
`eager_modules(ctx, step)` names (after `on_step_start`) eagerly: the sites the Probe samples.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from loka_train.data import DataConfig, make_dataset
from loka_train.models import ModelConfig, build_model
from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import LokaConfig
from loka_train.runtime import RunContext


def main(steps: int = 60, out_dir: str = "runs/own_loop") -> dict[str, float]:
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # LoKA logs its plan changes and, on rank 0, its plan table at INFO.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")

    data = make_dataset(DataConfig(num_sparse=8, num_embeddings=1000), split="train",
                        rank=rank, world_size=world, batch_size=128)
    model = build_model(ModelConfig(kind="dlrm"), feature_names=data.feature_names,
                        num_embeddings_per_feature=data.num_embeddings_per_feature,
                        num_dense=data.num_dense, seed=0)

    # 1. Before sharding: LoKA converts the dense GEMMs into FP8-capable sites.
    loka = LokaCallback(LokaConfig(enabled=True))
    loka.config.probe.every_k_steps = 5
    loka.config.probe.interval = 20
    loka.config.probe.hysteresis_intervals = 1
    loka.config.dispatch.hysteresis_intervals = 1
    loka.config.dispatch.objective = "coverage"  # CPU: exercise FP8 (emulated) numerics
    ctx = RunContext(model=model, device=device, rank=rank, world_size=world, out_dir=Path(out_dir))
    loka.on_before_shard(ctx)

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        qcomm_codecs_registry=ctx.qcomm_codecs_registry,
    )
    ctx.model = DistributedModelParallel(ctx.model, device=device, sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(ctx.model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    optimizer = CombinedOptimizer([("sparse", ctx.model.fused_optimizer), ("dense", dense)])
    # 2. After sharding.
    loka.on_train_start(ctx)

    pipeline = TrainPipelineSparseDist(ctx.model, optimizer, device)
    batches = data.batches(0, steps)
    losses = []
    for step in range(steps):
        loka.on_step_start(ctx, step)  # 3. every step
        loss, _, _ = pipeline.progress(batches)
        metrics: dict[str, float] = {}
        loka.on_step_end(ctx, step, metrics)  # 4. probe reductions and re-plans happen here
        losses.append(float(loss))
    summary: dict[str, float] = {"loss_first": sum(losses[:10]) / 10, "loss_last": sum(losses[-10:]) / 10}
    loka.on_train_end(ctx, summary)  # 5. report under out_dir/loka (rank 0)
    if rank == 0:
        print({k: v for k, v in summary.items() if not isinstance(v, str)})
    return summary


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
