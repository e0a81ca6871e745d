"""The Probe's tensor-wise and row-wise candidates quantize from the operand's amax already
reduced, in one division for the payload and the counts: the window vectors are bit for bit
those of quantize() + clipped_counts() (`Measurement.fast_scalings` off)."""

from __future__ import annotations

import pytest
import torch

from loka_train.probe import ProbeConfig
from loka_train.probe import measurement as m
from loka_train.probe.candidates import candidates_of
from loka_train.probe.window import WindowLayout


def _operands(role: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    mm, k, n = 96, 64, 48
    shapes = {"forward": ((mm, k), (n, k)), "grad_input": ((mm, n), (n, k)), "grad_weight": ((mm, n), (mm, k))}
    (ra, ca), (rb, cb) = shapes[role]
    # Values over 10 decades (underflow in e4m3 and e5m2), exact zeros, a few outlier rows.
    a = torch.randn(ra, ca, generator=gen) * torch.logspace(-8, 2, ca)
    a[3] *= 1e3
    a[:, 5] = 0.0
    b = torch.randn(rb, cb, generator=gen) * 0.05
    b[0, :7] = 0.0
    return a.bfloat16(), b


@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_fast_path_is_quantize_and_clipped_counts(role: str) -> None:
    cfg = ProbeConfig(formats=("e4m3", "e5m2"), scalings=("tensorwise", "rowwise"), cuda_graphs=False)
    cands = candidates_of(cfg)
    layout = WindowLayout(len(cands))
    a, b = _operands(role)
    out = {}
    for fast in (True, False):
        meas = m.Measurement(cfg, cands, layout, device=torch.device("cpu"))
        meas.fast_scalings = fast
        out[fast] = meas.measure(role, a, b, m.count_nonfinite(a), m.count_nonfinite(b), None, graphable=False)
    for fast_vec, ref_vec in zip(out[True], out[False]):
        assert torch.equal(fast_vec, ref_vec)
    # Operand a's values over 10 decades underflow (under tensor-wise scales at least): the
    # compared counts are not all zeros.
    vec_sum = out[True][0]
    assert sum(float(vec_sum[layout.underflow["a"] + c]) for c in range(len(cands))) > 0


def test_underflow_count_is_exact_beyond_fp32_integers() -> None:
    """2^24 + 2 values, one of them zero: counted in int64, the fast path's underflow count
    is the reference's (fp32 holds whole numbers exactly only up to 2^24)."""
    cfg = ProbeConfig(formats=("e4m3",), scalings=("tensorwise",), cuda_graphs=False, max_rows=None, max_cols=None)
    cands = candidates_of(cfg)
    layout = WindowLayout(len(cands))
    a = torch.ones(2796203, 6)
    a[0, 0] = 0.0
    b = torch.ones(4, 6)
    out = {}
    for fast in (True, False):
        meas = m.Measurement(cfg, cands, layout, device=torch.device("cpu"))
        meas.fast_scalings = fast
        out[fast] = meas.measure("forward", a, b, m.count_nonfinite(a), m.count_nonfinite(b), None, graphable=False)
    assert float(out[True][0][layout.underflow["a"]]) == float(out[False][0][layout.underflow["a"]]) == 0.0
