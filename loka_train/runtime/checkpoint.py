"""Checkpoints of a sharded run: one file per rank, written atomically, loaded in place.

Layout under `<run directory>/checkpoints/` (`runtime.rundirs`):
    step_00000100/rank_0.pt ... rank_{W-1}.pt, meta.json
    latest                      (text file naming the newest complete step directory)

Every rank saves its local view (sharded embedding weights and fused optimizer state as
its local shards, dense parameters, dense optimizer state, RNG states, data position,
callback states) into a temporary directory; only when every rank succeeded does rank 0
rename it into place and then atomically repoint `latest`. A failed save therefore never
touches the previous checkpoint. Loading copies tensors in place into the live state
(so fused TorchRec optimizer state and ShardedTensor views are updated where they live)
and requires the same world size and sharding; a mismatch or a corrupt file raises
`CheckpointError` naming the file and the fix, on every rank.

Pruning after a save deletes only checkpoints of older steps than the one just saved (keeping
`keep` in all), never the one just saved nor the one `latest` names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from loka_train.runtime.callbacks import CallbackList

logger = logging.getLogger(__name__)

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the fix."""


def to_local(obj: Any) -> Any:
    """Replace every ShardedTensor by the list of its local shards (detached copies)."""
    if isinstance(obj, ShardedTensor):
        return {"__local_shards__": [s.tensor.detach().cpu().clone() for s in obj.local_shards()]}
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_local(v) for v in obj)
    return obj


def copy_into(live: Any, saved: Any, path: str) -> None:
    """Copy `saved` (from `to_local`) into the live state in place; raise on any mismatch."""
    if isinstance(live, ShardedTensor):
        if not (isinstance(saved, dict) and "__local_shards__" in saved):
            raise CheckpointError(f"{path}: expected sharded state, found {type(saved).__name__}")
        shards = live.local_shards()
        if len(shards) != len(saved["__local_shards__"]):
            raise CheckpointError(
                f"{path}: {len(saved['__local_shards__'])} local shards saved, {len(shards)} now; "
                "the sharding plan changed"
            )
        for shard, value in zip(shards, saved["__local_shards__"]):
            _copy_tensor(shard.tensor, value, path)
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise CheckpointError(f"{path}: expected a tensor, found {type(saved).__name__}")
        _copy_tensor(live, saved, path)
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: expected a dict, found {type(saved).__name__}")
        missing = sorted(set(map(str, live)) - set(map(str, saved)))
        unexpected = sorted(set(map(str, saved)) - set(map(str, live)))
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: keys differ (missing {missing[:5]}, unexpected {unexpected[:5]}); "
                "the model or optimizer changed since this checkpoint"
            )
        for key in live:
            copy_into(live[key], saved[key], f"{path}.{key}")


def restore(
    saved: dict[str, Any], *, model: nn.Module, optimizer: torch.optim.Optimizer, callbacks: CallbackList,
    device: torch.device, allow_new_callbacks: bool,
) -> list[str]:
    """Copy a loaded checkpoint (`saved`, this rank's state) into the live `model`, `optimizer`,
    `callbacks` and RNG states; returns the callbacks that had no state in it (they start
    fresh; only with `allow_new_callbacks`, else that raises). Raises `CheckpointError` for a
    state that does not fit.

    Example:
        >>> saved, meta = manager.load(path)
        >>> restore(saved, model=model, optimizer=opt, callbacks=cbs, device=dev, allow_new_callbacks=False)
    """
    copy_into(model.state_dict(), saved["model"], "model")
    live_opt = optimizer.state_dict()
    copy_into(live_opt["state"], saved["optimizer"]["state"], "optimizer.state")
    optimizer.load_state_dict(live_opt)
    fresh = callbacks.load_state_dict(saved["callbacks"], allow_missing=allow_new_callbacks)
    torch.set_rng_state(saved["rng"]["torch"])
    if "cuda" in saved["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state(saved["rng"]["cuda"], device)
    return fresh


def _copy_tensor(live: torch.Tensor, saved: torch.Tensor, path: str) -> None:
    if live.shape != saved.shape:
        raise CheckpointError(
            f"{path}: shape {tuple(saved.shape)} in checkpoint, {tuple(live.shape)} in the model; "
            "the model config or sharding changed"
        )
    with torch.no_grad():
        live.copy_(saved.to(device=live.device, dtype=live.dtype))


def _all_ok(ok: bool) -> bool:
    """True on every rank iff `ok` on every rank (a MIN all-reduce)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _step_of(path: Path) -> int | None:
    """The step of a `step_<n>` directory, or None for a name that is not one."""
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint (a ``step_*`` directory) that ``root/latest`` names, or None when `root`
    holds no ``latest``; raises `CheckpointError` when it names a missing or incomplete one.

    Example:
        >>> latest_checkpoint(Path("runs/latest/checkpoints"))  # doctest: +SKIP
        PosixPath('runs/latest/checkpoints/step_00000300')
    """
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not (path / "meta.json").exists():
        raise CheckpointError(
            f"{pointer} names {name!r}, which is missing or incomplete. Delete {pointer} to "
            "start fresh, or point it at an existing step_* directory."
        )
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint `path` (its step, world size and the settings that wrote
    it); raises `CheckpointError` naming the file when it cannot be read."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} has no readable {file.name} ({type(exc).__name__}: {exc}): give "
            "trainer.resume another checkpoint, or start fresh with trainer.resume=never"
        ) from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} does not hold a JSON object: it is not a checkpoint's meta.json")
    return meta


class CheckpointManager:
    """Writes, finds and restores checkpoints under one directory.

    Args:
        root: the checkpoint directory (created on save).
        rank: this process's rank.
        world_size: number of ranks; a checkpoint only loads into the same world size.
        keep: number of most recent checkpoints to keep.
    """

    def __init__(self, root: str | os.PathLike, *, rank: int, world_size: int, keep: int) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None when there is none."""
        return latest_checkpoint(self.root)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Save this rank's `state` for `step`; collective: every rank must call it."""
        final = self.root / f"step_{step:08d}"
        # Every rank must write into the same temporary directory: derive it from rank 0.
        token = [uuid.uuid4().hex[:8]]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        tmp = self.root / f".tmp_step_{step:08d}_{token[0]}"
        error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save(to_local(state), tmp / f"rank_{self.rank}.pt")
        except Exception as exc:  # reported collectively below, then re-raised
            error = exc
        ok = _all_ok(error is None)
        if ok and self.rank == 0:
            try:
                (tmp / "meta.json").write_text(
                    json.dumps({**meta, "step": step, "world_size": self.world_size}, indent=2)
                )
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                pointer_tmp = self.root / f".{LATEST}.{token[0]}"
                pointer_tmp.write_text(final.name)
                os.replace(pointer_tmp, self.root / LATEST)
            except Exception as exc:
                error = exc
        ok = _all_ok(error is None) and ok
        if not ok:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            where = f"rank {self.rank}: {error!r}" if error else "another rank"
            raise CheckpointError(
                f"saving checkpoint step {step} to {final} failed ({where}); the previous "
                f"checkpoint ({self.root / LATEST}) is untouched. Check free disk space and "
                "permissions of trainer.out_dir."
            ) from error
        if self.rank == 0:
            self._prune(step)
        _barrier()
        logger.info("saved checkpoint %s", final)
        return final

    def existing(self) -> list[Path]:
        """The `latest` pointer and step directories already under the root (sorted by name)."""
        found = [p for p in self.root.glob("step_*") if p.is_dir()]
        if (self.root / LATEST).exists():
            found.append(self.root / LATEST)
        return sorted(found)

    def _prune(self, saved_step: int) -> None:
        """Delete all but the `keep - 1` newest checkpoints older than `saved_step`.

        Only steps below the one just saved are candidates: a directory of a higher step is
        not one this run wrote after it, and the one just saved (and whatever `latest` names)
        must survive whatever else lies in the directory.
        """
        pointer = self.root / LATEST
        protected = {f"step_{saved_step:08d}"}
        if pointer.exists():
            protected.add(pointer.read_text().strip())
        older = sorted(
            (step, path)
            for path in self.root.glob("step_*")
            if path.is_dir()
            and path.name not in protected
            and (step := _step_of(path)) is not None
            and step < saved_step
        )
        for _, old in older[: max(0, len(older) - (self.keep - 1))]:
            try:
                shutil.rmtree(old)
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s (%s); delete it by hand", old, exc)

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read this rank's state and the meta of checkpoint `path`; collective."""
        error: str | None = None
        state: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        try:
            meta = json.loads((path / "meta.json").read_text())
            if meta.get("world_size") != self.world_size:
                error = (
                    f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has "
                    f"{self.world_size}; resume with the same number of processes or start fresh "
                    "(trainer.resume=never)"
                )
            else:
                file = path / f"rank_{self.rank}.pt"
                state = torch.load(file, map_location="cpu", weights_only=False)
                if not isinstance(state, dict):
                    error = f"{file} does not hold a checkpoint dict"
        except Exception as exc:
            error = (
                f"checkpoint {path} is unreadable or corrupt ({type(exc).__name__}: {exc}). "
                "Delete it (and fix 'latest') to resume from an earlier one, or start fresh "
                "(trainer.resume=never)"
            )
        if not _all_ok(error is None):
            raise CheckpointError(error or f"checkpoint {path} failed to load on another rank")
        return state, meta
