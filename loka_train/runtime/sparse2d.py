"""2D sparse parallelism (``trainer.sharding_group_size``): TorchRec's ``DMPCollection``.

The tables are sharded within a *sharding group* of ``sharding_group_size`` ranks and
replicated across the ``world_size / sharding_group_size`` groups; the ranks that hold the same
shards form a *replica group* and average their copies every ``trainer.sharding_sync_every``
steps (`sync_due`). `Sparse2DLayout` is the pure layout, the one ``DMPCollection`` builds
(its default, ``use_inter_host_allreduce=False``): with ``R = world_size / sharding_group_size``
replicas, sharding group ``g`` holds ranks ``g, g + R, g + 2R, ...`` and rank ``r``'s replica
group is the ``R`` consecutive ranks around it (``r // R * R`` and on), so with no more
replicas than GPUs per host (``R <= local_world_size``) the replica syncs stay inside a host. A plan made for one group (ranks ``0..sharding_group_size-1``) is moved to
group ``g`` by ``shard_rank * R + g``.

`model_parallel` builds ``DistributedModelParallel`` or ``DMPCollection``; `replicated_shards`
lists the replicated embedding shards and optimizer state (the live tensors, from the public
``state_dict``s) for a sync of one's own, such as LoKA's ``comm.replica.ReplicaSync``.

Example:
    >>> layout = Sparse2DLayout(world_size=8, sharding_group_size=4)
    >>> layout.sharding_group(0), layout.replica_group(0)
    ((0, 2, 4, 6), (0, 1))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan

from loka_train.models import local_shards
from loka_train.runtime.config import TrainerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "Sparse2DLayout",
    "check_sparse2d",
    "model_parallel",
    "replica_process_group",
    "replicated_shards",
    "require_live_shards",
    "shards_not_live",
    "sync_due",
]


@dataclass(frozen=True)
class Sparse2DLayout:
    """Which ranks shard and which replicate the tables (``DMPCollection``'s layout).

    Example:
        >>> Sparse2DLayout(world_size=4, sharding_group_size=2).replica_groups()
        [(0, 1), (2, 3)]
    """

    world_size: int
    """All ranks of the job."""
    sharding_group_size: int
    """Ranks that shard one copy of the tables (``trainer.sharding_group_size``)."""

    def __post_init__(self) -> None:
        size, world = self.sharding_group_size, self.world_size
        if size < 1 or world < 1 or world % size:
            divisors = [d for d in range(1, world + 1) if world % d == 0] if world >= 1 else []
            raise ValueError(
                f"trainer.sharding_group_size={size} must divide the world size {world}: choose one of {divisors}"
            )

    @property
    def num_replicas(self) -> int:
        """Copies of the tables (sharding groups), and ranks per replica group."""
        return self.world_size // self.sharding_group_size

    def sharding_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that shard the tables together with `rank`, in shard order."""
        self._check_rank(rank)
        return tuple(self.num_replicas * i + rank % self.num_replicas for i in range(self.sharding_group_size))

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold the same shards as `rank` (its sync partners), `rank` included."""
        self._check_rank(rank)
        first = rank // self.num_replicas * self.num_replicas
        return tuple(range(first, first + self.num_replicas))

    def sharding_groups(self) -> list[tuple[int, ...]]:
        """Every sharding group, in DMPCollection's order."""
        return [self.sharding_group(g) for g in range(self.num_replicas)]

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Every replica group, in DMPCollection's order."""
        return [self.replica_group(i * self.num_replicas) for i in range(self.sharding_group_size)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")


def sync_due(step: int, *, every: int, last_step: int) -> bool:
    """Whether the replicas sync after `step` (0-based): every `every` steps, and after the
    last step (`last_step`, 0-based) so that evaluation and the final model see one model.

    >>> [s for s in range(7) if sync_due(s, every=3, last_step=6)]
    [2, 5, 6]
    """
    return (step + 1) % every == 0 or step == last_step


def check_sparse2d(cfg: TrainerConfig, *, world_size: int, device: torch.device) -> Sparse2DLayout | None:
    """The layout of ``trainer.sharding_group_size`` on this job (None when unset), or a
    ValueError that names the fix (the config checked what it could without the job)."""
    size = cfg.sharding_group_size
    if size is None:
        return None
    if device.type != "cuda":
        raise ValueError(
            f"trainer.sharding_group_size (2D sparse parallelism) needs CUDA, this run is on {device}: "
            "TorchRec's DMPCollection runs only on CUDA with nccl. Run on GPUs (trainer.device=cuda), "
            "or set trainer.sharding_group_size=null to shard every table over all ranks"
        )
    if size == world_size and world_size > 1:
        raise ValueError(
            f"trainer.sharding_group_size={size} is the whole world (one copy of the tables, nothing to "
            "sync): set trainer.sharding_group_size=null (plain DistributedModelParallel), or a divisor "
            "of the world size below it"
        )
    return Sparse2DLayout(world_size=world_size, sharding_group_size=size)


def model_parallel(
    model: nn.Module,
    *,
    device: torch.device,
    plan: ShardingPlan,
    sharders: list[Any],
    layout: Sparse2DLayout | None,
    data_parallel_wrapper: Any = None,
) -> DistributedModelParallel:
    """``DistributedModelParallel`` (`layout` None) or ``DMPCollection`` over `layout`, with
    `plan` made for one sharding group. Only arguments that torchrec 1.6 and 1.8 both take."""
    kwargs: dict[str, Any] = {}
    if data_parallel_wrapper is not None:
        kwargs["data_parallel_wrapper"] = data_parallel_wrapper
    if layout is None:
        return DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders, **kwargs)
    from torchrec.distributed.model_parallel import DMPCollection

    logger.info(
        "2D sparse parallelism: tables sharded over %d ranks, %d replicas; sharding groups %s, replica groups %s",
        layout.sharding_group_size, layout.num_replicas, layout.sharding_groups(), layout.replica_groups(),
    )
    return DMPCollection(
        module=model, device=device, plan=plan, sharders=sharders, world_size=layout.world_size,
        sharding_group_size=layout.sharding_group_size, global_pg=dist.GroupMember.WORLD, **kwargs,
    )


def replica_process_group(model: nn.Module, layout: Sparse2DLayout, rank: int) -> dist.ProcessGroup:
    """This rank's replica group: ``DMPCollection``'s own (its public ``device_mesh``), else new
    groups made from `layout` (collective: every rank makes every group, in the same order)."""
    mesh = getattr(model, "device_mesh", None)
    if mesh is not None:
        return mesh.get_group(mesh_dim="replicate")
    mine = None
    for ranks in layout.replica_groups():
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} in no replica group of {layout}"
    return mine


def replicated_shards(model: nn.Module, fused_optimizer: Any) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The local embedding shards (``...embedding_bags.<table>.weight``, named with their
    offsets) and the fused optimizer's state tensors of `model`: the live tensors (a copy into
    one changes the model), in the same order on every replica of a shard."""
    weights: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if len(parts) < 3 or parts[-1] != "weight" or parts[-3] != "embedding_bags":
            continue
        for shard, offsets in local_shards(value):
            if shard.numel():
                weights[f"{key}@{','.join(map(str, offsets))}"] = shard
    states: list[torch.Tensor] = []
    for _, per_param in sorted(fused_optimizer.state_dict()["state"].items()):
        for _, value in sorted(per_param.items()):
            if isinstance(value, torch.Tensor):
                states.extend(t for t, _ in local_shards(value) if t.numel())
    return weights, states


@torch.no_grad()
def shards_not_live(model: nn.Module, fused_optimizer: Any) -> list[str]:
    """The shards of `replicated_shards` that are not the model's own tensors, which a sync
    would change in vain.

    * A weight shard is live when its storage is a parameter's or buffer's of `model` (TorchRec
      exposes the embedding kernels' tables as parameters): this catches copies made once and
      kept as well as copies made at every listing.
    * The optimizer states are held by the fused optimizer, not by modules: for them one value
      of the first is changed, the shards are listed again and the value read back from the new
      listing, then restored (the saved value is copied back). This catches copies made at every
      listing only.

    Returns their names (``optimizer state <i>`` for states); empty: every shard is live."""
    weights, states = replicated_shards(model, fused_optimizer)
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    copies = [name for name, t in weights.items() if t.untyped_storage().data_ptr() not in owned]
    if states:
        flat = states[0].view(-1)
        saved = flat[0].clone()
        flat[0] = saved + 1.0 if bool(saved.abs() < 1e6) else saved / 2  # a value this dtype changes
        changed = flat[0].clone()
        again = replicated_shards(model, fused_optimizer)[1][0].reshape(-1)[0]
        if not bool(again == changed):
            copies.append("optimizer state 0")
        flat[0] = saved
    return copies


def require_live_shards(model: nn.Module, fused_optimizer: Any, *, device: torch.device) -> None:
    """Collective: raise on every rank when any rank's `replicated_shards` has copies
    (`shards_not_live`), so no rank waits alone in a sync that would change nothing."""
    not_live = shards_not_live(model, fused_optimizer)
    found = torch.tensor([len(not_live)], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if int(found.item()):
        where = f"the replicated shards {not_live[:4]} are" if not_live else "another rank's replicated shards are"
        raise RuntimeError(
            f"LoKA comm: {where} copies, not the model's tensors, so LoKA's replica sync would not "
            "change the model. Set loka.comm.replica_sync=fp32 (DMPCollection's own sync) and report "
            "this TorchRec version."
        )
