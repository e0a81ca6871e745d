"""How the Trainer shards the embedding tables: the sharder (fused optimizer, comm codecs) and
the plan (TorchRec's planner, or one sharding type for every table).

Example:
    >>> sharder = make_sharder(cfg, qcomm_codecs_registry=None)
    >>> plan = make_sharding_plan(model, sharder, kind="table_wise", world_size=2,
    ...                           local_world_size=2, device=torch.device("cpu"))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from loka_train.runtime.config import TrainerConfig

__all__ = ["make_sharder", "make_sharding_plan"]


def make_sharder(
    cfg: TrainerConfig, *, qcomm_codecs_registry: dict[str, Any] | None
) -> EmbeddingBagCollectionSharder:
    """The embedding-bag sharder: fused (row-wise) Adagrad as ``trainer.sparse_optimizer`` says,
    and the quantized comm codecs a callback set (None: TorchRec's FP32 comms)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fused_params = {
        "optimizer": {
            "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "adagrad": EmbOptimType.EXACT_ADAGRAD,
        }[cfg.sparse_optimizer],
        "learning_rate": cfg.sparse_lr,
        "eps": cfg.eps,
    }
    return EmbeddingBagCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)


def make_sharding_plan(
    model: nn.Module,
    sharder: EmbeddingBagCollectionSharder,
    *,
    kind: str,
    world_size: int,
    local_world_size: int,
    device: torch.device,
) -> ShardingPlan:
    """The sharding plan of `model`'s embedding-bag collections (``trainer.sharding``): "auto"
    asks TorchRec's planner (collectively), any other kind shards every table that way."""
    if kind == "auto":
        planner = EmbeddingShardingPlanner(
            topology=Topology(
                world_size=world_size,
                compute_device=device.type,
                local_world_size=local_world_size,
            )
        )
        return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    plans = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, EmbeddingBagCollection):
            continue
        per_param = {}
        fused = EmbeddingComputeKernel.FUSED.value
        for i, cfg in enumerate(module.embedding_bag_configs()):
            if kind == "table_wise":
                per_param[cfg.name] = table_wise(rank=i % world_size, compute_kernel=fused)
            elif kind == "column_wise":
                per_param[cfg.name] = column_wise(ranks=list(range(world_size)), compute_kernel=fused)
            elif kind == "row_wise":
                per_param[cfg.name] = row_wise(compute_kernel=fused)
            else:
                # Replicated tables train with the dense kernel and the dense optimizer.
                per_param[cfg.name] = data_parallel()
        plans[fqn] = construct_module_sharding_plan(
            module,
            per_param_sharding=per_param,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device.type,
            sharder=sharder,
        )
    return ShardingPlan(plans)
