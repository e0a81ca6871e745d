"""The Probe measures at most ``max_cols`` output features of a GEMM (``sampling.cut_columns``):
which slices it keeps, that the tensor-wise scale and the row-wise scales of the kept slices are
the full operand's, and that the statistics barely move."""

from __future__ import annotations

import pytest
import torch

from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.probe import Probe, ProbeConfig
from loka_train.probe.sampling import cut_columns, select


def _w(n: int, k: int, peak: tuple[int, int]) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    w[peak] = 0.9
    return w


def test_forward_keeps_weight_rows_with_their_scales_and_the_peak() -> None:
    w, x = _w(64, 32, (37, 5)), torch.randn(8, 32)
    y = x @ w.T
    a, b, ref = cut_columns("forward", x, w, y, 16)
    assert a is x and b.shape == (16, 32) and ref is not None
    assert ref.shape == (8, b.shape[0])
    assert float(b.abs().max()) == pytest.approx(0.9)  # the peak row is kept: the tensor-wise amax is w's
    torch.testing.assert_close(ref, x @ b.T)  # the result's columns follow the kept rows
    full = quantize(w, Fp8Format.E4M3, Scaling.ROWWISE, axis=1)
    cut = quantize(b, Fp8Format.E4M3, Scaling.ROWWISE, axis=1)
    for j, row in enumerate(b):  # each kept row keeps its own scale
        (i,) = [i for i in range(64) if torch.equal(w[i], row)]
        assert torch.equal(cut.scale.flatten()[j], full.scale.flatten()[i])


def test_grad_input_keeps_weight_columns_and_grad_weight_cuts_both_operands() -> None:
    w, dy = _w(32, 64, (3, 50)), torch.randn(8, 32)
    a, b, ref = cut_columns("grad_input", dy, w, dy @ w, 16)
    assert a is dy and b.shape == (32, 16) and float(b.abs().max()) == pytest.approx(0.9)
    assert ref is not None
    torch.testing.assert_close(ref, dy @ b)
    dy2, x2 = torch.randn(128, 64), torch.randn(128, 48)
    dy2[7, 60] = 40.0
    a, b, ref = cut_columns("grad_weight", dy2, x2, dy2.T @ x2, 16)
    assert a.shape == b.shape == (128, 16) and float(a.abs().max()) == pytest.approx(40.0)
    assert ref is not None and ref.shape == (16, 16)
    torch.testing.assert_close(ref, a.T @ b)  # dW's rows follow dY's kept columns, its columns X's
    assert cut_columns("grad_weight", dy2, x2, None, 16)[2] is None
    # Dimensions within the limit are untouched (the same tensors).
    small = torch.randn(8, 8)
    assert cut_columns("forward", small, small, None, 16)[1] is small


def test_a_slice_holding_a_non_finite_value_is_not_the_peak() -> None:
    w = _w(64, 32, (11, 0))
    w[21, 3] = float("inf")  # a row the stride does not take (0, 5, 10, ...): only a peak could
    _, b, _ = cut_columns("forward", torch.randn(4, 32), w, None, 16)
    assert torch.isfinite(b).all() and float(b.abs().max()) == pytest.approx(0.9)


def _stats(max_cols: int | None, scalings: tuple[str, ...] = ("tensorwise", "rowwise")) -> dict[str, float]:
    probe = Probe(ProbeConfig(every_k_steps=1, interval=1, window=2, min_samples=1, max_rows=None,
                              max_cols=max_cols, scalings=scalings, formats=("e4m3",)))
    probe.register_site("s", weight_shape=(512, 256))
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(64, 256, generator=g), torch.randn(512, 256, generator=g) * 0.05, torch.randn(64, 512, generator=g)
    probe.begin_step(0)
    probe.observe_forward("s", x, w)
    probe.observe_backward("s", dy, x, w)
    probe.reduce()
    out = {}
    for role in ("forward", "grad_input", "grad_weight"):
        sqnr = probe.window_stats("s", role)["sqnr_db"][0]  # slot 0, one value per candidate
        for c, cand in enumerate(probe.candidates):
            out[f"{role}/{cand.scaling}"] = float(sqnr[c])
    return out


def test_sqnr_on_the_kept_columns_is_within_a_fraction_of_a_db_of_the_full_one() -> None:
    full, cut = _stats(None), _stats(64)
    assert full.keys() == cut.keys()
    for key in full:
        assert cut[key] == pytest.approx(full[key], abs=0.5), key
    assert any(cut[k] != full[k] for k in full)  # the cut did happen


def test_block_candidates_see_every_output_feature() -> None:
    assert _stats(64, ("block",)) == _stats(None, ("block",))


def test_max_cols_is_validated() -> None:
    for bad in (0, 3, True, 2.5):
        with pytest.raises(ValueError, match="max_cols"):
            ProbeConfig(max_cols=bad)
    assert select("forward", torch.randn(4, 8), torch.randn(6, 8), None, None, max_cols=None).b.shape == (6, 8)
