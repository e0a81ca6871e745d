"""Build the DLRM family from config: TorchRec DLRM, DLRM_DCN and the Wukong-style model.

The sparse side is always a TorchRec `EmbeddingBagCollection` built on the meta device, so
`DistributedModelParallel` allocates each shard where it lives; `init_embedding_tables`
then fills every shard from a per-table seed, so a sharded model and an unsharded one start
from identical tables whatever the sharding plan.

Shape legend: B batch.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from loka_train.models.config import ModelConfig
from loka_train.models.wukong import Wukong


class RecTrainModel(nn.Module):
    """Wraps a DLRM-family model for TorchRec train pipelines.

    `forward(batch)` returns `(loss, (loss, logits, labels))`, the contract of TorchRec's
    `TrainPipeline*`: the first element is backpropagated, the second is handed back.

    Args:
        model: a module called as `model(dense_features, sparse_features) -> logits (B, 1)`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: Batch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits_B = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits_B, batch.labels.float())
        return loss, (loss.detach(), logits_B.detach(), batch.labels.detach())


def table_name(feature: str) -> str:
    return f"t_{feature}"


def build_model(
    cfg: ModelConfig,
    *,
    feature_names: list[str],
    num_embeddings_per_feature: list[int],
    num_dense: int,
    seed: int,
) -> RecTrainModel:
    """Build the model described by `cfg` with one embedding table per sparse feature.

    Dense parameters are initialised from `seed` (identically on every rank); embedding
    tables are on the meta device until sharded (see `init_embedding_tables`).

    Args:
        cfg: the model configuration.
        feature_names: sparse feature names, one table each.
        num_embeddings_per_feature: rows of each table.
        num_dense: number of dense input features.
        seed: seed of the dense initialisation.

    Example:
        >>> model = build_model(ModelConfig(kind="dlrm"), feature_names=["cat_0"],
        ...                     num_embeddings_per_feature=[100], num_dense=13, seed=0)
    """
    if len(feature_names) != len(num_embeddings_per_feature):
        raise ValueError(
            f"{len(feature_names)} features but {len(num_embeddings_per_feature)} table sizes"
        )
    tables = [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in zip(feature_names, num_embeddings_per_feature)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    fork_devices: list[torch.device] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model: nn.Module
        if cfg.kind == "dlrm":
            model = DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
                over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
            )
        elif cfg.kind == "dcn":
            model = DLRM_DCN(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
                over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
                dcn_num_layers=cfg.dcn_num_layers,
                dcn_low_rank_dim=cfg.dcn_low_rank_dim,
            )
        else:
            model = Wukong(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
                over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
                num_layers=cfg.wukong_num_layers,
                num_fm_out=cfg.wukong_num_fm_out,
                fm_rank=cfg.wukong_fm_rank,
                num_lcb_out=cfg.wukong_num_lcb_out,
                mlp_hidden=cfg.wukong_mlp_hidden,
            )
    return RecTrainModel(model)


def _table_seed(seed: int, table: str) -> int:
    digest = hashlib.sha256(f"{seed}/{table}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_table(seed: int, table: str, rows: int, dim: int) -> torch.Tensor:
    """The initial value of one whole table: uniform(+-1/sqrt(rows)), TorchRec's default range."""
    gen = torch.Generator().manual_seed(_table_seed(seed, table))
    bound = rows**-0.5
    return (torch.rand(rows, dim, generator=gen) * 2 - 1) * bound


def local_shards(value: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The local pieces of a (sharded) state_dict tensor and the offset of each in the whole.

    A `ShardedTensor` (DistributedModelParallel) gives its local shards; a `DTensor` (TorchRec's
    2D sparse parallelism, ``DMPCollection``) gives the shards of its ``LocalShardsWrapper`` (a
    table-wise table this rank does not hold has none), or its local tensor when it is
    replicated; a plain tensor is one piece at offset 0. The pieces are the live storage: a copy
    into one changes the model.

    Raises:
        ValueError: a DTensor sharded without TorchRec's ``LocalShardsWrapper`` (its offsets are
            not known here).
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
            return [(t, tuple(int(o) for o in off)) for t, off in zip(local.local_shards(), local.local_offsets())]
        if all(isinstance(p, Replicate) for p in value.placements):
            return [(local, (0,) * local.dim())]
        raise ValueError(
            f"a DTensor with placements {value.placements} and no LocalShardsWrapper: its shards' "
            "offsets are unknown (TorchRec's sharded embeddings always wrap theirs)"
        )
    return [(value, (0,) * value.dim())]


@torch.no_grad()
def init_embedding_tables(
    model: nn.Module, *, seed: int, tables: dict[str, tuple[int, int]]
) -> int:
    """Fill every embedding weight (whole or sharded) from its table's seed.

    Works on the unsharded EBC, on DistributedModelParallel's ShardedTensors and on
    DMPCollection's DTensors alike (`local_shards`): a shard copies its slice of the
    deterministic full table, so any sharding plan starts from the same values, and the
    replicas of 2D sparse parallelism start identical.

    Args:
        model: a model whose state_dict holds `...embedding_bags.<table>.weight` entries.
        seed: the run's seed.
        tables: table name -> (rows, dim).

    Returns:
        The number of weight tensors initialised (a check that every table was found).
    """
    count = 0
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if len(parts) < 3 or parts[-1] != "weight" or parts[-3] != "embedding_bags":
            continue
        table = parts[-2]
        rows, dim = tables[table]
        full = full_table(seed, table, rows, dim)
        for shard, (r0, c0) in local_shards(value):
            nr, nc = shard.shape
            shard.copy_(full[r0 : r0 + nr, c0 : c0 + nc].to(shard.device))
        count += 1
    return count
