"""Produce batches in a background thread, so data generation overlaps the training step.

Torch ops release the GIL, so one thread generating the next batches (synthetic data is
~50 ms per 8192-sample batch on one CPU core) runs alongside the step on the GPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar, cast

T = TypeVar("T")

_END = object()


class _Failure:
    """The source's exception, wrapped so that an exception the source yields as an item stays
    an item."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher(Generic[T]):
    """Iterate `source` in a daemon thread, keeping up to `depth` items ready.

    Exceptions raised by `source` are re-raised in the consumer at the same position, and
    again by every later `next()`, like the end of the source, which stays the end. After
    `close()`, `next()` raises StopIteration (as a closed generator does) instead of waiting
    for a producer that is gone.

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
        self._final: object | None = None
        """_END or the source's _Failure once the consumer has reached it; the producer has
        exited then, so every later next() must answer from here rather than wait on the queue."""
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
            self._put(_Failure(exc))

    def __iter__(self) -> Iterator[T]:
        return self

    def _get(self) -> object:
        """The next queued item; _END once closed. Waits in slices so a close() from another
        thread, or a producer that died without its end marker, cannot leave it blocked."""
        while not self._stop.is_set():
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._thread.is_alive():
                    continue
                try:  # it may have queued its last item just before exiting
                    return self._queue.get_nowait()
                except queue.Empty:
                    raise RuntimeError(
                        "the prefetch thread exited without an end marker or an error; this "
                        "is a bug in loka_train.data.prefetch"
                    ) from None
        return _END

    def __next__(self) -> T:
        item = self._final if self._final is not None else self._get()
        if item is _END:
            self._final = _END
            raise StopIteration
        if isinstance(item, _Failure):
            self._final = item
            raise item.exc
        return cast(T, item)

    def close(self) -> None:
        """Stop the producer thread and wait for it (it exits within 0.1 s of its current item)."""
        self._stop.set()
        self._thread.join(timeout=10.0)
