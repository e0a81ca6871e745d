"""bench.castin_gemm's kernel in the Triton interpreter: the activation's codes cast in the
GEMM's loads are the static cast's, so the product is the static cast then the FP8 GEMM's; the
amax is the activation's; and its command line refuses problems it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.castin_gemm import _problems, castin_gemm, castin_gemm_reference, castin_gemm_tma, main
from loka_train.kernels import static_scales as ss
from loka_train.kernels.formats import Fp8Format, Scaling, quantize


def _seeded_slot(a: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=a.device)[0]
    ss.quantize_static_reference(a, slot, fmt)  # seeds the slot
    return slot


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_the_product_is_the_static_casts_codes_times_the_weights(fmt: Fp8Format) -> None:
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(70, 96, generator=g) * 5).to(torch.bfloat16)  # rows and K not multiples of the tile
    a[69, 95] = -64.0  # the largest magnitude negative, in the last partial tile
    w = quantize(torch.randn(40, 96, generator=g) / 10, Fp8Format.E4M3, Scaling.TENSORWISE)
    slot = _seeded_slot(a, fmt)
    codes, scale = ss.quantize_static_reference(a, slot.clone(), fmt)
    assert bool(scale == slot[ss.SCALE])  # the slot's scale fits a: the codes are the static cast's
    got, amax = castin_gemm(a, slot, fmt, w.data, w.scale, amax=True)
    want = castin_gemm_reference(a, slot, fmt, w.data, w.scale)
    exact = ((codes.float() * scale) @ (w.data.float() * w.scale).t())
    assert torch.equal(want.float(), exact.to(torch.bfloat16).float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=1e-3 * float(exact.abs().max()))
    assert float(amax) == float(a.float().abs().max())
    # Without the amax none is reduced; the product is the same.
    got2, amax2 = castin_gemm(a, slot, fmt, w.data, w.scale)
    assert torch.equal(got2, got) and float(amax2) == 0.0


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_each_code_is_the_static_casts_in_its_own_format(fmt: Fp8Format) -> None:
    # An identity weight (its codes dequantize to exactly 1) gives the activation's dequantized
    # codes back: every one is compared, the smallest included (e5m2 keeps 2**-16, e4m3 flushes
    # what lies below 2**-9).
    a = (torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    a[0, :8] = torch.tensor([1e-4, -3e-4, 2e-3, 5e-5, 0.0, -0.0, 40.0, -64.0])
    w = quantize(torch.eye(64)[:32].contiguous(), Fp8Format.E4M3, Scaling.TENSORWISE)
    assert float((w.data.float() * w.scale).max()) == 1.0
    slot = _seeded_slot(a, fmt)
    got, _ = castin_gemm(a, slot, fmt, w.data, w.scale)
    want = castin_gemm_reference(a, slot, fmt, w.data, w.scale)
    assert torch.equal(got, want)
    assert bool(got[0, 0] != 0) is (fmt is Fp8Format.E5M2)


def test_a_scale_that_does_not_divide_the_activation_gives_another_product() -> None:
    # The test above fails where the kernel ignores the slot's scale: here, the scale changed by
    # a binade changes the saturated codes of the largest values.
    a = torch.linspace(-600, 600, 64 * 32).reshape(64, 32).to(torch.bfloat16)
    w = quantize(torch.eye(32)[:16].contiguous(), Fp8Format.E4M3, Scaling.TENSORWISE)
    slot = _seeded_slot(a, Fp8Format.E4M3)
    got, _ = castin_gemm(a, slot, Fp8Format.E4M3, w.data, w.scale)
    slot[ss.SCALE] /= 4
    saturated, _ = castin_gemm(a, slot, Fp8Format.E4M3, w.data, w.scale)
    assert float(saturated.float().abs().max()) < float(got.float().abs().max())


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_the_persistent_form_casts_each_code_as_the_static_cast(fmt: Fp8Format) -> None:
    # An identity weight gives the activation's dequantized codes back; rows not a multiple of
    # the tile (the copy engine's zero fill), more tiles than programs (the persistent walk).
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(80, 64, generator=g) * 3).to(torch.bfloat16)
    a[0, :8] = torch.tensor([1e-4, -3e-4, 2e-3, 5e-5, 0.0, -0.0, 40.0, -64.0])
    w = quantize(torch.eye(64)[:48].contiguous(), Fp8Format.E4M3, Scaling.TENSORWISE)
    slot = _seeded_slot(a, fmt)
    want = castin_gemm_reference(a, slot, fmt, w.data, w.scale)
    cfg = (32, 16, 32, 2, 4, 2)
    got = castin_gemm_tma(a, slot, fmt, w.data, w.scale, config=cfg, num_programs=3)
    assert torch.equal(got, want)
    # Two column tiles a program (one cast for both), with a partial second tile: the same.
    assert torch.equal(castin_gemm_tma(a, slot, fmt, w.data, w.scale, config=(*cfg, 1), num_programs=3), want)
    # The activation's tiles through plain loads: the same.
    assert torch.equal(castin_gemm_tma(a, slot, fmt, w.data, w.scale, config=cfg, num_programs=3, a_tma=False), want)
    # On codes cast beforehand (no cast in the kernel) the product is the same.
    codes, _ = ss.quantize_static_reference(a, slot.clone(), fmt)
    assert torch.equal(castin_gemm_tma(codes, slot, fmt, w.data, w.scale, config=cfg, cast=False), want)
    # A general weight: the product of the static cast's codes.
    w2 = quantize(torch.randn(48, 64, generator=g) / 10, Fp8Format.E4M3, Scaling.TENSORWISE)
    torch.testing.assert_close(castin_gemm_tma(a, slot, fmt, w2.data, w2.scale, config=cfg).float(),
                               castin_gemm_reference(a, slot, fmt, w2.data, w2.scale).float(), rtol=2**-7, atol=0.05)
    with pytest.raises(ValueError, match="saturating conversion"):
        castin_gemm_tma(a, slot, fmt, w.data, w.scale, config=cfg, satfinite=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        castin_gemm_tma(a[:, :40].contiguous(), slot, fmt, w.data[:, :40].contiguous(), w.scale, config=cfg)


def test_bad_operands_are_refused() -> None:
    a = torch.randn(8, 16).to(torch.bfloat16)
    w = quantize(torch.randn(4, 12), Fp8Format.E4M3, Scaling.TENSORWISE)
    slot = _seeded_slot(a, Fp8Format.E4M3)
    with pytest.raises(ValueError, match="needs a \\(M, K\\)"):
        castin_gemm(a, slot, Fp8Format.E4M3, w.data, w.scale)
    with pytest.raises(ValueError, match="slot"):
        castin_gemm(a, torch.zeros(3), Fp8Format.E4M3, w.data, w.scale)


def test_problems_are_m_x_k_x_n(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _problems("32768x3456x512,8x16X32") == [(32768, 3456, 512), (8, 16, 32)]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "out"), "--shapes", "32768x3456"])
    assert "MxKxN" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
