"""bench.producer_cast's command line on the CPU (the timings need a GPU): the widths it takes
and the clear error for ones it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.producer_cast import _widths, main


def test_widths_are_comma_separated_positive_integers_and_may_be_none() -> None:
    assert _widths("4096,2048") == [4096, 2048] and _widths("") == [] and _widths("3456,") == [3456]


@pytest.mark.parametrize("bad", ["''", "4096,x", "0"])
def test_a_width_it_cannot_read_stops_before_anything_runs(bad: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "out"), "--ks", bad])
    assert "--ks" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
