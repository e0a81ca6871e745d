"""The block kernels (loka_train.kernels.triton_block) under TRITON_INTERPRET=1 against their
pure-PyTorch references, plus torch.library.opcheck of their custom ops.

The transposing quantizer is compared bit-exactly with ``formats.quantize`` of the transpose
(codes and scales); column sums and LayerNorm's backward differ from their references in fp32
summation order only: > 120 dB with fp32 data; with bf16 data both round the same fp32 value
once (> 100 dB). Shapes are tiny and not multiples of the tiles: the interpreter is slow.
"""

import math

import pytest
import torch

from loka_train.kernels import triton_block as tb
from loka_train.kernels import triton_kernels as tk
from loka_train.kernels import triton_layernorm as tln
from loka_train.kernels.formats import Fp8Format, Scaling, quantize, sqnr_db

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]


def _gauss(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bits(t):
    return t.view(torch.uint8)


@pytest.fixture(params=["one_part", "parts_reduced_first", "parts_reduced_in_kernel"])
def column_path(request, monkeypatch):
    """Per-column scales come from the column-amax kernel's partial maxima: one partial row
    for these tiny inputs; or, at 2 rows per program, many, reduced by a kernel of their own
    first or by every quantizing program itself over several chunks of 16."""
    if request.param != "one_part":
        monkeypatch.setattr(tb, "_AMAX_ROWS", 2)
    if request.param == "parts_reduced_in_kernel":
        monkeypatch.setattr(tb, "_PARTS_IN_KERNEL", 1000)
    return request.param


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_column", [False, True], ids=["tensorwise", "per_column"])
@pytest.mark.parametrize(("r", "c"), [(70, 45), (3, 130)])
def test_transposed_quant_is_the_reference_bit_for_bit(fmt, dtype, per_column, r, c, column_path):
    x = (3 * _gauss(r, c)).to(dtype)
    x[1, 2] = 500.0  # one outlier: its column / the tensor gets a large scale
    for colsum in (False, True):
        q, s, cs = tb.transposed_quant(x, fmt=fmt, per_column=per_column, return_colsum=colsum)
        ref = quantize(x.t(), fmt, Scaling.ROWWISE if per_column else Scaling.TENSORWISE)
        assert q.shape == (c, r) and q.is_contiguous()
        assert torch.equal(_bits(q), _bits(ref.data))
        assert s.shape == ref.scale.shape and torch.equal(s, ref.scale)
        if colsum:
            assert float(sqnr_db(x.float().sum(0), cs)) > 120
        else:
            assert cs.numel() == 0


def test_transposed_quant_zero_nan_inf_columns_and_saturation(column_path):
    x = _gauss(40, 5)
    x[:, 0] = 0.0
    x[7, 1] = float("nan")
    x[9, 2] = float("inf")
    x[3, 3] = 1e30
    q, s, _ = tb.transposed_quant(x, fmt=Fp8Format.E4M3, per_column=True)
    ref = quantize(x.t(), Fp8Format.E4M3, Scaling.ROWWISE)
    torch.testing.assert_close(s, ref.scale, equal_nan=True, rtol=0, atol=0)
    assert s[0, 0] == 1.0 and torch.equal(q[0].float(), torch.zeros(40))
    assert torch.isnan(s[1, 0]) and torch.isnan(s[2, 0])
    assert float(q[3].float().abs().max()) == Fp8Format.E4M3.max  # the outlier lands on max
    finite = torch.isfinite(s[:, 0])
    assert torch.equal(_bits(q[finite]), _bits(ref.data[finite]))
    # A tensor-wise amax below the data's (a stale one) saturates instead of overflowing.
    q2, _, _ = tb.transposed_quant(x[:, 4:], fmt=Fp8Format.E5M2, amax=torch.tensor([0.5]))
    assert torch.isfinite(q2.float()).all()
    assert float(q2.float().abs().max()) == Fp8Format.E5M2.max


def test_fused_quantizer_amax_feeds_the_tensorwise_transpose():
    # The amax the fused LayerNorm / ReLU-backward kernel computes on the way gives exactly
    # the reference's tensor-wise quantization of the transpose: no second pass over h.
    x = (2 * _gauss(37, 50)).to(torch.bfloat16)
    lnw, lnb = (1 + _gauss(50, seed=1)).bfloat16(), _gauss(50, seed=2).bfloat16()
    kw = dict(fmt=Fp8Format.E4M3, layernorm=True, ln_weight=lnw, ln_bias=lnb, return_hp=True, return_amax=True)
    _, _, h, _, _, amax = tk.fused_rowwise_quant(x, **kw)
    *_, ref_amax = tk.rowwise_quant_reference(x, **kw)
    assert amax.shape == (1,) and torch.equal(amax, ref_amax)
    assert float(amax) == float(h.float().abs().max())
    for fmt in FMTS:
        q, s, _ = tb.transposed_quant(h, fmt=fmt, amax=amax)
        ref = quantize(h.t(), fmt, Scaling.TENSORWISE)
        assert torch.equal(_bits(q), _bits(ref.data)) and torch.equal(s, ref.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
def test_layernorm_producer_recomputes_the_forward_output_exactly(dtype, affine):
    # H^T for the grad-weight GEMM from x and the forward kernel's statistics: the same codes
    # as quantizing the H that kernel would have written, so the forward need not write H.
    x = (1 + 2 * _gauss(37, 50)).to(dtype)
    lnw = (1 + _gauss(50, seed=1)).to(dtype) if affine else None
    lnb = _gauss(50, seed=2).to(dtype) if affine else None
    kw = dict(fmt=Fp8Format.E4M3, layernorm=True, ln_weight=lnw, ln_bias=lnb, return_hp=True, return_amax=True)
    _, _, h, mean, rstd, amax = tk.fused_rowwise_quant(x, **kw)
    ln = dict(ln_mean=mean, ln_rstd=rstd, ln_weight=lnw, ln_bias=lnb)
    for fmt in FMTS:
        q, s, _ = tb.transposed_quant(x, fmt=fmt, amax=amax, **ln)
        ref = quantize(h.t(), fmt, Scaling.TENSORWISE)
        assert torch.equal(_bits(q), _bits(ref.data)) and torch.equal(s, ref.scale)
        rq, rs, _ = tb.transposed_quant_reference(x, fmt=fmt, **ln)
        assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)


def test_layernorm_producer_takes_statistics_of_any_layout():
    x = (1 + 2 * _gauss(37, 50)).to(torch.bfloat16)
    kw = dict(fmt=Fp8Format.E4M3, layernorm=True, return_amax=True)
    _, _, _, mean, rstd, amax = tk.fused_rowwise_quant(x, **kw)
    stats = torch.stack([mean, rstd], dim=1)  # (M, 2): each column a strided view
    q, s, _ = tb.transposed_quant(x, amax=amax, ln_mean=stats[:, 0], ln_rstd=stats[:, 1].double())
    rq, rs, _ = tb.transposed_quant(x, amax=amax, ln_mean=mean, ln_rstd=rstd)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)


def test_layernorm_producer_rejects_what_it_does_not_do():
    x = _gauss(8, 16)
    stats = dict(ln_mean=x.mean(1), ln_rstd=torch.ones(8))
    with pytest.raises(ValueError, match="tensor-wise amax"):
        tb.transposed_quant(x, **stats)  # no amax
    with pytest.raises(ValueError, match="tensor-wise amax"):
        tb.transposed_quant(x, amax=torch.ones(1), return_colsum=True, **stats)
    with pytest.raises(ValueError, match="needs ln_mean and ln_rstd"):
        tb.transposed_quant(x, amax=torch.ones(1), ln_mean=x.mean(1))
    with pytest.raises(ValueError, match="8 values"):
        tb.transposed_quant(x, amax=torch.ones(1), ln_mean=torch.zeros(7), ln_rstd=torch.ones(7))
    with pytest.raises(ValueError, match="ln_weight"):
        tb.transposed_quant(x, amax=torch.ones(1), ln_weight=torch.ones(15), **stats)


def test_reference_amax_of_an_empty_input_is_zero():
    *_, amax = tk.fused_rowwise_quant(torch.zeros(0, 8), return_amax=True)
    *_, ref = tk.rowwise_quant_reference(torch.zeros(0, 8), return_amax=True)
    assert torch.equal(amax, torch.zeros(1)) and torch.equal(ref, amax)


def test_fused_quantizer_amax_is_inf_for_non_finite_data():
    x = _gauss(9, 16)
    x[4, 4] = float("nan")
    *_, amax = tk.fused_rowwise_quant(x, return_amax=True)
    assert math.isinf(float(amax))
    *_, ref_amax = tk.rowwise_quant_reference(x, return_amax=True)
    assert math.isinf(float(ref_amax))
    _, s, _ = tb.transposed_quant(x, amax=amax)
    assert torch.isnan(s)  # as the reference's tensor-wise scale of data with a NaN


def test_transposed_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        tb.transposed_quant(_gauss(2, 3, 4))
    with pytest.raises(ValueError, match="per_column"):
        tb.transposed_quant(_gauss(4, 4), per_column=True, amax=torch.ones(1))
    with pytest.raises(ValueError, match="one element"):
        tb.transposed_quant(_gauss(4, 4), amax=torch.ones(2))
    with pytest.raises(ValueError, match="e4m3fnuz"):
        tb.transposed_quant(_gauss(4, 4), fmt=Fp8Format.E4M3FNUZ)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_weight"])
@pytest.mark.parametrize(("m", "k"), [(37, 64), (5, 300)])
def test_layernorm_backward_matches_reference_and_aten(dtype, affine, m, k):
    x = (1 + 2 * _gauss(m, k)).to(dtype)
    w = (1 + 0.1 * _gauss(k, seed=1)).to(dtype) if affine else None
    dy = _gauss(m, k, seed=3).to(dtype)
    xf = x.float()
    mean = xf.mean(1)
    rstd = torch.rsqrt(xf.var(1, unbiased=False) + 1e-5)
    got = tln.layernorm_backward(dy, x, mean, rstd, w)
    ref = tln.layernorm_backward_reference(dy, x, mean, rstd, w)
    threshold = 120 if dtype == torch.float32 else 100
    for name, r, o in zip(["dx", "dw", "db"], ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert float(sqnr_db(r.float(), o.float())) > threshold, name
    # And aten's backward on fp32 data, with its own fp32 statistics.
    if dtype == torch.float32:
        wf = torch.ones(k) if w is None else w
        _, amean, arstd = torch.native_layer_norm(x, [k], wf, None, 1e-5)
        aten = torch.ops.aten.native_layer_norm_backward(dy, x, [k], amean, arstd, wf, None, [True, True, False])
        got2 = tln.layernorm_backward(dy, x, amean.reshape(-1), arstd.reshape(-1), wf, need_db=False)
        assert float(sqnr_db(aten[0], got2[0])) > 120
        assert float(sqnr_db(aten[1], got2[1])) > 120
        assert got2[2].numel() == 0


def test_layernorm_backward_computes_only_what_is_asked():
    x, dy = _gauss(6, 8), _gauss(6, 8, seed=1)
    mean, rstd = x.mean(1), torch.rsqrt(x.var(1, unbiased=False) + 1e-5)
    dx, dw, db = tln.layernorm_backward(dy, x, mean, rstd, torch.ones(8), need_dx=False, need_dw=False)
    assert dx.numel() == 0 and dw.numel() == 0 and db.shape == (8,)
    torch.testing.assert_close(db, dy.sum(0))


def test_layernorm_backward_rejects_bad_input():
    x = _gauss(6, 8)
    stats = (x.mean(1), torch.ones(6))
    with pytest.raises(ValueError, match="2-D"):
        tln.layernorm_backward(_gauss(6, 4), x, *stats, None)
    with pytest.raises(ValueError, match="mean/rstd"):
        tln.layernorm_backward(x, x, torch.zeros(5), torch.ones(5), None)
    with pytest.raises(ValueError, match="weight"):
        tln.layernorm_backward(x, x, *stats, torch.ones(7))


def test_opcheck_block_ops():
    x = _gauss(70, 45)
    torch.library.opcheck(torch.ops.loka.transposed_quant.default, (x, None, "e4m3", True, True, None, None, None, None))
    torch.library.opcheck(torch.ops.loka.transposed_quant.default, (x, x.abs().amax().reshape(1), "e5m2", False, False, None, None, None, None))
    mean, rstd = x.mean(1), torch.rsqrt(x.var(1, unbiased=False) + 1e-5)
    torch.library.opcheck(
        torch.ops.loka.layernorm_backward.default, (_gauss(70, 45, seed=1), x, mean, rstd, torch.ones(45), True, True, True)
    )
