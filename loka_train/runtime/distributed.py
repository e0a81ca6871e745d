"""Process-group set-up for torchrun (env://) and for single-process runs."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from loka_train.runtime.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


def raise_on_all_ranks(error: Exception | None, *, world_size: int, device: torch.device) -> None:
    """Collective: when `error` is set on any rank, every rank raises.

    The rank (or ranks) that failed raise their own exception; the others raise the first failing
    rank's `CheckpointError`, `ValueError` or `FileNotFoundError` (a user error), or a
    `RuntimeError` for any other exception, with its message, so no rank is left waiting in the next collective. `device` is where the
    process group's collectives run (the CPU for gloo).
    """
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item():
        return
    reports: list[tuple[str, str] | None] = [None] * world_size
    local = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(reports, local)
    if error is not None:
        raise error
    rank, (kind, message) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
    # A user error (config, data, checkpoint) stays one on every rank; anything else is a bug.
    cls = {CheckpointError.__name__: CheckpointError, ValueError.__name__: ValueError,
           FileNotFoundError.__name__: FileNotFoundError}.get(kind, RuntimeError)
    raise cls(f"rank {rank} failed: {message}")


def on_rank_zero(fn: Callable[[], T], *, rank: int, world_size: int, device: torch.device) -> T:
    """Collective: run `fn` on rank 0 alone and hand its result to every rank; when it raises,
    every rank raises (:func:`raise_on_all_ranks`). For work on shared files that one process
    must do (decide and create a run directory). `device` as in :func:`raise_on_all_ranks`.

    Example:
        >>> run_dir = on_rank_zero(lambda: runs.open(start), rank=rank, world_size=2,
        ...                        device=torch.device("cpu"))
    """
    result: list[T | None] = [None]
    error: Exception | None = None
    if rank == 0:
        try:
            result[0] = fn()
        except Exception as exc:  # raised below on every rank
            error = exc
    raise_on_all_ranks(error, world_size=world_size, device=device)
    if world_size > 1:
        dist.broadcast_object_list(result, src=0, device=device)
    return result[0]  # type: ignore[return-value]
