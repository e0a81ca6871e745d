"""Produce batches in a background thread, so data generation overlaps the training step.

Torch ops release the GIL, so one thread generating the next batches (synthetic data is
~50 ms per 8192-sample batch on one CPU core) runs alongside the step on the GPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()


class Prefetcher(Generic[T]):
    """Iterate `source` in a daemon thread, keeping up to `depth` items ready.

    Exceptions raised by `source` are re-raised in the consumer at the same position.

    Args:
        source: the iterator to drain.
        depth: how many items may wait in the queue.

    Example:
        >>> for batch in Prefetcher(dataset.batches(0, 100), depth=4):
        ...     train(batch)
    """

    def __init__(self, source: Iterator[T], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source,), daemon=True, name="loka-prefetch"
        )
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless closed meanwhile; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(exc)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it (it exits within 0.1 s of its current item)."""
        self._stop.set()
        self._thread.join(timeout=10.0)
