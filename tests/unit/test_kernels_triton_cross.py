"""``triton_cross.cross_epilogue_gemm`` (under TRITON_INTERPRET=1): the cross layer's ``z`` is the
FP8 GEMM's (bias added in fp32, rounded once), ``x_{l+1}`` is ``x_l + x0 * z`` of that ``z`` and
its copy that value in bf16; ragged tiles; the operands it refuses."""

import pytest
import torch

from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.kernels.triton_cross import cross_epilogue_gemm, cross_epilogue_reference


def _operands(m: int, r: int, n: int, *, bias: bool, exact: bool):
    g = torch.Generator().manual_seed(m + n)
    u = quantize(torch.randn(m, r, generator=g), Fp8Format.E4M3, Scaling.TENSORWISE)
    w = quantize(torch.randn(n, r, generator=g) / 8, Fp8Format.E4M3, Scaling.TENSORWISE)
    b = (torch.randn(n, generator=g)).to(torch.bfloat16) if bias else None
    if exact:
        # x0 a power of two: x0 * z is exact, so x_l + x0 * z rounds once with or without an FMA.
        x0 = 2.0 ** torch.randint(-3, 4, (m, n), generator=g).float()
    else:
        x0 = torch.randn(m, n, generator=g)
    return u, w, b, x0, torch.randn(m, n, generator=g)


@pytest.mark.parametrize("epi_tma", [0, 1], ids=["plain", "tma"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(70, 64, 80), (32, 32, 48)])
def test_the_epilogue_gives_the_unfused_layer(shape, bias, epi_tma):
    u, w, b, x0, xl = _operands(*shape, bias=bias, exact=True)
    z, out, copy = cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0, xl, config=(32, 32, 32, 4, 4, 2, epi_tma))
    z_ref, out_ref, copy_ref = cross_epilogue_reference(u.data, u.scale, w.data, w.scale, b, x0, xl)
    assert z.dtype == torch.bfloat16 and out.dtype == torch.float32 and copy is not None
    assert torch.equal(z, z_ref)
    assert torch.equal(out, out_ref)
    assert torch.equal(copy, copy_ref)


def test_on_any_data_the_step_is_the_one_of_its_own_z():
    u, w, b, x0, xl = _operands(70, 64, 80, bias=True, exact=False)
    z, out, copy = cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0, xl)
    z_ref, out_ref, _ = cross_epilogue_reference(u.data, u.scale, w.data, w.scale, b, x0, xl)
    assert torch.equal(z, z_ref)
    # One rounding (GPU FMA) or two (the interpreter): within an ulp of the reference's.
    torch.testing.assert_close(out, out_ref, rtol=2**-23, atol=2**-22)
    assert copy is not None and torch.equal(copy, out.to(torch.bfloat16))
    _, _, none = cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0, xl, write_copy=False)
    assert none is None


def test_the_first_layer_reads_x0_as_its_x_l():
    u, w, b, x0, _ = _operands(70, 64, 80, bias=True, exact=True)
    got = cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0, None, config=(32, 32, 32, 4, 4, 2, 1))
    want = cross_epilogue_reference(u.data, u.scale, w.data, w.scale, b, x0, x0)
    for a, c in zip(got, want, strict=True):
        assert a is not None and torch.equal(a, c)
    # Fast accumulation asks the GPU for unpromoted FP8 products; the interpreter's dot is exact.
    fast = cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0, None, fast_accum=True)
    assert torch.equal(fast[0], want[0])


def test_bad_operands_are_refused():
    u, w, b, x0, xl = _operands(32, 32, 48, bias=True, exact=False)
    with pytest.raises(ValueError, match=r"needs a \(M, R\)"):
        cross_epilogue_gemm(u.data[0], u.scale, w.data, w.scale, b, x0, xl)
    with pytest.raises(ValueError, match="fp32 x0 and x_l"):
        cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0.to(torch.bfloat16), xl)
    with pytest.raises(ValueError, match="shape"):
        cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b, x0[:, :40].contiguous(), xl)
    with pytest.raises(ValueError, match="bias of shape"):
        cross_epilogue_gemm(u.data, u.scale, w.data, w.scale, b[:10], x0, xl)
    with pytest.raises(ValueError, match="width N a multiple of 8"):
        cross_epilogue_gemm(u.data, u.scale, w.data[:44].contiguous(), w.scale, b[:44], x0[:, :44].contiguous(),
                            xl[:, :44].contiguous())
    with pytest.raises(ValueError, match="multiple of 16"):
        cross_epilogue_gemm(u.data[:, :24].contiguous(), u.scale, w.data[:, :24].contiguous(), w.scale, b, x0, xl)
