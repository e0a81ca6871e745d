"""The fused Triton codec (loka_train.comm.triton_codec) under TRITON_INTERPRET=1 against the
pure-PyTorch reference encoder/decoder of `WireFormat` (the oracle), bit for bit.

Encode: the whole payload is compared byte for byte (FP8 codes, zero padding, fp32 inverse
scales, NaN codes included). Decode: identical fp32 bits wherever the reference is not NaN,
NaN exactly where it is (NaN payload bits are not part of the format). The rows cover what
the reference treats specially: all-zero and -0.0 rows, subnormal rows (amax's reciprocal
overflows: the inverse scale is clamped to the fp32 max), normal-but-tiny and huge rows, rows
holding NaN or +-inf, row_dim not a multiple of 4 (padded rows), and random rows whose values
spread over 12 decades (FP8 subnormal codes). Shapes are tiny: the interpreter is slow.

Shape legend: R rows, C values per row (row_dim), P payload bytes per row.
"""

from __future__ import annotations

import pytest
import torch

from loka_train.comm import CodecImpl, CommPrecision, WireFormat
from loka_train.comm import triton_codec as tc
from loka_train.kernels.formats import Fp8Format

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]
ROW_DIMS = [4, 6, 32, 128]

pytestmark = pytest.mark.filterwarnings(
    # The interpreter evaluates with numpy, which warns where IEEE arithmetic gives inf/NaN
    # on purpose (1 / subnormal amax, inf * 0).
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning",
)


def _edge_rows(row_dim: int, seed: int = 0) -> torch.Tensor:
    """Special rows followed by random rows (values over 12 decades within a row)."""
    gen = torch.Generator().manual_seed(seed)
    nan, inf = float("nan"), float("inf")

    def row(*values: float) -> torch.Tensor:
        r = torch.zeros(row_dim)
        r[: len(values)] = torch.tensor(values[:row_dim])
        return r

    special = [
        torch.zeros(row_dim),  # all-zero: inverse scale 1
        torch.full((row_dim,), -0.0),  # -0.0 codes stay 0x80
        row(1e-40, -3e-41, 0.0, 7e-42),  # subnormal amax: inverse scale clamped to fp32 max
        row(1e-38, -2e-38, 5e-39, 3e-38),  # tiny normal values
        row(3.4e38, -3.0e38, 1e30, -1.0),  # huge values, no overflow
        row(1.0, nan, -2.0, 0.5),  # NaN: amax NaN, inverse scale 1, NaN code 0x7F
        row(-1.0, inf, 3.0, -0.0),  # +inf: inverse scale 0, inf * 0 = NaN, -1 * 0 = -0.0
        row(-inf, 2.0, nan, 1.0),  # NaN and -inf together
        row(448.0, 124.0, 125.0, -31.4),  # near binade edges and ties (e4m3 grid)
        row(57344.0, 61440.0, -1.0, 3.0),  # e5m2's max and the value that rounds past it
        row(-5.0),  # one value, the rest zero
    ]
    scales = 10.0 ** torch.empty(40, row_dim).uniform_(-12, 0, generator=gen)
    signs = torch.randn(40, row_dim, generator=gen).sign()
    row_scales = 10.0 ** torch.empty(40, 1).uniform_(-30, 30, generator=gen)
    return torch.cat([torch.stack(special), signs * scales * row_scales])


def _reference(row_dim: int, fmt: Fp8Format) -> WireFormat:
    return WireFormat(
        precision=CommPrecision.FP8, row_dim=row_dim, fp8_format=fmt, impl=CodecImpl.REFERENCE
    )


def _assert_same_values(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)
    bits = {4: torch.int32, 2: torch.int16}[ref.element_size()]
    assert torch.equal(ours[~nan].view(bits), ref[~nan].view(bits))


@pytest.mark.parametrize("row_dim", ROW_DIMS)
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_fp8_encode_is_bit_identical_to_reference(fmt: Fp8Format, row_dim: int) -> None:
    x_RC = _edge_rows(row_dim)
    ours_RP = tc.fp8_encode(x_RC, row_dim=row_dim, fmt=fmt)
    ref_P = _reference(row_dim, fmt).encode_bytes(x_RC)
    assert ours_RP.dtype == torch.uint8 and ours_RP.shape == (x_RC.shape[0], (row_dim + 3) // 4 * 4 + 4)
    mismatch = (ours_RP.reshape(-1) != ref_P).nonzero().flatten()
    assert mismatch.numel() == 0, f"bytes differ at {mismatch[:8].tolist()} (row_bytes {ours_RP.shape[1]})"


@pytest.mark.parametrize("row_dim", ROW_DIMS)
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_fp8_decode_is_bit_identical_to_reference(fmt: Fp8Format, row_dim: int) -> None:
    ref = _reference(row_dim, fmt)
    payload_P = ref.encode_bytes(_edge_rows(row_dim, seed=1))
    _assert_same_values(tc.fp8_decode(payload_P, row_dim=row_dim, fmt=fmt), ref.decode_bytes(payload_P))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_fp8_decode_of_every_code_and_odd_scales(fmt: Fp8Format) -> None:
    """All 256 codes (NaN and inf codes too) under inverse scales 1, 0, inf, NaN, subnormal,
    huge and random: decoding is not limited to what the encoder writes."""
    row_dim = 8
    codes_RC = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(32, row_dim)
    codes_RC = codes_RC.repeat(3, 1)
    inv = torch.cat([
        torch.tensor([1.0, 0.0, float("inf"), float("nan"), 1e-40, 3.4e38, -2.0, 0.1]),
        torch.empty(88).uniform_(-20, 20, generator=torch.Generator().manual_seed(2)).exp(),
    ])
    payload_P = torch.cat([codes_RC, inv.view(torch.uint8).reshape(96, 4)], dim=1).reshape(-1)
    ref = _reference(row_dim, fmt)
    _assert_same_values(tc.fp8_decode(payload_P, row_dim=row_dim, fmt=fmt), ref.decode_bytes(payload_P))


def test_fp8_decode_at_an_odd_byte_offset() -> None:
    """A payload inside a larger buffer, at an offset that is not a multiple of 4 (the scale
    is read byte by byte), made of two senders' slices with different scales."""
    ref = _reference(6, Fp8Format.E4M3)
    received = torch.cat([ref.encode_bytes(_edge_rows(6, seed=3)), ref.encode_bytes(1e6 * torch.randn(5, 6))])
    buffer = torch.cat([torch.tensor([7], dtype=torch.uint8), received])
    payload = buffer[1:]
    assert payload.data_ptr() % 4 != 0
    _assert_same_values(tc.fp8_decode(payload, row_dim=6, fmt=Fp8Format.E4M3), ref.decode_bytes(received))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fp8_encode_of_other_input_dtypes_and_strides(dtype: torch.dtype) -> None:
    x = _edge_rows(32, seed=4)[11:].to(dtype)  # finite rows (fp16 cannot hold the huge ones)
    strided = torch.cat([x, x], dim=1)[:, ::2]  # not contiguous
    ref = _reference(32, Fp8Format.E5M2)
    for t in (x, strided):
        ours = tc.fp8_encode(t, row_dim=32, fmt=Fp8Format.E5M2).reshape(-1)
        assert torch.equal(ours, ref.encode_bytes(t))


def _cast_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    bulk = torch.randn(3001, generator=gen) * 10.0 ** torch.empty(3001).uniform_(-45, 39, generator=gen)
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])
    special = torch.tensor([
        float("nan"), -float("nan"), float("inf"), -float("inf"), 3.39e38, -3.4e38, 65519.0,
        65520.0, -1e6, -0.0, 0.0, 1e-45, -6e-8, 2.9e-8, 1e-39,
    ])
    return torch.cat([special, ties, -ties, bulk])


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_clamped_cast_is_bit_identical_to_reference(dtype: torch.dtype, src: torch.dtype) -> None:
    x = _cast_inputs().to(src)  # bf16 inputs hold subnormals the interpreter's upcast gets wrong
    limit = torch.finfo(dtype).max
    ref = x.float().clamp(-limit, limit).to(dtype)
    ours = tc.clamped_cast(x.reshape(2, -1), dtype)
    assert ours.shape == (2, x.numel() // 2) and ours.dtype == dtype
    assert torch.equal(ours.reshape(-1).view(torch.int16), ref.view(torch.int16))  # NaN bits too


@pytest.mark.parametrize(
    "precision",
    [CommPrecision.FP8, CommPrecision.BF16, CommPrecision.FP16, CommPrecision.INT8, CommPrecision.FP32],
    ids=lambda p: p.value,
)
def test_wire_format_triton_equals_reference(precision: CommPrecision) -> None:
    x = _edge_rows(8, seed=6)[11:].reshape(4, -1)
    ours = WireFormat(precision=precision, row_dim=8, impl=CodecImpl.TRITON)
    ref = WireFormat(precision=precision, row_dim=8, impl=CodecImpl.REFERENCE)
    assert ours.impl_for(x.device) is CodecImpl.TRITON
    payload = ours.encode_bytes(x)
    assert torch.equal(payload, ref.encode_bytes(x))
    _assert_same_values(ours.decode_bytes(payload), ref.decode_bytes(payload))
    _assert_same_values(ours.roundtrip(x), ref.roundtrip(x))
    if not precision.is_rowwise:
        _assert_same_values(ours.encode_native(x), ref.encode_native(x))


def test_empty_and_malformed_inputs() -> None:
    fmt = Fp8Format.E4M3
    assert tc.fp8_encode(torch.zeros(0), row_dim=8, fmt=fmt).shape == (0, 12)
    assert tc.fp8_decode(torch.zeros(0, dtype=torch.uint8), row_dim=8, fmt=fmt).shape == (0,)
    assert tc.clamped_cast(torch.zeros(0, 3), torch.bfloat16).shape == (0, 3)
    with pytest.raises(ValueError, match="not a multiple of row_dim=8"):
        tc.fp8_encode(torch.zeros(12), row_dim=8, fmt=fmt)
    with pytest.raises(ValueError, match="whole number of 12-byte rows"):
        tc.fp8_decode(torch.zeros(13, dtype=torch.uint8), row_dim=8, fmt=fmt)
    with pytest.raises(ValueError, match="payload is uint8"):
        tc.fp8_decode(torch.zeros(12), row_dim=8, fmt=fmt)
    with pytest.raises(ValueError, match="e4m3 and e5m2"):
        tc.fp8_encode(torch.zeros(8), row_dim=8, fmt=Fp8Format.E4M3FNUZ)
    with pytest.raises(ValueError, match="targets"):
        tc.clamped_cast(torch.zeros(8), torch.float32)
    with pytest.raises(RuntimeError, match=f"row_dim={tc.MAX_ROW_DIM + 1}"):
        tc.fp8_encode(torch.zeros(tc.MAX_ROW_DIM + 1), row_dim=tc.MAX_ROW_DIM + 1, fmt=fmt)


def test_custom_ops_pass_opcheck() -> None:
    x = _edge_rows(8, seed=7)[11:15]
    payload = tc.fp8_encode(x, row_dim=8, fmt=Fp8Format.E4M3).reshape(-1)
    torch.library.opcheck(torch.ops.loka.comm_fp8_encode.default, (x, 8, "e4m3"))
    torch.library.opcheck(torch.ops.loka.comm_fp8_decode.default, (payload, 8, "e4m3"))
    torch.library.opcheck(torch.ops.loka.comm_clamped_cast.default, (x, torch.bfloat16))
