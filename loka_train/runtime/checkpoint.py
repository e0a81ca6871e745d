"""Checkpoints of a sharded run: written once through ``torch.distributed.checkpoint`` (DCP),
atomically, and loaded onto any number of processes.

Layout under `<run directory>/checkpoints/` (`runtime.rundirs`):
    step_00000100/.metadata, __0_0.distcp ...   model and optimizer (DCP: each tensor once,
                                                 sharded ones by their global offsets)
    step_00000100/rank_0.pt ... rank_{W-1}.pt    rank-local state (RNG, callback states)
    step_00000100/meta.json                      step, world size, format and settings
    latest                      (text file naming the newest complete step directory)

The sharded part (`SHARDED_KEYS` of the state: the model's and the optimizer's state dicts,
TorchRec's ShardedTensors of the embedding tables and of their fused optimizer included) goes
to `torch.distributed.checkpoint.save`, the rest of the state to one ``torch.save`` file per
rank. Every rank writes into a temporary directory; only when every rank succeeded does rank
0 rename it into place and then atomically repoint `latest`, so a failed save never touches
the previous checkpoint. Loading reads the sharded part in place into the live state dicts
(`torch.distributed.checkpoint.load` reshards it onto this run's world size and plan) and
hands back this rank's local state, or, where the checkpoint was written by another number of
ranks, rank 0's (`CheckpointManager.rank_states` reads all of them for callbacks that merge).

Checkpoints of the per-rank format (``rank_*.pt`` holding the local shards, no DCP metadata:
``meta.json`` without ``format``) load into the same number of processes only (`restore`
copies them in place); a checkpoint that fails to load raises `CheckpointError` naming the file
and the fix, on every rank.

Pruning after a save deletes only checkpoints of older steps than the one just saved (keeping
`keep` in all), never the one just saved nor the one `latest` names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from loka_train.runtime.callbacks import CallbackList

logger = logging.getLogger(__name__)

LATEST = "latest"
FORMAT = "dcp"
"""``meta.json``'s ``format`` of a checkpoint written through DCP."""
SHARDED_KEYS = ("model", "optimizer")
"""Keys of a run's state that DCP saves (and reshards on load); the rest is rank-local."""


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
    saved: dict[str, Any], meta: dict[str, Any], *, path: Path, manager: CheckpointManager, model: nn.Module,
    optimizer: torch.optim.Optimizer, callbacks: CallbackList, device: torch.device, allow_new: bool,
) -> list[str]:
    """Apply checkpoint `path` that ``manager.load(path, into=live)`` read (`saved`, `meta`;
    `live`: the model's and the optimizer's ``state_dict()``, loaded in place) to the run: the
    optimizer's loaded state dict into `optimizer`, then the callbacks' and the RNG states.

    A checkpoint of another number of processes hands every saved rank's callback states to
    `CallbackList.merge_rank_states`; ranks beyond the saved ones take rank 0's RNG state. A
    per-rank-format checkpoint (this rank's local shards) is copied into the live state in place.

    Args:
        saved: this rank's state as `CheckpointManager.load` returned it.
        meta: the checkpoint's meta.json.
        path: the checkpoint.
        manager: the manager that loaded it (it reads the other ranks' states).
        model: the live (sharded) model.
        optimizer: the live optimizer whose ``state_dict()`` the load filled.
        callbacks: the run's callbacks.
        device: this rank's device (its CUDA RNG state is restored on a GPU).
        allow_new: stateful callbacks the checkpoint does not know start fresh (else raise).

    Returns:
        The callbacks that had no state in the checkpoint.

    Example:
        >>> live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        >>> saved, meta = manager.load(path, into=live)
        >>> restore(saved, meta, path=path, manager=manager, model=model, optimizer=opt,
        ...         callbacks=cbs, device=dev, allow_new=False)
    """
    if is_per_rank_format(meta):
        copy_into(model.state_dict(), saved["model"], "model")
        live_opt = optimizer.state_dict()
        copy_into(live_opt["state"], saved["optimizer"]["state"], "optimizer.state")
        optimizer.load_state_dict(live_opt)
    else:
        optimizer.load_state_dict(saved["optimizer"])
    states = saved["callbacks"]
    if meta["world_size"] != manager.world_size:
        if manager.rank == 0:
            logger.info(
                "resuming %s, written by %d processes, on %d: the model and optimizer are "
                "resharded, each callback merges its ranks' states, processes beyond the saved "
                "ones take rank 0's RNG state", path, meta["world_size"], manager.world_size,
            )
        states = callbacks.merge_rank_states(
            [s["callbacks"] for s in manager.rank_states(path)], rank=manager.rank, world_size=manager.world_size
        )
    fresh = callbacks.load_state_dict(states, allow_missing=allow_new)
    torch.set_rng_state(saved["rng"]["torch"])
    if "cuda" in saved["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state(saved["rng"]["cuda"], device)
    return fresh


def _is_sharded(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, ShardedTensor | DTensor)


def _whole_targets(live: Any) -> Any:
    """`live` with each sharded tensor replaced by an empty host tensor of its whole size (None
    where this rank holds no piece of it: not read), containers copied, other leaves kept (plain
    tensors load in place)."""
    from loka_train.models import local_shards

    if _is_sharded(live):
        if not any(t.numel() for t, _ in local_shards(live)):
            return None
        return torch.empty(tuple(live.shape), dtype=live.dtype)
    if isinstance(live, dict):
        # A sharded tensor of which this rank holds nothing is left out: not read at all.
        targets = {k: _whole_targets(v) for k, v in live.items()}
        return {k: t for k, t in targets.items() if t is not None or not _is_sharded(live[k])}
    if isinstance(live, list | tuple):
        return type(live)(_whole_targets(v) for v in live)
    return live


def _copy_pieces(live: Any, whole: Any) -> Any:
    """Copy from the read `whole` tensors each piece of `live`'s sharded tensors this rank
    holds, by its offsets; returns `live`'s structure with the loaded leaves of `whole` where
    `live` has no sharded tensor (plain tensors were loaded in place, other values replaced)."""
    from loka_train.models import local_shards

    if _is_sharded(live):
        if whole is not None:
            with torch.no_grad():
                for piece, offsets in local_shards(live):
                    region = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                    piece.copy_(whole[region].to(device=piece.device))
        return live
    if isinstance(live, dict):
        return {k: _copy_pieces(v, whole.get(k)) for k, v in live.items()}
    if isinstance(live, list | tuple):
        return type(live)(_copy_pieces(v, w) for v, w in zip(live, whole))
    return whole


def load_by_copy(live: dict[str, Any], path: Path) -> dict[str, Any]:
    """Load checkpoint `path`'s sharded part into the live state dicts `live` without DCP
    loading into their sharded tensors: each one this rank holds a piece of is read whole into
    host memory (DCP reshards the saved pieces onto it), then the pieces are copied into the
    live tensors by their offsets (`models.local_shards`). Plain tensors load in place as in
    `CheckpointManager.load`; the other values come back loaded. Collective.

    For layouts whose sharded tensors DCP cannot load into (TorchRec's ``DMPCollection``: its
    replicated shards); costs host memory for every whole tensor this rank holds a piece of.
    Returns `live`'s structure with its sharded tensors (now loaded) and the loaded values."""
    whole = _whole_targets(live)
    dcp.load(whole, checkpoint_id=path, no_dist=not dist.is_initialized())
    return _copy_pieces(live, whole)


def _copy_tensor(live: torch.Tensor, saved: torch.Tensor, path: str) -> None:
    if live.shape != saved.shape:
        raise CheckpointError(
            f"{path}: shape {tuple(saved.shape)} in checkpoint, {tuple(live.shape)} in the model; "
            "the model config or sharding changed"
        )
    with torch.no_grad():
        live.copy_(saved.to(device=live.device, dtype=live.dtype))


def _failures(error: str | None) -> list[tuple[int, str]]:
    """Collective: every failing rank with its error message, the same list on every rank
    (empty when `error` is None everywhere), so each rank's error can name the rank that failed
    and why, not only that one did.

    A MIN all-reduce decides; the messages are gathered only when some rank failed.
    """
    if not dist.is_initialized():
        return [] if error is None else [(0, error)]
    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        return []
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)
    return [(rank, message) for rank, message in enumerate(messages) if message is not None]


def _describe(failures: list[tuple[int, str]], world_size: int) -> str:
    """``rank 1: <cause>``, ranks with the same cause named together (``ranks 0, 1: ...``); the
    bare cause in a run of one process."""
    if world_size == 1:
        return "; ".join(message for _, message in failures)
    by_message: dict[str, list[int]] = {}
    for rank, message in failures:
        by_message.setdefault(message, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in by_message.items()
    )


def _cause(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


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


def is_per_rank_format(meta: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's `meta` (its meta.json) is of the per-rank format, which loads only
    into the number of processes that wrote it."""
    return meta.get("format") != FORMAT


def per_rank_format_fix(path: Path, world_size: Any) -> str:
    """How to resume a per-rank-format checkpoint `path` (written by `world_size` processes)."""
    return (
        f"checkpoint {path} is in the per-rank format (rank_*.pt files of local shards, no "
        f"distributed-checkpoint metadata), which loads only into the {world_size} processes that "
        f"wrote it: resume it once with {world_size} processes (its next checkpoint is written in "
        "the distributed format, which resumes on any number of processes), or start a new run "
        "with trainer.resume=never"
    )


class CheckpointManager:
    """Writes, finds and restores checkpoints under one directory.

    Args:
        root: the checkpoint directory (created on save).
        rank: this process's rank.
        world_size: number of ranks.
        keep: number of most recent checkpoints to keep.

    Example:
        >>> mgr = CheckpointManager(run / "checkpoints", rank=0, world_size=2, keep=2)
        >>> mgr.save(100, trainer.state_dict(), {"seed": 0})           # collective
        >>> live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        >>> saved, meta = mgr.load(mgr.latest(), into=live)             # collective
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
        """Save `state` for `step`: its `SHARDED_KEYS` through DCP, the rest as this rank's
        local file; collective: every rank must call it."""
        final = self.root / f"step_{step:08d}"
        # Every rank must write into the same temporary directory: derive it from rank 0.
        token = [uuid.uuid4().hex[:8]]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        tmp = self.root / f".tmp_step_{step:08d}_{token[0]}"
        sharded = {k: v for k, v in state.items() if k in SHARDED_KEYS}
        local = {k: v for k, v in state.items() if k not in SHARDED_KEYS}
        error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save(to_local(local), tmp / f"rank_{self.rank}.pt")
        except Exception as exc:  # reported collectively below, then re-raised
            error = exc
        failures = _failures(_cause(error))
        if sharded and not failures:
            try:  # collective; a failure on one rank raises on every rank
                dcp.save(sharded, checkpoint_id=tmp, no_dist=not dist.is_initialized())
            except Exception as exc:
                error = exc
            failures = _failures(_cause(error))
        if not failures:
            if self.rank == 0:
                try:
                    (tmp / "meta.json").write_text(
                        json.dumps({**meta, "step": step, "world_size": self.world_size, "format": FORMAT}, indent=2)
                    )
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(tmp, final)
                    pointer_tmp = self.root / f".{LATEST}.{token[0]}"
                    pointer_tmp.write_text(final.name)
                    os.replace(pointer_tmp, self.root / LATEST)
                except Exception as exc:
                    error = exc
            failures = _failures(_cause(error))
        if failures:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            where = _describe(failures, self.world_size)
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

    def load(
        self, path: Path, into: dict[str, Any] | None = None, *, by_copy: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read checkpoint `path`; collective. Returns this rank's state and the meta.

        The sharded part loads in place into `into` (live state dicts under `SHARDED_KEYS`,
        resharded onto this run) and comes back in the state under the same keys. The local
        part is this rank's file, or rank 0's when the checkpoint was written by fewer ranks. A
        per-rank-format checkpoint returns this rank's whole file (`restore` copies it) and loads
        only into the world size that wrote it.

        With `by_copy`, each sharded tensor of `into` that this rank holds a piece of is read
        whole into host memory and its pieces are copied in by their offsets (`load_by_copy`):
        for layouts whose tensors DCP does not load in place (TorchRec's ``DMPCollection``).
        """
        error: str | None = None
        state: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        try:
            meta = json.loads((path / "meta.json").read_text())
            saved_world = meta.get("world_size")
            if is_per_rank_format(meta) and saved_world != self.world_size:
                error = per_rank_format_fix(path, saved_world)
            else:
                state = self._read_local(path, meta)
        except Exception as exc:
            error = _corrupt(path, exc)
        failures = _failures(error)
        if failures:
            raise CheckpointError(_describe(failures, self.world_size))
        if is_per_rank_format(meta):
            return state, meta
        sharded = {k: v for k, v in (into or {}).items() if k in SHARDED_KEYS}
        if sharded:
            try:  # collective: a failure on one rank raises on every rank
                if by_copy:
                    sharded = load_by_copy(sharded, path)
                else:
                    dcp.load(sharded, checkpoint_id=path, no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as exc:
                hint = (
                    " (resuming by copy, as 2D sparse parallelism does: each whole table and optimizer "
                    "state must have the same shape under both sharding plans; column-wise sharding "
                    "gives a row-wise optimizer state per column shard, so resume such a run without "
                    "trainer.sharding_group_size, or with the sharding that wrote it)" if by_copy else ""
                )
                raise CheckpointError(_load_error(path, exc) + hint) from exc
        return {**state, **sharded}, meta

    def rank_states(self, path: Path) -> list[dict[str, Any]]:
        """The local state of every rank that wrote checkpoint `path` (rank order)."""
        meta = read_meta(path)
        try:
            return [_read_file(path / f"rank_{r}.pt") for r in range(int(meta["world_size"]))]
        except Exception as exc:
            raise CheckpointError(_corrupt(path, exc)) from exc

    def _read_local(self, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        rank = self.rank if self.rank < int(meta.get("world_size", 0)) else 0
        return _read_file(path / f"rank_{rank}.pt")


def _read_file(file: Path) -> dict[str, Any]:
    state = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"{file} does not hold a checkpoint dict")
    return state


def _load_error(path: Path, exc: BaseException) -> str:
    """The message of a failed DCP load: a state that does not fit the model, or a corrupt one."""
    found = list(exc.failures.values()) if isinstance(exc, CheckpointException) else [exc]
    failures = [f[0] if isinstance(f, tuple) else f for f in found]  # (exception, traceback) or one
    for failure in failures:
        text = str(failure)
        if "Size mismatch" in text or "Missing key" in text:
            return (
                f"cannot resume from {path}: the model's state does not fit it (shape or key "
                f"mismatch: {text.splitlines()[0][:300]}); the model config changed since this "
                f"checkpoint: resume it with the settings that wrote it ({path / 'meta.json'}), "
                "or start a new run with trainer.resume=never"
            )
    return _corrupt(path, failures[0] if failures else exc)


def _corrupt(path: Path, exc: BaseException) -> str:
    return (
        f"checkpoint {path} is unreadable or corrupt ({type(exc).__name__}: {exc}). "
        "Delete it (and fix 'latest') to resume from an earlier one, or start fresh "
        "(trainer.resume=never)"
    )
