"""bench.graph_drift's gap arithmetic (the GPU runs themselves need CUDA)."""

from __future__ import annotations

import pytest

from bench.graph_drift import max_gap, pair_gaps


def test_max_gap_is_relative_to_the_reference_and_names_its_step() -> None:
    gap, step = max_gap([1.0, 2.2, 2.9], [1.0, 2.0, 3.0])
    assert step == 1 and gap == pytest.approx(0.1)
    with pytest.raises(ValueError):  # runs of different lengths are not compared silently
        max_gap([1.0, 2.0], [1.0])


def test_pair_gaps_compares_each_kind_of_pair_once() -> None:
    runs = {"eager": [[1.0, 2.0], [1.0, 2.0], [1.0, 1.8]], "graphed": [[1.1, 2.0]]}
    gaps = pair_gaps(runs)
    assert [g for g, _ in gaps["eager~eager"]] == pytest.approx([0.0, 0.2 / 1.8, 0.2 / 1.8])
    # The graphed run against each eager run, relative to the eager one.
    assert [s for _, s in gaps["eager~graphed"]] == [0, 0, 1]
    assert [g for g, _ in gaps["eager~graphed"]] == pytest.approx([0.1, 0.1, 0.2 / 1.8])
    assert gaps["graphed~graphed"] == []

