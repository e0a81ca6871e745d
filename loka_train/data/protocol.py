"""The dataset protocol shared by the synthetic generator and the Criteo readers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch


@runtime_checkable
class RecDataset(Protocol):
    """A deterministic, rank-sliced stream of DLRM batches.

    The global batch of step s is the concatenation over ranks r = 0..W-1 of the local
    batches, so a 1-process run with batch W*B sees exactly what W ranks of batch B see.

    Example:
        >>> ds = make_dataset(DataConfig(), split="train", rank=0, world_size=1, batch_size=256)
        >>> batch = ds.batch(0)  # Batch(dense_features, sparse_features, labels)
    """

    feature_names: list[str]
    """Keys of the KeyedJaggedTensor: cat_0 .. cat_{F-1}."""

    num_embeddings_per_feature: list[int]
    """Table rows per feature; every id of feature f lies in [0, rows[f])."""

    num_dense: int
    """Width of dense_features."""

    def batch(self, step: int) -> Batch:
        """The local batch of `step`: a deterministic function of (data, split, step, rank, world)."""
        ...

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Local batches of steps start_step, start_step+1, ... (num_steps of them, or until the
        data ends; synthetic data never ends)."""
        ...


@runtime_checkable
class CachedBatches(Protocol):
    """A dataset that keeps generated batches in memory (synthetic ``data.cache_batches``), whose
    kept batches the trainer can swap for page-locked copies before the first step."""

    def pin_cache(self, pin: Callable[[Batch], Batch]) -> tuple[int, int]:
        """Replace each kept batch by ``pin(batch)``; returns (batches, bytes)."""
        ...
