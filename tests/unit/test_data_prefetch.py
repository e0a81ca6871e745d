"""The prefetcher yields exactly the source's items, in order, and re-raises its errors."""

from __future__ import annotations

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
