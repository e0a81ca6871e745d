"""The Probe's shadow GEMMs on CUDA: FP8 payloads (and bf16 operands) multiplied as bf16 GEMMs
that accumulate and return fp32, scales applied after, give the statistics of the fp32 GEMMs on
dequantized operands; a backend without such GEMMs falls back to fp32, logged once."""

from __future__ import annotations

import logging

import pytest
import torch

import loka_train.probe.measurement as measurement
from loka_train.kernels.formats import Fp8Format, Scaling, dequantize, quantize
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import candidates_of
from loka_train.probe.config import ProbeConfig
from loka_train.probe.measurement import Measurement, count_nonfinite, gemm, scaled_payload_gemm
from loka_train.probe.window import WindowLayout

AXES = {"forward": (1, 1), "grad_input": (1, 0), "grad_weight": (0, 0)}
SHAPES = {"forward": ((32, 24), (16, 24)), "grad_input": ((32, 16), (16, 24)), "grad_weight": ((32, 16), (32, 24))}


def _fp32_mm(role: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gemm(role, a.float(), b.float())


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
def test_scales_factor_out_of_every_role_s_gemm(role: str, scaling: Scaling) -> None:
    torch.manual_seed(0)
    (sa, sb), (ax_a, ax_b) = SHAPES[role], AXES[role]
    a = torch.randn(*sa) * torch.logspace(-2, 2, sa[0]).reshape(-1, 1)  # rows of very different ranges
    b = torch.randn(*sb) * torch.logspace(-1, 1, sb[1])
    qa = quantize(a, Fp8Format.E4M3, scaling, axis=ax_a)
    qb = quantize(b, Fp8Format.E5M2, scaling, axis=ax_b)
    ref = gemm(role, dequantize(qa), dequantize(qb))
    out = scaled_payload_gemm(role, qa, qb, _fp32_mm)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_block_scales_do_not_factor_out() -> None:
    x = torch.randn(8, 64)
    q = quantize(x, Fp8Format.E4M3, Scaling.BLOCK, axis=1, block_size=32)
    with pytest.raises(ValueError, match="tensor-wise and row-wise only"):
        scaled_payload_gemm("forward", q, q, _fp32_mm)


def _measure(m: Measurement, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    (sa, sb) = SHAPES[role]
    a = torch.randn(*sa).bfloat16()
    b = torch.randn(*sb).bfloat16() if role == "grad_weight" else torch.randn(*sb)  # a weight: fp32
    nf = count_nonfinite(a)
    return m.measure(role, a, b, nf, count_nonfinite(b), None, graphable=False)


@pytest.mark.parametrize("role", ROLES)
def test_bf16_gemms_with_an_fp32_result_give_the_fp32_statistics(role: str, monkeypatch) -> None:
    """CPU has no bf16 GEMM with an fp32 result: it is emulated here as the fp32 GEMM of the
    same (bf16-exact) values, which is what that GEMM computes, up to the order of the sums."""
    cfg = ProbeConfig(formats=("e4m3", "e5m2"), scalings=("tensorwise", "rowwise"))
    plain = Measurement(cfg, candidates_of(cfg), WindowLayout(len(candidates_of(cfg))), device=torch.device("cpu"))
    want = _measure(plain, role)
    calls: list[torch.dtype] = []
    real = measurement.gemm

    def emulated(role_: str, a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None):
        if out_dtype is not None:
            calls.append(a.dtype)
            assert a.dtype == b.dtype == torch.bfloat16 and out_dtype == torch.float32
            return real(role_, a.float(), b.float())
        return real(role_, a, b)

    monkeypatch.setattr(measurement, "gemm", emulated)
    fast = Measurement(cfg, candidates_of(cfg), WindowLayout(len(candidates_of(cfg))), device=torch.device("cpu"))
    fast.exact_bf16_gemms = True
    got = _measure(fast, role)
    # Every candidate's GEMM, and the reference: one GEMM when both operands are bf16, three
    # (one per bf16 part of the weight, split_bf16) when the second is the fp32 weight.
    assert len(calls) == len(candidates_of(cfg)) + (1 if role == "grad_weight" else 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-9)


def test_split_bf16_parts_sum_to_the_fp32_tensor() -> None:
    from loka_train.probe.measurement import split_bf16

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.logspace(-30, 30, 256).reshape(1, -1)
    x[0, :4] = torch.tensor([3.4e38, -3.3e38, 1 / 3, 0.0])  # near the largest: nothing overflows
    parts = split_bf16(x)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert torch.equal(total, x.double())
    assert not torch.equal(parts[0].double(), x.double())  # one part would not do


def test_a_backend_without_them_falls_back_to_fp32_once_and_says_so(caplog) -> None:
    cfg = ProbeConfig(formats=("e4m3",), scalings=("rowwise",))
    plain = Measurement(cfg, candidates_of(cfg), WindowLayout(1), device=torch.device("cpu"))
    want = _measure(plain, "grad_weight")
    m = Measurement(cfg, candidates_of(cfg), WindowLayout(1), device=torch.device("cpu"))
    m.exact_bf16_gemms = True  # CPU refuses torch.mm(..., out_dtype=): the fallback path
    with caplog.at_level(logging.WARNING, logger="loka_train"):
        got = _measure(m, "grad_weight")
        _measure(m, "grad_weight")
    assert not m.exact_bf16_gemms and m.exact_gemm_fallback is not None
    assert len([r for r in caplog.records if "bf16 GEMMs with an fp32 result failed" in r.getMessage()]) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_the_probe_report_names_the_fallback() -> None:
    from loka_train.probe import Probe

    probe = Probe(ProbeConfig(every_k_steps=1, formats=("e4m3",), scalings=("rowwise",)), device=torch.device("cpu"))
    probe.register_site("s", weight_shape=(16, 24))
    assert probe.report()["shadow_gemm_fallback"] is None
    probe._measurement.exact_bf16_gemms = True  # as on CUDA; the CPU refuses the GEMM
    probe.begin_step(0)
    probe.observe("s", "grad_weight", torch.randn(32, 16).bfloat16(), torch.randn(32, 24).bfloat16())
    assert "NotImplementedError" in probe.report()["shadow_gemm_fallback"]


def test_out_of_memory_is_not_taken_for_a_missing_gemm(monkeypatch) -> None:
    real = measurement.gemm

    def oom(role: str, a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None):
        if out_dtype is not None:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(role, a, b)

    monkeypatch.setattr(measurement, "gemm", oom)
    cfg = ProbeConfig(formats=("e4m3",), scalings=("rowwise",))
    m = Measurement(cfg, candidates_of(cfg), WindowLayout(1), device=torch.device("cpu"))
    m.exact_bf16_gemms = True
    with pytest.raises(torch.OutOfMemoryError):
        _measure(m, "grad_weight")
    assert m.exact_bf16_gemms and m.exact_gemm_fallback is None
