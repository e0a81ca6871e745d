"""What a callback may read and set on the loop that runs it.

`Trainer` has all of these attributes; a user's own TorchRec loop builds a `RunContext`
and passes it to the LoKA callback's hooks (see examples/own_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from loka_train.runtime.graphs import DenseGraphs
    from loka_train.runtime.sparse2d import Sparse2DLayout


@dataclass(kw_only=True)
class RunContext:
    """The minimal loop state the LoKA callback uses.

    Example:
        >>> ctx = RunContext(model=model, device=torch.device("cuda", 0), rank=rank,
        ...                  world_size=world, out_dir=Path("runs/x"))
        >>> loka.on_before_shard(ctx)       # converts ctx.model in place, may set codecs
        >>> ctx.model = DistributedModelParallel(ctx.model, ...)
        >>> loka.on_train_start(ctx)
    """

    model: nn.Module
    """The model: unsharded before `on_before_shard`, the DMP-wrapped one afterwards."""

    device: torch.device
    """Device of the dense computation."""

    dense_dtype: torch.dtype = torch.float32
    """The dtype the dense computation runs in: ``torch.bfloat16`` when the loop runs the dense
    towers under bf16 autocast, else ``torch.float32``."""

    rank: int = 0
    """Global rank of this process."""

    world_size: int = 1
    """Number of processes."""

    out_dir: Path = Path("runs/latest")
    """Where reports are written (rank 0)."""

    qcomm_codecs_registry: dict[str, Any] | None = None
    """Set by a callback in `on_before_shard`: pass it to EmbeddingBagCollectionSharder."""

    data_parallel_wrapper: Any = None
    """Set by a callback in `on_before_shard`: pass it to DistributedModelParallel."""

    progress_postfix: dict[str, str] = field(default_factory=dict)
    """Items a callback wants shown on the progress bar."""

    fallbacks: list[str] = field(default_factory=list)
    """Every fallback taken during the run."""

    graphs: DenseGraphs | None = None
    """The loop's `loka_train.runtime.graphs.DenseGraphs` when it replays the dense step as CUDA
    graphs (set it before `on_train_start`), else None: Dispatch then times GEMMs graphed."""

    sparse2d: Sparse2DLayout | None = None
    """The layout when the model is a ``DMPCollection`` (2D sparse parallelism,
    `loka_train.runtime.sparse2d`), else None."""

    replica_sync: Callable[[int], None] | None = None
    """With `sparse2d`: ``sync(step)`` of the tables' replicas, which the loop calls when
    `loka_train.runtime.sparse2d.sync_due` says (start with ``lambda step: model.sync()``); a
    callback may replace it in `on_train_start` (LoKA: through its codecs)."""

    evaluate_again: Callable[[], dict[str, float]] | None = None
    """``evaluate_again()``: the loop's held-out metrics (``{"eval/ne": ..., ...}``, gathered
    over the ranks) of the model as it is now, which a callback's `on_eval_end` may call to
    evaluate it once more in another form (LoKA's ``guard.forward_ne``); None where the loop
    offers none (``guard.forward_ne`` then refuses to start)."""


class LoopState(Protocol):
    """What every callback hook receives: a `Trainer` or a `RunContext` (same attributes)."""

    model: nn.Module
    device: torch.device
    dense_dtype: torch.dtype
    rank: int
    world_size: int
    out_dir: Path
    qcomm_codecs_registry: dict[str, Any] | None
    data_parallel_wrapper: Any
    progress_postfix: dict[str, str]
    fallbacks: list[str]
    graphs: DenseGraphs | None
    sparse2d: Sparse2DLayout | None
    replica_sync: Callable[[int], None] | None

    @property
    def evaluate_again(self) -> Callable[[], dict[str, float]] | None:
        """The loop's re-evaluation (``RunContext.evaluate_again``, ``Trainer.evaluate_again``)."""
