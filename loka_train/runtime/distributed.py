"""Process-group set-up for torchrun (env://) and for single-process runs."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    owns_group: bool
    """True when this module created the process group (and so destroys it)."""


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(requested_device: str) -> DistInfo:
    """Join the process group set up by torchrun, or make a 1-process one.

    Uses nccl on CUDA and gloo on CPU; reuses an existing default group (tests create one).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    owns = False
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            store_file = tempfile.NamedTemporaryFile(prefix="loka_pg_", delete=False).name
            dist.init_process_group(
                backend=backend, init_method=f"file://{store_file}", rank=0, world_size=1
            )
        owns = True
    else:
        backend = dist.get_backend()
    world_size = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return DistInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=backend,
        owns_group=owns,
    )
