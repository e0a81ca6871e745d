"""Page-locked (pinned) copies of the train batches, so the copy to the GPU leaves the host free.

TorchRec's train pipelines copy each batch to the GPU with ``non_blocking=True``. From
pageable memory that copy is not asynchronous: the driver stages it through a pinned buffer
of its own, on the host thread that issues it, in the middle of a host-bound step. From
page-locked memory it is a DMA on the pipeline's copy stream, and the host goes on at once.

:class:`PinnedBatches` pins each batch before the step sees it (in the prefetch thread when
``trainer.prefetch`` is on). A batch object it has seen before, as from a source that caches
its batches (``data.cache_batches``), is served from its pinned copy instead of being pinned
again, within a byte budget (least recently used first out).

Example:
    >>> batches = PinnedBatches(dataset.batches(0, 1000))   # on a CUDA machine
    >>> next(batches).dense_features.is_pinned()
    True
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from torch import Tensor

T = TypeVar("T")

MEMO_BYTES = 1 << 30
"""Pinned copies of seen batches kept for reuse: 1 GiB, about 300 batches of 8192 samples of
the synthetic data (3.4 MB each)."""


def batch_bytes(batch: Any) -> int:
    """Bytes of a TorchRec ``Batch``'s tensors (dense features, labels, and the sparse
    features' values, lengths, offsets and weights)."""
    kjt = batch.sparse_features
    parts: list[Tensor | None] = [
        batch.dense_features, batch.labels, kjt.values(), kjt.weights_or_none(),
        kjt.lengths_or_none(), kjt.offsets_or_none(),
    ]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def pin_batch(batch: Any) -> Any:
    """The page-locked copy of a batch (a tensor already pinned is kept as it is)."""
    return batch.pin_memory()


class PinnedBatches(Generic[T]):
    """Iterate `source`, yielding a pinned copy of each item.

    Args:
        source: the batches (TorchRec ``Batch`` or anything `pin` and `nbytes` take).
        pin: makes the pinned copy (default ``item.pin_memory()``).
        nbytes: an item's size, for the memo's budget (default :func:`batch_bytes`).
        memo_bytes: budget of the pinned copies kept for items seen again; 0 keeps none.
    """

    def __init__(
        self,
        source: Iterator[T],
        *,
        pin: Callable[[T], T] = pin_batch,
        nbytes: Callable[[T], int] = batch_bytes,
        memo_bytes: int = MEMO_BYTES,
    ) -> None:
        if memo_bytes < 0:
            raise ValueError(f"memo_bytes must be >= 0, got {memo_bytes}")
        self._source = source
        self._pin = pin
        self._nbytes = nbytes
        self._memo_bytes = memo_bytes
        # id(item) -> (a weak reference to the item, its pinned copy, its size). The weak
        # reference tells a live item from a new one that reuses a dead item's id.
        self._memo: OrderedDict[int, tuple[weakref.ref, T, int]] = OrderedDict()
        self._held = 0
        self.pinned = 0
        """Items pinned (copied into page-locked memory)."""
        self.reused = 0
        """Items served from the pinned copy of an earlier identical item."""

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        item = next(self._source)
        key = id(item)
        entry = self._memo.get(key)
        if entry is not None and entry[0]() is item:
            self._memo.move_to_end(key)
            self.reused += 1
            return entry[1]
        pinned = self._pin(item)
        self.pinned += 1
        if self._memo_bytes:
            self._remember(key, item, pinned)
        return pinned

    def _remember(self, key: int, item: T, pinned: T) -> None:
        try:
            ref = weakref.ref(item)
        except TypeError:  # an item that takes no weak reference is never reused
            return
        for dead in [k for k, (r, _, _) in self._memo.items() if r() is None]:
            self._held -= self._memo.pop(dead)[2]
        size = self._nbytes(item)
        if size > self._memo_bytes:
            return
        old = self._memo.pop(key, None)
        if old is not None:
            self._held -= old[2]
        self._memo[key] = (ref, pinned, size)
        self._held += size
        while self._held > self._memo_bytes:
            self._held -= self._memo.popitem(last=False)[1][2]

    @property
    def held_bytes(self) -> int:
        """Bytes of the pinned copies kept for reuse."""
        return self._held
