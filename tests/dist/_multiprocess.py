"""Forked multi-process gloo tests: one test body, run on every rank.

`run_multiprocess(fn, world_size=2, args=(...))` forks `world_size` workers from the
pytest process (about 0.3 s for 2 workers), joins them into a gloo group through a
FileStore in a fresh temporary directory (no fixed ports), calls `fn(rank, world_size,
*args)` on each, and re-raises the first worker failure with its traceback. A worker that
hangs is killed after `timeout` seconds and reported.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    store_path: str,
    args: tuple[Any, ...],
    errors: Any,
) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 180.0,
) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks.

    Args:
        fn: a module-level function (it is called in the forked children).
        world_size: number of ranks.
        args: extra positional arguments for `fn`.
        timeout: seconds before hung workers are killed and the test fails.
    """
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="loka_mp_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = mp.start_processes(
            _worker,
            args=(fn, world_size, store_path, args, errors),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        try:
            import time

            deadline = time.monotonic() + timeout
            while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in procs.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s")
        except mp.ProcessRaisedException as exc:
            reports = []
            while not errors.empty():
                rank, tb = errors.get()
                reports.append(f"--- rank {rank} ---\n{tb}")
            raise AssertionError("worker failed:\n" + "\n".join(reports or [str(exc)])) from None
        except mp.ProcessExitedException as exc:
            raise AssertionError(f"a worker died: {exc}") from None
