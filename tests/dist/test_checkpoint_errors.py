"""A checkpoint save or load that fails on one rank fails on every rank, and every rank's error
names the rank that failed and its cause (not only that "another rank" failed)."""

from __future__ import annotations

from pathlib import Path

import torch

from loka_train.runtime import checkpoint
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager
from tests.dist._multiprocess import run_multiprocess


def _save_fails_on_rank_1(rank: int, world_size: int, root: str) -> str:
    mgr = CheckpointManager(Path(root), rank=rank, world_size=world_size, keep=2)
    if rank == 1:
        def disk_full(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

        checkpoint.to_local = disk_full  # this forked process only: its local file fails
    try:
        mgr.save(1, {"w": torch.ones(3)}, {})
    except CheckpointError as exc:
        return str(exc)
    return ""


def _load_fails_on_rank_1(rank: int, world_size: int, root: str) -> str:
    mgr = CheckpointManager(Path(root), rank=rank, world_size=world_size, keep=2)
    path = mgr.save(1, {"w": torch.ones(3)}, {})
    torch.distributed.barrier()
    if rank == 1:
        (path / "rank_1.pt").write_bytes(b"not a checkpoint")
    torch.distributed.barrier()
    try:
        mgr.load(path)
    except CheckpointError as exc:
        return str(exc)
    return ""


def test_a_failed_save_names_the_failing_rank_and_cause_on_every_rank(tmp_path: Path) -> None:
    messages = run_multiprocess(_save_fails_on_rank_1, 2, str(tmp_path), timeout=60)
    for message in messages:
        assert "rank 1: OSError" in message and "No space left on device" in message, message
        assert "rank 0" not in message


def test_a_failed_load_names_the_failing_rank_and_cause_on_every_rank(tmp_path: Path) -> None:
    messages = run_multiprocess(_load_fails_on_rank_1, 2, str(tmp_path), timeout=60)
    for message in messages:
        assert message.startswith("rank 1: checkpoint"), message
        assert "corrupt" in message and "UnpicklingError" in message, message


def _load_by_copy_into_another_shape(rank: int, world_size: int, root: str) -> str:
    """A checkpoint of a (2, 4) table loaded by copy into a (2, 5) one: refused on every rank,
    naming what a copying resume needs."""
    mgr = CheckpointManager(Path(root), rank=rank, world_size=world_size, keep=2)
    path = mgr.save(1, {"model": {"t": torch.ones(2, 4)}}, {})
    try:
        mgr.load(path, into={"model": {"t": torch.zeros(2, 5)}}, by_copy=True)
    except CheckpointError as exc:
        return str(exc)
    return ""


def test_a_copying_load_of_another_shape_names_what_it_needs(tmp_path: Path) -> None:
    messages = run_multiprocess(_load_by_copy_into_another_shape, world_size=2, args=(str(tmp_path),))
    for message in messages:
        assert "resuming by copy" in message and "same shape under both sharding plans" in message, message
