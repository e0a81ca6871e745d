"""Wire formats: round-trip SQNR per precision, payload sizes and layouts, edge cases.

Shape legend: N values, R rows, C values per row (row_dim).
"""

from __future__ import annotations

import pytest
import torch

from loka_train.comm import CodecImpl, CommPrecision, WireFormat
from loka_train.kernels.formats import Fp8Format, sqnr_db

# Round-trip SQNR floors (dB) on N(0, 1) data, row_dim=32. Measured on this data: FP16 73.7,
# BF16 55.6, INT8 46.8, FP8 e4m3 32.4, FP8 e5m2 26.4; the floors leave 3-4 dB of margin. An
# ideal b-bit mantissa gives about 6.02 * (b + 1) dB, minus row-wise scaling's crest factor.
SQNR_FLOOR_DB = {
    (CommPrecision.FP16, Fp8Format.E4M3): 70.0,
    (CommPrecision.BF16, Fp8Format.E4M3): 52.0,
    (CommPrecision.INT8, Fp8Format.E4M3): 43.0,
    (CommPrecision.FP8, Fp8Format.E4M3): 29.0,
    (CommPrecision.FP8, Fp8Format.E5M2): 23.0,
}
# ... and ceilings: a format that silently became a better one (e.g. FP8 sent as FP32) fails.
SQNR_CEILING_DB = {
    (CommPrecision.FP16, Fp8Format.E4M3): 80.0,
    (CommPrecision.BF16, Fp8Format.E4M3): 60.0,
    (CommPrecision.INT8, Fp8Format.E4M3): 50.0,
    (CommPrecision.FP8, Fp8Format.E4M3): 36.0,
    (CommPrecision.FP8, Fp8Format.E5M2): 30.0,
}


def _gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("precision", "fp8_format"), list(SQNR_FLOOR_DB))
def test_roundtrip_sqnr_within_band(precision: CommPrecision, fp8_format: Fp8Format) -> None:
    fmt = WireFormat(precision=precision, row_dim=32, fp8_format=fp8_format)
    x = _gaussian(512, 64)
    payload = fmt.encode_bytes(x)
    y = fmt.decode_bytes(payload).view_as(x)
    assert payload.dtype == torch.uint8
    assert y.dtype == torch.float32
    db = sqnr_db(x, y)
    assert SQNR_FLOOR_DB[(precision, fp8_format)] <= db <= SQNR_CEILING_DB[(precision, fp8_format)]
    # roundtrip() is what the SQNR measurement uses: it must be exactly the wire result.
    torch.testing.assert_close(fmt.roundtrip(x), y, rtol=0, atol=0)


def test_fp32_bytes_are_exact_and_zero_copy_sized() -> None:
    fmt = WireFormat(precision=CommPrecision.FP32)
    x = _gaussian(7, 5)
    payload = fmt.encode_bytes(x)
    assert payload.numel() == fmt.encoded_bytes(35) == 35 * 4
    torch.testing.assert_close(fmt.decode_bytes(payload).view_as(x), x, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("precision", "row_dim", "bytes_per_row"),
    [
        (CommPrecision.FP8, 32, 36),  # 32 fp8 + one fp32 inverse scale
        (CommPrecision.FP8, 6, 12),  # 6 fp8, aligned to 8, + 4
        (CommPrecision.INT8, 32, 40),  # 32 uint8 + fp32 scale + fp32 offset (FBGEMM's size)
        (CommPrecision.FP16, 32, 64),
        (CommPrecision.BF16, 32, 64),
    ],
)
def test_encoded_bytes_match_payload(
    precision: CommPrecision, row_dim: int, bytes_per_row: int
) -> None:
    fmt = WireFormat(precision=precision, row_dim=row_dim)
    x = _gaussian(10, row_dim)
    assert fmt.encoded_bytes(x.numel()) == 10 * bytes_per_row
    assert fmt.encode_bytes(x).numel() == 10 * bytes_per_row


def test_int8_matches_fbgemm_cpu_op() -> None:
    """FBGEMM's fused 8-bit row-wise op runs on CPU: same layout, same numbers."""
    import fbgemm_gpu  # noqa: F401

    x_RC = _gaussian(256, 32, seed=3)
    ours = WireFormat(precision=CommPrecision.INT8, row_dim=32).encode_bytes(x_RC).view(256, 40)
    theirs = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x_RC)
    assert theirs.shape == ours.shape
    # Scale and offset bytes identical; codes differ by at most one step (rounding of
    # x * inv_scale at .5 boundaries).
    assert torch.equal(ours[:, 32:], theirs[:, 32:])
    assert (ours[:, :32].int() - theirs[:, :32].int()).abs().max() <= 1
    fbgemm_fmt = WireFormat(precision=CommPrecision.INT8, row_dim=32, impl=CodecImpl.FBGEMM)
    ours_decoded = WireFormat(precision=CommPrecision.INT8, row_dim=32).decode_bytes(theirs)
    torch.testing.assert_close(ours_decoded, fbgemm_fmt.decode_bytes(theirs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fp8_format", list(Fp8Format))
def test_fp8_edge_rows(fp8_format: Fp8Format) -> None:
    fmt = WireFormat(precision=CommPrecision.FP8, row_dim=4, fp8_format=fp8_format)
    x_RC = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # all-zero row: finite scale, exact zeros
            [1e30, -1e30, 5e29, 0.0],  # huge values: scaled, no overflow to inf
            [1e-30, -2e-30, 0.0, 4e-30],  # tiny values: scaled up, not flushed to zero
            [3.0, 3.0, 3.0, 3.0],  # constant row: exact
        ]
    )
    y_RC = fmt.decode_bytes(fmt.encode_bytes(x_RC)).view_as(x_RC)
    assert torch.isfinite(y_RC).all()
    assert torch.equal(y_RC[0], torch.zeros(4))
    torch.testing.assert_close(y_RC[1:], x_RC[1:], rtol=0.07, atol=0)


def test_rowwise_payload_concatenation_decodes_per_sender() -> None:
    """An all-to-all receiver decodes the concatenation of slices encoded by different
    senders (different scales): rows must never straddle a slice."""
    fmt = WireFormat(precision=CommPrecision.FP8, row_dim=8)
    from_rank0, from_rank1 = _gaussian(4, 16, seed=1), 1000 * _gaussian(4, 8, seed=2)
    received = torch.cat([fmt.encode_bytes(from_rank0), fmt.encode_bytes(from_rank1)])
    decoded = fmt.decode_bytes(received)
    assert sqnr_db(from_rank0.flatten(), decoded[:64]) > 25
    assert sqnr_db(from_rank1.flatten(), decoded[64:]) > 25


def test_row_dim_mismatch_raises_with_sizes() -> None:
    fmt = WireFormat(precision=CommPrecision.INT8, row_dim=32)
    with pytest.raises(ValueError, match="48 values are not a multiple of comm.row_dim=32"):
        fmt.encoded_bytes(48)
    with pytest.raises(ValueError, match="not a multiple"):
        fmt.encode_bytes(torch.zeros(48))
    with pytest.raises(ValueError, match="not a whole number of 40-byte rows"):
        fmt.decode_bytes(torch.zeros(41, dtype=torch.uint8))


def test_native_payload_clamps_instead_of_overflowing() -> None:
    fmt = WireFormat(precision=CommPrecision.FP16)
    x = torch.tensor([1e6, -1e6, 1.5])
    payload = fmt.encode_native(x)
    assert payload.dtype == torch.float16
    assert torch.equal(WireFormat.decode_native(payload), torch.tensor([65504.0, -65504.0, 1.5]))
