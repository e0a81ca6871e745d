"""The row-statistics kernel (under TRITON_INTERPRET=1) against its PyTorch reference, and the
Probe's full-operand pass taking the same rows and counts with it as without it."""

from __future__ import annotations

import pytest
import torch

from loka_train.kernels import triton_rowstats as rs
from loka_train.probe.sampling import select


def _operand(dtype: torch.dtype, rows: int = 37, cols: int = 1500) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    x[10] *= 100  # the peak row
    x[3, 7] = float("inf")
    x[5, 0], x[5, 9] = float("nan"), -float("inf")
    x[12, cols - 3] = -1e4  # a larger finite value (in the last column block of 1500)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_bit_identical_to_the_reference_with_non_finite_rows(dtype: torch.dtype, layout: str) -> None:
    x = _operand(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()  # column-major strides
    peak, bad = rs.row_stats(x)
    ref_peak, ref_bad = rs.row_stats_reference(x)
    assert peak.dtype == torch.float32 and bad.dtype == torch.int32 and peak.shape == bad.shape == (37,)
    assert torch.equal(peak, ref_peak) and torch.equal(bad, ref_bad)
    assert bad.tolist().count(0) == 35 and int(bad[5]) == 2 and int(bad[3]) == 1
    assert float(peak[3]) == float(peak[5]) == 0.0  # rows holding a non-finite value
    assert int(peak.argmax()) == 12 and float(peak[12]) == float(abs(x[12].float()).max())


def test_empty_and_non_2d_inputs() -> None:
    peak, bad = rs.row_stats(torch.zeros(0, 5))
    assert peak.shape == bad.shape == (0,)
    peak, bad = rs.row_stats(torch.zeros(3, 0))
    assert peak.tolist() == [0.0, 0.0, 0.0] and bad.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="2-D"):
        rs.row_stats(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):  # fp64 may hold values beyond fp32
        rs.row_stats(torch.full((2, 3), 1e39, dtype=torch.float64))


@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_select_takes_the_same_rows_and_counts_with_the_kernel(role: str) -> None:
    a = _operand(torch.bfloat16, rows=300, cols=64)
    b = _operand(torch.bfloat16, rows=300, cols=48) if role == "grad_weight" else torch.randn(48, 64)
    if role == "grad_weight":
        b[250] *= 1000  # b's peak row must be kept too
    with_kernel = select(role, a, b, None, 16, kernel=True)
    without = select(role, a, b, None, 16, kernel=False)
    for x, y in zip(with_kernel, without):
        if x is None:
            assert y is None
            continue
        assert torch.equal(x.float().nan_to_num(7.0), y.float().nan_to_num(7.0))
    assert int(with_kernel.nf_a) == 3 and with_kernel.a.shape[0] == 16
    assert int(with_kernel.nf_b) == (3 if role == "grad_weight" else 0)


@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_select_counts_both_operands_with_one_kernel_read_each(role: str, monkeypatch) -> None:
    """The weight's non-finite count too (forward, grad-input) comes from the kernel: in
    PyTorch ops it is a full-size product, a comparison and a sum."""
    from loka_train.probe import sampling

    calls: list[tuple[int, ...]] = []
    real = sampling.row_stats

    def counted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(sampling, "row_stats", counted)
    a = _operand(torch.bfloat16, rows=300, cols=64)
    b = _operand(torch.bfloat16, rows=300, cols=48) if role == "grad_weight" else torch.randn(48, 64)
    b.view(-1)[[5, 70]] = float("nan")
    sel = select(role, a, b, None, 16, kernel=True)
    assert calls == [tuple(a.shape), tuple(b.shape)]
    assert int(sel.nf_b) == int(select(role, a, b, None, 16, kernel=False).nf_b) >= 2


def test_the_forward_s_output_features_are_cut_by_the_kernel_s_row_peaks(monkeypatch) -> None:
    """With `max_cols`, the forward keeps weight rows chosen by their peaks: taken from the
    kernel's read of the weight (no second pass over it), the same rows as the PyTorch path."""
    from loka_train.probe import sampling

    a = _operand(torch.bfloat16, rows=300, cols=64)
    w = torch.randn(96, 64) * 0.02
    w[77, 5] = 0.9  # a peak row the even spread does not take
    w[40, 2] = float("inf")  # a non-finite row is never the peak
    without = select("forward", a, w, None, 16, max_cols=16, kernel=False)
    calls: list[int] = []
    real = sampling._slice_peaks

    def counted(x: torch.Tensor, *, dim: int) -> torch.Tensor:
        calls.append(dim)
        return real(x, dim=dim)

    monkeypatch.setattr(sampling, "_slice_peaks", counted)
    with_kernel = select("forward", a, w, None, 16, max_cols=16, kernel=True)
    assert calls == []
    assert with_kernel.b.shape == (16, 64) and torch.equal(with_kernel.b, without.b)
    assert float(with_kernel.b.abs().max()) == pytest.approx(0.9)


@pytest.mark.parametrize("cols", [27, 64, 100])
def test_narrow_rows_take_a_taller_tile_with_the_same_results(cols: int, monkeypatch) -> None:
    """Rows narrower than the tile's 1024 columns are read by taller tiles of about as many
    elements (Wukong's 4M x 27 projections); the results stay the reference's."""
    monkeypatch.setattr(rs, "_TILE", 256)  # small tiles: several programs, a ragged last one
    block_m, block_k = rs._blocks(cols)
    assert block_k == triton_next_pow2(cols) and block_m == max(4, 256 // block_k)
    x = _operand(torch.bfloat16, rows=301, cols=cols)
    peak, bad = rs.row_stats(x)
    ref_peak, ref_bad = rs.row_stats_reference(x)
    assert torch.equal(peak, ref_peak) and torch.equal(bad, ref_bad)
    assert rs._blocks(4096) == (4, 1024)  # wide rows: the loop over 1024-column blocks


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
