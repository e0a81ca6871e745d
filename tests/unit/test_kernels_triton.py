"""Triton kernels under TRITON_INTERPRET=1 (set by tests/conftest.py) against their
pure-PyTorch references, plus torch.library.opcheck of the custom ops.

The quantizer is compared bit-exactly: its FP8 codes and scales must equal
``formats.quantize`` applied to the kernel's own high-precision output (the producer's
LayerNorm may differ from aten's in the last fp32 bit: tolerance 1e-5 there). The GEMM is
compared with fp32 output at > 120 dB (summation order only) and bf16 output at > 45 dB.
Shapes are tiny and not multiples of the tiles: the interpreter is slow.
"""

import pytest
import torch

from loka_train.kernels import triton_gemm as tg
from loka_train.kernels import triton_kernels as tk
from loka_train.kernels.formats import Fp8Format, Scaling, quantize, sqnr_db

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]


def _gauss(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("layernorm", "affine", "activation"),
    [(False, False, "none"), (False, False, "relu"), (True, True, "none"), (True, False, "relu"), (True, True, "silu")],
    ids=["plain", "relu", "ln_affine", "ln_relu", "ln_affine_silu"],
)
def test_rowwise_quant_matches_reference(fmt, dtype, layernorm, affine, activation):
    x = (3 * _gauss(37, 50)).to(dtype)  # 37 rows: a ragged last row block
    kw = dict(fmt=fmt, layernorm=layernorm, activation=activation, return_hp=True)
    if affine:
        kw.update(ln_weight=(1 + _gauss(50, seed=1)).to(dtype), ln_bias=_gauss(50, seed=2).to(dtype))
    q, s, h, mean, rstd, _ = tk.fused_rowwise_quant(x, **kw)
    rq, rs, rh, rmean, rstd_ref, _ = tk.rowwise_quant_reference(x, **kw)
    assert q.dtype == fmt.dtype and q.shape == x.shape and s.shape == (37, 1)
    assert h.dtype == dtype and h.shape == x.shape
    torch.testing.assert_close(h.float(), rh.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    if layernorm:
        torch.testing.assert_close(mean, rmean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rstd, rstd_ref, atol=1e-6, rtol=1e-5)
    else:
        assert mean.numel() == 0 and rstd.numel() == 0
    # Bit-exact quantization of what the kernel produced.
    own = quantize(h, fmt, Scaling.ROWWISE)
    assert torch.equal(s, own.scale)
    assert torch.equal(q.view(torch.uint8), own.data.view(torch.uint8))
    if not layernorm:  # no LayerNorm: the producer is exact, so is everything
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s, rs)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_rowwise_quant_rounds_like_torch_at_binade_edges(fmt):
    # Values that round up into the next binade, ties, and subnormals: the cases the
    # interpreter's own fp8 cast gets wrong (the kernel pre-rounds there).
    row = torch.tensor([fmt.max, 124.7, 125.0, 31.4, 0.75 * fmt.min_normal, 1.5 * fmt.min_subnormal,
                        0.49 * fmt.min_subnormal, -31.4, 57.0, 59.0, 61.0, 63.0, -0.0, -0.49 * fmt.min_subnormal])
    x = row[None, :].repeat(3, 1) * torch.tensor([[1.0], [-1.0], [0.5]])
    q, s, _, _, _, _ = tk.fused_rowwise_quant(x, fmt=fmt)
    ref = quantize(x, fmt, Scaling.ROWWISE)
    assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))


def test_rowwise_quant_relu_backward_gate():
    dy = _gauss(20, 33)
    y = _gauss(20, 33, seed=1)
    q, s, dz, _, _, _ = tk.fused_rowwise_quant(dy, fmt=Fp8Format.E5M2, gate=y, return_hp=True)
    torch.testing.assert_close(dz, torch.where(y > 0, dy, torch.zeros_like(dy)), atol=0, rtol=0)
    rq, rs, _, _, _, _ = tk.rowwise_quant_reference(dy, fmt=Fp8Format.E5M2, gate=y)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_rowwise_quant_zeros_nan_and_saturation():
    x = _gauss(4, 16)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 5] = 1e30
    q, s, _, _, _, _ = tk.fused_rowwise_quant(x, fmt=Fp8Format.E5M2)
    assert s[0, 0] == 1.0 and torch.equal(q[0].float(), torch.zeros(16))
    assert torch.isnan(s[1, 0])
    assert torch.isfinite(s[[0, 2, 3]]).all()
    assert torch.isfinite(q[2].float()).all() and float(q[2].float().abs().max()) == Fp8Format.E5M2.max


def test_rowwise_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        tk.fused_rowwise_quant(_gauss(2, 3, 4))
    with pytest.raises(ValueError, match="activation"):
        tk.fused_rowwise_quant(_gauss(2, 4), activation="gelu")
    with pytest.raises(ValueError, match="e4m3fnuz"):
        tk.fused_rowwise_quant(_gauss(2, 4), fmt=Fp8Format.E4M3FNUZ)
    with pytest.raises(ValueError, match="layernorm"):
        tk.fused_rowwise_quant(_gauss(2, 4), ln_weight=torch.ones(4))


def _gemm_operands(fmt_a, fmt_b, m=45, k=70, n=38, tensorwise=False):
    scaling = Scaling.TENSORWISE if tensorwise else Scaling.ROWWISE
    a = quantize(_gauss(m, k) * torch.linspace(0.1, 5, m)[:, None], fmt_a, scaling)
    b = quantize(_gauss(n, k, seed=1), fmt_b, scaling)
    return a, b


# The interpreter's sigmoid overflows exp() for large negative inputs (harmless: 1/inf = 0).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    ("fmt_a", "fmt_b"),
    [(Fp8Format.E4M3, Fp8Format.E4M3), (Fp8Format.E5M2, Fp8Format.E4M3)],
    ids=["e4m3xe4m3", "e5m2xe4m3"],
)
@pytest.mark.parametrize("activation", tk.ACTIVATIONS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_gemm_matches_reference(fmt_a, fmt_b, activation, out_dtype):
    a, b = _gemm_operands(fmt_a, fmt_b)
    bias = _gauss(38, seed=2)
    out, pre = tg.fp8_gemm(a.data, b.data, a.scale, b.scale, bias_N=bias, activation=activation,
                           out_dtype=out_dtype, return_preact=True)
    ref, ref_pre = tg.fp8_gemm_reference(a.data, b.data, a.scale, b.scale, bias_N=bias,
                                         activation=activation, out_dtype=out_dtype, return_preact=True)
    assert out.dtype == out_dtype and out.shape == (45, 38)
    threshold = 120.0 if out_dtype == torch.float32 else 45.0
    assert float(sqnr_db(ref, out)) > threshold
    assert float(sqnr_db(ref_pre, pre)) > threshold
    if activation == "relu":
        assert (out >= 0).all()


def test_fp8_gemm_tensorwise_scales_and_no_bias():
    a, b = _gemm_operands(Fp8Format.E4M3, Fp8Format.E4M3, tensorwise=True)
    out, pre = tg.fp8_gemm(a.data, b.data, a.scale, b.scale, out_dtype=torch.float32)
    assert pre.numel() == 0
    ref, _ = tg.fp8_gemm_reference(a.data, b.data, a.scale, b.scale, out_dtype=torch.float32)
    assert float(sqnr_db(ref, out)) > 120


def test_fp8_gemm_rejects_bad_input():
    a, b = _gemm_operands(Fp8Format.E4M3, Fp8Format.E4M3, m=8, k=16, n=8)
    with pytest.raises(ValueError, match="FP8"):
        tg.fp8_gemm(a.data.float(), b.data, a.scale, b.scale)
    with pytest.raises(ValueError, match="b_scale"):
        tg.fp8_gemm(a.data, b.data, a.scale, torch.ones(3))
    with pytest.raises(ValueError, match="bias"):
        tg.fp8_gemm(a.data, b.data, a.scale, b.scale, bias_N=torch.ones(3))


def test_opcheck_rowwise_quant():
    x = _gauss(8, 32)
    args = (x, None, torch.ones(32), torch.zeros(32), 1e-5, True, "relu", "e4m3", True, True)
    torch.library.opcheck(torch.ops.loka.rowwise_quant.default, args)
    gate = _gauss(8, 32, seed=1)
    args = (x, gate, None, None, 1e-5, False, "none", "e5m2", False, False)
    torch.library.opcheck(torch.ops.loka.rowwise_quant.default, args)


# opcheck's test_schema multiplies the op's inputs, which CPU torch cannot do for FP8 tensors
# ("mul_cpu_reduced_float" not implemented): the GEMM (FP8 inputs) runs the other checks here;
# tests/gpu runs all of them on CUDA.
_CPU_FP8_INPUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_fp8_gemm():
    a, b = _gemm_operands(Fp8Format.E4M3, Fp8Format.E4M3, m=16, k=32, n=16)
    op = torch.ops.loka.fp8_gemm.default
    args = (a.data, b.data, a.scale, b.scale, torch.ones(16), "relu", torch.float32, False, True, True)
    torch.library.opcheck(op, args, test_utils=_CPU_FP8_INPUT_CHECKS)
    args = (a.data, b.data, a.scale, b.scale, None, "none", torch.bfloat16, True, False, False)
    torch.library.opcheck(op, args, test_utils=_CPU_FP8_INPUT_CHECKS)
