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


@pytest.mark.parametrize("row_amax", [False, True])
def test_traced_codes_are_the_static_quantizers_and_its_amax_the_tensors(row_amax: bool) -> None:
    import torch

    from bench.producer_cast import traced_codes
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.formats import Fp8Format

    fmt = Fp8Format.E4M3
    x = (torch.randn(64, 48) * 3).to(torch.bfloat16)
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=torch.device("cpu"))[0]
    ss.quantize_static_reference(x, slot, fmt)  # seeds the slot
    ref_q, _ = ss.quantize_static_reference(x, slot, fmt)
    q, q_t, amax = traced_codes(x, slot, fmt, both=True, row_amax=row_amax)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), ref_q.t().contiguous().view(torch.uint8))
    assert torch.equal(amax, x.float().abs().amax(dim=-1) if row_amax else x.float().abs().amax())
