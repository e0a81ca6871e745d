"""A one-rank gloo process group, for tests that need ``torch.distributed`` in one process."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone for the block (the one already made, if any, is kept)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.NamedTemporaryFile(prefix="loka_pg_") as f:
        store = f.name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
