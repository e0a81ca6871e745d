"""The prefetcher yields exactly the source's items, in order, and re-raises its errors.

next() must never block once the source has ended, failed or been closed: those tests call it
in a helper thread with a deadline, so a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from loka_train.data.prefetch import Prefetcher


def test_same_items_in_order() -> None:
    assert list(Prefetcher(iter(range(50)), depth=3)) == list(range(50))


def test_error_is_reraised_at_its_position() -> None:
    def source():
        yield 1
        yield 2
        raise ValueError("malformed line 3")

    it = Prefetcher(source(), depth=2)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(ValueError, match="malformed line 3"):
        next(it)


def test_bad_depth() -> None:
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(iter([]), depth=0)


def test_close_stops_the_producer_of_an_endless_source() -> None:
    import itertools

    it = Prefetcher(itertools.count(), depth=2)
    assert next(it) == 0
    it.close()
    assert not it._thread.is_alive()


def _outcome_within(fn: Callable[[], object], seconds: float = 2.0) -> object:
    """fn()'s result or the exception it raised; fails the test when fn is still running after
    `seconds` (its thread is a daemon, so a hang does not keep the test process alive)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # the outcome under test
            box["result"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert "result" in box, f"next() still blocked after {seconds} s"
    return box["result"]


def test_error_is_reraised_by_every_later_next() -> None:
    def source():
        yield 1
        raise RuntimeError("source failed")

    it = Prefetcher(source(), depth=2)
    assert next(it) == 1
    for _ in range(3):
        outcome = _outcome_within(lambda: next(it))
        assert isinstance(outcome, RuntimeError) and str(outcome) == "source failed"


def test_end_is_sticky() -> None:
    it = Prefetcher(iter([7]), depth=1)
    assert list(it) == [7]
    for _ in range(3):
        assert isinstance(_outcome_within(lambda: next(it)), StopIteration)


def test_next_after_close_stops_instead_of_blocking() -> None:
    import itertools

    it = Prefetcher(itertools.count(), depth=2)
    assert next(it) == 0
    it.close()
    assert isinstance(_outcome_within(lambda: next(it)), StopIteration)


def test_exception_objects_yielded_by_the_source_are_items() -> None:
    items = [ValueError("an item, not an error"), 3]
    assert list(Prefetcher(iter(items), depth=2)) == items
