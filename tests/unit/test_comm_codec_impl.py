"""comm.codec_impl: the default chosen by capability, explicit requests checked where the comm
state is built, and the choice reaching the codec (FP8 payloads bit-identical either way)."""

from __future__ import annotations

import logging

import pytest
import torch

from loka_train.comm import (
    CodecImpl,
    CommChannel,
    CommConfig,
    CommPrecision,
    CommState,
    SwitchableCodec,
    WireFormat,
)
from loka_train.comm import formats as formats_module


@pytest.fixture
def fresh_auto_cache():  # type: ignore[no-untyped-def]
    """AUTO's per-device choice is cached: start and end each test without it."""
    formats_module._auto_impl.cache_clear()
    formats_module._checked_impl.cache_clear()
    yield
    formats_module._auto_impl.cache_clear()
    formats_module._checked_impl.cache_clear()


def test_default_is_auto_and_strings_are_accepted() -> None:
    assert CommConfig().codec_impl is CodecImpl.AUTO
    assert WireFormat(precision=CommPrecision.FP8).impl is CodecImpl.AUTO
    assert CommConfig(codec_impl="triton").codec_impl is CodecImpl.TRITON  # type: ignore[arg-type]
    assert CommConfig(codec_impl="FBGEMM").codec_impl is CodecImpl.FBGEMM  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choose one of \\['AUTO', 'REFERENCE', 'FBGEMM', 'TRITON'\\]"):
        CommConfig(codec_impl="cuda")  # type: ignore[arg-type]


def test_auto_is_the_reference_on_cpu(fresh_auto_cache) -> None:  # type: ignore[no-untyped-def]
    # Even though the interpreter could run the kernels here: AUTO picks Triton for CUDA only.
    assert formats_module.resolve_codec_impl(CodecImpl.AUTO, "cpu", 32) is CodecImpl.REFERENCE
    state = CommState(CommConfig(a2a_forward=CommPrecision.FP8), backend="gloo", device="cpu")
    fmt = state.wire_format(CommChannel.A2A_FWD, CommPrecision.FP8)
    assert fmt.impl is CodecImpl.AUTO and fmt.impl_for("cpu") is CodecImpl.REFERENCE


@pytest.mark.parametrize(("runnable", "expected"), [(True, CodecImpl.TRITON), (False, CodecImpl.REFERENCE)])
def test_auto_on_cuda_follows_capability_and_logs_once(
    monkeypatch, caplog, fresh_auto_cache, runnable: bool, expected: CodecImpl  # type: ignore[no-untyped-def]
) -> None:
    calls = []

    def fake_runnable(device: torch.device, row_dim: int) -> tuple[bool, str]:
        calls.append((device, row_dim))
        return runnable, "" if runnable else "FP8 needs sm_89+, device is sm_80"

    monkeypatch.setattr(formats_module, "_triton_codec_runnable", fake_runnable)
    with caplog.at_level(logging.INFO, logger="loka_train.comm.formats"):
        for _ in range(3):
            got = formats_module.resolve_codec_impl(CodecImpl.AUTO, torch.device("cuda", 0), 128)
            assert got is expected
    assert calls == [(torch.device("cuda", 0), 128)]  # checked once per device and row_dim
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1
    assert ("Triton" in logged[0]) if runnable else ("sm_80" in logged[0] and "reference" in logged[0])


def test_explicit_triton_is_refused_where_it_cannot_run() -> None:
    # A device Triton has no backend for: the request raises, naming the fix.
    with pytest.raises(ValueError, match="codec_impl=TRITON cannot run on meta.*Set comm.codec_impl=AUTO"):
        CommState(CommConfig(codec_impl=CodecImpl.TRITON), backend="gloo", device="meta")
    with pytest.raises(ValueError, match="cannot run on meta"):
        WireFormat(precision=CommPrecision.BF16, impl=CodecImpl.TRITON).encode_bytes(
            torch.zeros(4, device="meta")
        )


def test_explicit_triton_refused_without_the_interpreter(monkeypatch, fresh_auto_cache) -> None:  # type: ignore[no-untyped-def]
    why = "Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported"
    monkeypatch.setattr(formats_module, "_triton_codec_runnable", lambda device, row_dim: (False, why))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        CommState(CommConfig(codec_impl="triton"), backend="gloo", device="cpu")  # type: ignore[arg-type]
    # Precisions TRITON has no kernel for need none: INT8 and FP32 still encode.
    fmt = WireFormat(precision=CommPrecision.INT8, row_dim=4, impl=CodecImpl.TRITON)
    assert fmt.encode_bytes(torch.ones(8)).numel() == 2 * 12


def test_explicit_fbgemm_fp8_is_refused_on_cpu() -> None:
    with pytest.raises(ValueError, match="FBGEMM needs a CUDA device"):
        WireFormat(precision=CommPrecision.FP8, impl=CodecImpl.FBGEMM).encode_bytes(torch.ones(32))
    # FBGEMM's INT8 ops have CPU kernels.
    fbgemm_int8 = WireFormat(precision=CommPrecision.INT8, row_dim=32, impl=CodecImpl.FBGEMM)
    assert fbgemm_int8.encode_bytes(torch.ones(32)).numel() == fbgemm_int8.encoded_bytes(32)


@pytest.mark.parametrize("precision", [CommPrecision.FP8, CommPrecision.BF16], ids=lambda p: p.value)
def test_codec_with_triton_matches_reference_codec(precision: CommPrecision) -> None:
    """The setting reaches the codec: a TorchRec-style encode/decode through SwitchableCodec
    gives the same bytes and values with TRITON (interpreter) as with REFERENCE."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    results = []
    for impl in (CodecImpl.TRITON, CodecImpl.REFERENCE):
        state = CommState(
            CommConfig(a2a_forward=precision, row_dim=8, codec_impl=impl), backend="gloo", device="cpu"
        )
        assert state.wire_format(CommChannel.A2A_FWD, precision).impl_for("cpu") is impl
        codec = SwitchableCodec(state, CommChannel.A2A_FWD)
        ctx = codec.create_context()
        payload = codec.encode(x, ctx)
        assert payload.numel() == codec.calc_quantized_size(x.numel(), ctx)
        results.append((payload, codec.decode(payload, ctx)))
    (ours, ours_x), (ref, ref_x) = results
    assert torch.equal(ours, ref)
    assert torch.equal(ours_x, ref_x)
