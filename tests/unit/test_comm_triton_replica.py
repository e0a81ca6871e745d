"""The fused FP8 and BF16 replica sync kernels (loka_train.comm.triton_replica) under
TRITON_INTERPRET=1 against the reference path they replace, bit for bit: the change
``(w - anchor) + residual`` encoded as the reference encodes it (FP8 row-wise, zero-padded to
whole rows; BF16 by the codec's clamped cast), the new residual ``d - decode(payload)``, and the
anchor and tensor moved by the replicas' mean (summed in replica order, scaled by 1/R).

Shape legend: N values, R replicas.
"""

from __future__ import annotations

import pytest
import torch

from loka_train.comm import CodecImpl, CommPrecision, WireFormat
from loka_train.comm import triton_replica as tr
from loka_train.kernels.formats import Fp8Format

pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning",
)


def _ref(row_dim: int, fmt: Fp8Format) -> WireFormat:
    return WireFormat(precision=CommPrecision.FP8, row_dim=row_dim, fp8_format=fmt, impl=CodecImpl.REFERENCE)


def _values(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes over 8 decades, some exact zeros: subnormal FP8 codes and all-zero rows.
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=gen)] * scale
    x[: min(n, 8)] = 0.0
    return x


def _reference_encode(w: torch.Tensor, anchor: torch.Tensor, residual: torch.Tensor | None,
                      ref: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    delta = w.float().reshape(-1) - anchor
    if residual is not None:
        delta = delta + residual
    n = delta.numel()
    payload = ref.encode_bytes(torch.nn.functional.pad(delta, (0, (-n) % ref.row_dim)))
    return payload, delta - ref.decode_bytes(payload)[:n]


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "row_dim"), [(96, 32), (100, 32), (45, 6)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_delta_encode_is_the_reference_encoding_of_the_change(
    fmt: Fp8Format, dtype: torch.dtype, n: int, row_dim: int, with_residual: bool
) -> None:
    w = _values(n, 1).to(dtype)
    anchor = w.float() - 1e-3 * _values(n, 2)  # the change since the last sync: small
    residual = 1e-5 * _values(n, 3) if with_residual else None
    payload, new_residual = tr.delta_encode(w, anchor, residual, row_dim=row_dim, fmt=fmt, feedback=True)
    ref_payload, ref_residual = _reference_encode(w, anchor, residual, _ref(row_dim, fmt))
    assert payload.dtype == torch.uint8 and torch.equal(payload, ref_payload)
    assert new_residual is not None and torch.equal(new_residual, ref_residual)
    # Without feedback: the same payload, no residual.
    again, none = tr.delta_encode(w, anchor, residual, row_dim=row_dim, fmt=fmt, feedback=False)
    assert none is None and torch.equal(again, ref_payload)


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_apply_moves_anchor_and_tensor_by_the_replicas_mean(num_replicas: int, dtype: torch.dtype) -> None:
    n, row_dim, fmt = 100, 32, Fp8Format.E4M3
    ref = _ref(row_dim, fmt)
    anchor = _values(n, 7)
    payloads = [tr.delta_encode(anchor + 1e-2 * _values(n, 10 + r), anchor, None, row_dim=row_dim, fmt=fmt,
                                feedback=False)[0] for r in range(num_replicas)]
    gathered = torch.cat(payloads)
    decoded = ref.decode_bytes(gathered).view(num_replicas, -1)[:, :n]
    total = decoded[0]
    for r in range(1, num_replicas):
        total = total + decoded[r]
    expected = anchor + total * (1.0 / num_replicas)

    w = torch.zeros(n, dtype=dtype)
    got_anchor = anchor.clone()
    tr.mean_apply(gathered, got_anchor, w, num_replicas=num_replicas, row_dim=row_dim, fmt=fmt)
    assert torch.equal(got_anchor, expected)
    assert torch.equal(w, expected.to(dtype))  # a bf16 tensor gets the anchor as copy_ rounds it
    assert not torch.equal(expected, anchor)  # the mean moved it


@pytest.mark.parametrize("layout", ["transposed_fp32", "fp16"])
def test_mean_apply_reaches_a_tensor_the_kernel_cannot_write(layout: str) -> None:
    """A non-contiguous or non-fp32 tensor gets the new anchor through ``copy_`` (its own storage)."""
    n, row_dim, fmt = 64, 32, Fp8Format.E4M3
    anchor = _values(n, 4)
    payload, _ = tr.delta_encode(anchor + 1e-2 * _values(n, 5), anchor, None, row_dim=row_dim, fmt=fmt, feedback=False)
    gathered = torch.cat([payload, payload])
    w = torch.zeros(8, 8).t() if layout == "transposed_fp32" else torch.zeros(n, dtype=torch.float16)
    tr.mean_apply(gathered, anchor, w, num_replicas=2, row_dim=row_dim, fmt=fmt)
    assert torch.equal(w, anchor.view_as(w).to(w.dtype)) and w.abs().sum() > 0


def test_mean_apply_refuses_a_payload_or_tensor_of_another_size() -> None:
    anchor = torch.zeros(64)
    with pytest.raises(ValueError, match="expected 2 payloads"):
        tr.mean_apply(torch.zeros(10, dtype=torch.uint8), anchor, anchor.clone(), num_replicas=2, row_dim=32,
                      fmt=Fp8Format.E4M3)
    payload, _ = tr.delta_encode(anchor, anchor, None, row_dim=32, fmt=Fp8Format.E4M3, feedback=False)
    with pytest.raises(ValueError, match="holds 32 values"):
        tr.mean_apply(torch.cat([payload, payload]), anchor, torch.zeros(32), num_replicas=2, row_dim=32,
                      fmt=Fp8Format.E4M3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_delta_encode_is_the_codec_cast_of_the_change(dtype: torch.dtype, with_residual: bool) -> None:
    n = 300
    ref = WireFormat(precision=CommPrecision.BF16, impl=CodecImpl.REFERENCE)
    w = _values(n, 21).to(dtype)
    anchor = w.float() - 1e-3 * _values(n, 22)
    # A change beyond bf16's range saturates, as the codec casts (a plain cast would give inf);
    # a NaN change stays NaN.
    anchor[5] = -torch.finfo(torch.float32).max
    anchor[6] = float("nan")
    residual = 1e-6 * _values(n, 23) if with_residual else None
    payload, new_residual = tr.delta_encode_bf16(w, anchor, residual, feedback=True)
    delta = w.float() - anchor
    if residual is not None:
        delta = delta + residual
    ref_payload = ref.encode_native(delta)
    assert payload.dtype == torch.bfloat16 and torch.equal(payload.view(torch.int16), ref_payload.view(torch.int16))
    assert float(payload[5]) == float(torch.finfo(torch.bfloat16).max) and torch.isnan(payload[6])
    expected = delta - ref_payload.float()
    assert new_residual is not None and torch.equal(new_residual.nan_to_num(), expected.nan_to_num())
    assert torch.equal(new_residual.isnan(), expected.isnan())


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_bf16_mean_apply_moves_anchor_and_tensor_by_the_replicas_mean(num_replicas: int) -> None:
    n = 300
    anchor = _values(n, 30)
    payloads = [tr.delta_encode_bf16(anchor + 1e-2 * _values(n, 31 + r), anchor, None, feedback=False)[0]
                for r in range(num_replicas)]
    total = payloads[0].float()
    for p in payloads[1:]:
        total = total + p.float()
    expected = anchor + total * (1.0 / num_replicas)
    gathered = torch.cat([p.view(torch.uint8) for p in payloads])  # what the all-gather returns
    for w in (torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(2, n // 2).t()):
        got = anchor.clone()
        tr.mean_apply_bf16(gathered, got, w, num_replicas=num_replicas)
        # fp32: written by the kernel; bf16 or non-contiguous: the anchor, as copy_ rounds it.
        assert torch.equal(got, expected) and torch.equal(w, expected.view_as(w).to(w.dtype))
    assert not torch.equal(expected, anchor)
