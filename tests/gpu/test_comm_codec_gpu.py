"""GPU checks of the fused Triton comm codec (loka_train.comm.triton_codec).

* FP8 encode: the payload (codes, padding, inverse scales) is byte-identical to the PyTorch
  reference run on the same GPU, for e4m3 and e5m2, row_dim 6 / 32 / 64 / 128, on special rows
  (zero, -0.0, subnormal, tiny, huge, NaN, inf) and on random rows at a job's shape
  (batch 8192 x 26 tables, dim 128);
* FP8 decode: fp32 bits identical to the reference's wherever it is not NaN, NaN where it is;
* BF16 / FP16 encode (one kernel): bits identical to ``x.float().clamp(-max, max).to(dtype)``
  on the GPU, NaN included (both use the hardware ``cvt.rn``);
* against FBGEMM (where ``fbgemm_gpu`` imports): the Triton round trip and FBGEMM's round trip
  (its encode, its decode) have the same SQNR within 1.5 dB and differ by at most one step of
  the coarser grid where both are normal, as the reference does (tests/gpu/test_comm_gpu.py
  explains why the grids differ for e4m3); e5m2 agrees to > 100 dB;
* AUTO picks the Triton codec on this GPU, and encode + decode capture into a CUDA graph;
* the fused replica-sync kernels (`comm.triton_replica`) match the reference path bit for bit.

Shape legend: R rows, C values per row (row_dim).
"""

from __future__ import annotations

import pytest
import torch

from loka_train.comm import CodecImpl, CommPrecision, WireFormat
from loka_train.comm.formats import resolve_codec_impl
from loka_train.kernels.formats import Fp8Format, sqnr_db

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]
MANTISSA_BITS = {Fp8Format.E4M3: 3, Fp8Format.E5M2: 2}


def _rows(row_dim: int, num_random: int = 4096, seed: int = 0) -> torch.Tensor:
    """Special rows, then random rows whose values spread over 12 decades (FP8 subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    nan, inf = float("nan"), float("inf")

    def row(*values: float) -> torch.Tensor:
        r = torch.zeros(row_dim)
        r[: len(values)] = torch.tensor(values[:row_dim])
        return r

    special = torch.stack([
        torch.zeros(row_dim),
        torch.full((row_dim,), -0.0),
        row(1e-40, -3e-41, 0.0, 7e-42),
        row(1e-38, -2e-38, 5e-39, 3e-38),
        row(3.4e38, -3.0e38, 1e30, -1.0),
        row(1.0, nan, -2.0, 0.5),
        row(-1.0, inf, 3.0, -0.0),
        row(-inf, 2.0, nan, 1.0),
        row(448.0, 124.0, 125.0, -31.4),
        row(57344.0, 61440.0, -1.0, 3.0),
    ])
    mags = 10.0 ** torch.empty(num_random, row_dim).uniform_(-12, 0, generator=gen)
    signs = torch.randn(num_random, row_dim, generator=gen).sign()
    row_scales = 10.0 ** torch.empty(num_random, 1).uniform_(-30, 30, generator=gen)
    return torch.cat([special, signs * mags * row_scales]).cuda()


def _fmt(row_dim: int, fmt: Fp8Format, impl: CodecImpl) -> WireFormat:
    return WireFormat(precision=CommPrecision.FP8, row_dim=row_dim, fp8_format=fmt, impl=impl)


def _assert_same_values(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.is_cuda
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)
    bits = {4: torch.int32, 2: torch.int16}[ref.element_size()]
    differ = (ours[~nan].view(bits) != ref[~nan].view(bits)).sum().item()
    assert differ == 0, f"{differ} values differ"


def _assert_same_bytes(ours: torch.Tensor, ref: torch.Tensor, row_bytes: int) -> None:
    bad = (ours != ref).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} bytes differ, first at row {bad[0].item() // row_bytes}, byte "
        f"{bad[0].item() % row_bytes}: triton {ours[bad[:4]].tolist()} ref {ref[bad[:4]].tolist()}"
    )


@pytest.mark.parametrize("row_dim", [6, 32, 64, 128])
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_triton_fp8_matches_reference_bit_for_bit(fmt: Fp8Format, row_dim: int) -> None:
    x_RC = _rows(row_dim)
    ours, ref = _fmt(row_dim, fmt, CodecImpl.TRITON), _fmt(row_dim, fmt, CodecImpl.REFERENCE)
    payload = ours.encode_bytes(x_RC)
    assert payload.is_cuda and payload.numel() == ours.encoded_bytes(x_RC.numel())
    _assert_same_bytes(payload, ref.encode_bytes(x_RC), ours.row_payload_bytes)
    _assert_same_values(ours.decode_bytes(payload), ref.decode_bytes(payload))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_triton_fp8_matches_reference_at_a_job_shape(fmt: Fp8Format) -> None:
    """Batch 8192 x 26 tables x dim 128 (row_dim = dim), gradient-sized values."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x_RC = 1e-3 * torch.randn(8192 * 26, 128, device="cuda", generator=gen)
    ours, ref = _fmt(128, fmt, CodecImpl.TRITON), _fmt(128, fmt, CodecImpl.REFERENCE)
    payload = ours.encode_bytes(x_RC)
    _assert_same_bytes(payload, ref.encode_bytes(x_RC), ours.row_payload_bytes)
    _assert_same_values(ours.decode_bytes(payload), ref.decode_bytes(payload))


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("precision", [CommPrecision.BF16, CommPrecision.FP16], ids=lambda p: p.value)
def test_triton_16bit_encode_matches_reference(precision: CommPrecision, src: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    bulk = torch.randn(100_003, generator=gen) * 10.0 ** torch.empty(100_003).uniform_(-45, 39, generator=gen)
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.39e38, 65520.0, -0.0])
    x = torch.cat([special, bulk]).to(src).cuda()
    ours = WireFormat(precision=precision, impl=CodecImpl.TRITON)
    ref = WireFormat(precision=precision, impl=CodecImpl.REFERENCE)
    assert torch.equal(ours.encode_bytes(x), ref.encode_bytes(x))  # NaN bytes too


@pytest.fixture(scope="module")
def fbgemm_ops() -> None:
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError as err:
        pytest.skip(f"fbgemm_gpu does not import: {err}")
    if not hasattr(torch.ops.fbgemm, "FP8RowwiseQuantizedToFloat"):
        pytest.skip("this fbgemm_gpu has no FP8 row-wise comm ops")


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_triton_fp8_agrees_with_fbgemm(fbgemm_ops: None, fmt: Fp8Format) -> None:
    gen = torch.Generator().manual_seed(3)
    x_RC = torch.randn(4096, 32, generator=gen).cuda()
    ours_RC = _fmt(32, fmt, CodecImpl.TRITON).roundtrip(x_RC)
    theirs_RC = _fmt(32, fmt, CodecImpl.FBGEMM).roundtrip(x_RC)
    db_ours, db_theirs = float(sqnr_db(x_RC, ours_RC)), float(sqnr_db(x_RC, theirs_RC))
    assert abs(db_ours - db_theirs) < 1.5, (db_ours, db_theirs)
    if fmt is Fp8Format.E5M2:
        assert float(sqnr_db(theirs_RC, ours_RC)) > 100
    normal = x_RC.abs() >= 1e-4 * x_RC.abs().amax(dim=1, keepdim=True)
    step = 2.0 ** -MANTISSA_BITS[fmt] * x_RC.abs()
    diff = (ours_RC - theirs_RC).abs()
    assert bool((diff[normal] <= step[normal] * 1.001).all()), float((diff[normal] / step[normal]).max())


def test_auto_picks_triton_on_this_gpu() -> None:
    assert resolve_codec_impl(CodecImpl.AUTO, torch.device("cuda", torch.cuda.current_device()), 128) is (
        CodecImpl.TRITON
    )


def test_encode_and_decode_capture_in_a_cuda_graph() -> None:
    fmt = _fmt(128, Fp8Format.E4M3, CodecImpl.TRITON)
    x_RC = torch.randn(4096, 128, device="cuda")
    expected = fmt.decode_bytes(fmt.encode_bytes(x_RC))  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmt.decode_bytes(fmt.encode_bytes(x_RC))
    x_RC.copy_(torch.randn(4096, 128, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fmt.decode_bytes(fmt.encode_bytes(x_RC)))
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("fmt", FMTS)
def test_fused_replica_sync_kernels_match_the_reference_on_the_gpu(fmt: Fp8Format) -> None:
    """comm.triton_replica on the GPU: the change's payload and new residual, and the anchor
    moved by the replicas' mean, bit for bit the reference path's (a 1000 x 128 shard, 3
    replicas, N not a whole number of rows)."""
    from loka_train.comm import triton_replica as tr

    gen = torch.Generator().manual_seed(5)
    n, row_dim, replicas = 1000 * 128 + 17, 128, 3
    ref = WireFormat(precision=CommPrecision.FP8, row_dim=row_dim, fp8_format=fmt, impl=CodecImpl.REFERENCE)
    anchor = torch.randn(n, generator=gen).cuda()
    residual = 1e-4 * torch.randn(n, generator=gen).cuda()
    payloads = []
    for _ in range(replicas):
        w = anchor + 1e-2 * torch.randn(n, generator=gen).cuda()
        payload, new_residual = tr.delta_encode(w, anchor, residual, row_dim=row_dim, fmt=fmt, feedback=True)
        delta = (w - anchor) + residual
        ref_payload = ref.encode_bytes(torch.nn.functional.pad(delta, (0, (-n) % row_dim)))
        assert torch.equal(payload, ref_payload)
        assert new_residual is not None and torch.equal(new_residual, delta - ref.decode_bytes(ref_payload)[:n])
        payloads.append(payload)
    gathered = torch.cat(payloads)
    decoded = ref.decode_bytes(gathered).view(replicas, -1)[:, :n]
    expected = anchor + ((decoded[0] + decoded[1]) + decoded[2]) * (1.0 / replicas)
    w = torch.empty(n, device="cuda")
    tr.mean_apply(gathered, anchor, w, num_replicas=replicas, row_dim=row_dim, fmt=fmt)
    assert torch.equal(anchor, expected) and torch.equal(w, expected)


def test_fused_bf16_replica_sync_kernels_match_the_reference_on_the_gpu() -> None:
    """comm.triton_replica's BF16 passes on the GPU: the change's payload (the codec's clamped
    cast, at and beyond bf16's range, -0.0, subnormals) and new residual, and the anchor moved
    by 3 replicas' mean, bit for bit."""
    from loka_train.comm import triton_replica as tr

    gen = torch.Generator().manual_seed(6)
    n, replicas = 1000 * 128 + 17, 3
    ref = WireFormat(precision=CommPrecision.BF16, impl=CodecImpl.REFERENCE)
    anchor = torch.randn(n, generator=gen).cuda()
    residual = 1e-6 * torch.randn(n, generator=gen).cuda()
    payloads = []
    for r in range(replicas):
        w = anchor + 1e-2 * torch.randn(n, generator=gen).cuda()
        if r == 0:  # changes at the clamp, beyond it, -0.0 and subnormal
            specials = torch.tensor([3.3e38, 3.4e38, -3.4e38, -0.0, 1e-40, -3e-39], device="cuda")
            w[:6] = anchor[:6] + specials
        payload, new_residual = tr.delta_encode_bf16(w, anchor, residual, feedback=True)
        delta = (w - anchor) + residual
        ref_payload = ref.encode_native(delta)
        assert torch.equal(payload.view(torch.int16), ref_payload.view(torch.int16))
        assert new_residual is not None and torch.equal(new_residual, delta - ref_payload.float())
        payloads.append(payload)
    expected = anchor + ((payloads[0].float() + payloads[1].float()) + payloads[2].float()) * (1.0 / replicas)
    w = torch.empty(n, device="cuda")
    tr.mean_apply_bf16(torch.cat([p.view(torch.uint8) for p in payloads]), anchor, w, num_replicas=replicas)
    assert torch.equal(anchor, expected) and torch.equal(w, expected)
