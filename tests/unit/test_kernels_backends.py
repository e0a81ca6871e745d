"""Plans (validation, serialization), the backend registry, and the CPU-runnable backends
against the emulated oracle on the same quantized inputs.

Tolerances: torch._scaled_mm on CPU and the emulated backend multiply the same FP8 values in
fp32, so with fp32 output they agree to > 120 dB (fp32 summation order only); with bf16
output to > 45 dB (one bf16 rounding, ~2^-9 relative). The bf16 backend rounds the
dequantized operands to bf16 (exact for e4m3 x power-of-two scales only), so > 40 dB.
"""

import pytest
import torch

from loka_train.kernels import backends as be
from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import Fp8Format, Scaling, as_format, as_scaling, quantize, sqnr_db
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.kernels.registry import (
    available_backends,
    get_backend,
    register_backend,
    registered_backends,
)


def _gauss(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- plans


def test_gemm_plan_defaults_and_str():
    p = GemmPlan()
    assert p.precision is Precision.HIGH and not p.is_fp8 and str(p) == "high"
    p = GemmPlan(precision="fp8", backend="triton")
    assert p.precision is Precision.FP8
    assert str(p) == "fp8:e4m3/rowwise@triton"
    p = GemmPlan(precision="fp8", fmt="e5m2", fmt_b="e4m3", fast_accum=True, backend="torch_scaled_mm")
    assert str(p) == "fp8:e5m2xe4m3/rowwise@torch_scaled_mm+fast"
    assert p.operand_b_fmt is Fp8Format.E4M3


def test_gemm_plan_validation():
    with pytest.raises(ValueError, match="does not support mx"):
        GemmPlan(precision=Precision.FP8, scaling=Scaling.MX, backend="triton")
    with pytest.raises(ValueError, match="e5m2"):
        GemmPlan(precision=Precision.FP8, fmt=Fp8Format.E5M2, backend="fbgemm_rowwise")
    with pytest.raises(ValueError, match="invalid"):
        GemmPlan(precision="fp16")
    with pytest.raises(ValueError, match="backend"):
        GemmPlan(backend="")
    with pytest.raises(ValueError, match="fast_accum"):
        GemmPlan(fast_accum=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GemmPlan(Precision.FP8)  # type: ignore[misc]  # keyword-only
    # HIGH ignores FP8 fields; unknown (later-registered) backends are checked at run time.
    GemmPlan(precision=Precision.HIGH, scaling=Scaling.MX, backend="triton")
    GemmPlan(precision=Precision.FP8, scaling=Scaling.MX, backend="my_custom_backend")


def test_plan_round_trip():
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm", fast_accum_fwd=True)
    d = plan.to_dict()
    assert d["grad_input"]["fmt"] == "e5m2" and d["grad_input"]["fmt_b"] == "e4m3"
    assert LinearPlan.from_dict(d) == plan
    assert GemmPlan.from_dict(plan.forward.to_dict()) == plan.forward
    with pytest.raises(ValueError, match="unknown"):
        GemmPlan.from_dict({**plan.forward.to_dict(), "typo": 1})
    with pytest.raises(ValueError, match="unknown"):
        LinearPlan.from_dict({**d, "extra": {}})
    hp = LinearPlan.high_precision()
    assert not any(g.is_fp8 for g in (hp.forward, hp.grad_input, hp.grad_weight))
    assert not LinearPlan.fp8(grad_weight_fp8=False).grad_weight.is_fp8
    with pytest.raises(ValueError, match="GemmPlan"):
        LinearPlan(forward="fp8")  # type: ignore[arg-type]


# ---------------------------------------------------------------- registry


def _problem(**kw):
    base = dict(
        m=64, k=32, n=16, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE, device_type="cpu",
        out_dtype=torch.float32, role="forward",
    )
    base.update(kw)
    return GemmProblem(**base)


def test_registry_lists_builtins_and_reasons():
    names = registered_backends()
    for n in ("emulated", "bf16", "torch_scaled_mm", "fbgemm_rowwise", "triton"):
        assert n in names
    avail = available_backends(_problem())
    assert avail["emulated"] is None and avail["bf16"] is None
    assert avail["torch_scaled_mm"] is None  # CPU reference path
    assert "CUDA" in avail["fbgemm_rowwise"]
    mx = available_backends(_problem(scaling=Scaling.MX))
    assert mx["emulated"] is None
    assert "sm_100" in mx["torch_scaled_mm"]
    assert "mx" in mx["triton"]
    block = available_backends(_problem(scaling=Scaling.BLOCK))
    assert "CPU" in block["torch_scaled_mm"]


def test_get_backend_unknown_names_available():
    with pytest.raises(KeyError, match="emulated"):
        get_backend("no_such_backend")


def test_register_custom_backend():
    class Doubler(be.EmulatedBackend):
        name = "test_doubler"

        def __call__(self, a_q, b_q, *, out_dtype, bias=None, fast_accum=False):
            return 2 * super().__call__(a_q, b_q, out_dtype=out_dtype, bias=bias)

    register_backend(Doubler(), replace=True)
    with pytest.raises(ValueError, match="already registered"):
        register_backend(Doubler())
    with pytest.raises(ValueError, match="protocol"):
        register_backend(object())  # type: ignore[arg-type]
    a_q = quantize(_gauss(8, 32), "e4m3", "rowwise")
    b_q = quantize(_gauss(4, 32, seed=1), "e4m3", "rowwise")
    out = get_backend("test_doubler")(a_q, b_q, out_dtype=torch.float32)
    ref = get_backend("emulated")(a_q, b_q, out_dtype=torch.float32)
    torch.testing.assert_close(out, 2 * ref)


def test_fp8_available_cpu_has_reason():
    ok, why = fp8_available("cpu")
    assert not ok and "CPU" in why


def test_problem_from_operands_checks():
    a_q = quantize(_gauss(8, 32), "e5m2", "rowwise")
    b_q = quantize(_gauss(4, 32), "e4m3", "rowwise")
    p = GemmProblem.from_operands(a_q, b_q, out_dtype=torch.bfloat16, role="grad_input")
    assert (p.m, p.k, p.n) == (8, 32, 4) and p.fmt is Fp8Format.E5M2 and p.fmt_b is Fp8Format.E4M3
    with pytest.raises(ValueError, match="contraction"):
        GemmProblem.from_operands(a_q, quantize(_gauss(4, 16), "e4m3", "rowwise"), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="scaling"):
        GemmProblem.from_operands(a_q, quantize(_gauss(4, 32), "e4m3", "tensorwise"), out_dtype=torch.float32)


def test_problems_of_members_call_no_enum_class(monkeypatch: pytest.MonkeyPatch) -> None:
    # Served sites build problems in compiled code, where calling an Enum class is a graph
    # break on some torch releases: members pass through; strings still become members.
    a_q = quantize(_gauss(8, 32), "e4m3", "tensorwise")
    calls: list[object] = []
    real = type(Scaling).__call__
    monkeypatch.setattr(type(Scaling), "__call__", lambda cls, *a, **k: (calls.append(cls), real(cls, *a, **k))[1])
    p = GemmProblem.from_operands(a_q, a_q, out_dtype=torch.bfloat16)
    assert calls == [] and p.scaling is Scaling.TENSORWISE and p.fmt is Fp8Format.E4M3
    assert (as_format(Fp8Format.E5M2), as_scaling(Scaling.ROWWISE)) == (Fp8Format.E5M2, Scaling.ROWWISE) and calls == []
    q = GemmProblem(m=1, k=16, n=16, fmt="e5m2", scaling="rowwise", device_type="cpu", out_dtype=torch.float32,
                    fmt_b="e4m3")
    assert (q.fmt, q.fmt_b, q.scaling) == (Fp8Format.E5M2, Fp8Format.E4M3, Scaling.ROWWISE)
    assert set(calls) == {Fp8Format, Scaling}


# ---------------------------------------------------------------- backends on CPU


def _operands(fmt_a, fmt_b, scaling, m=48, k=64, n=40):
    # Rows with different magnitudes so that row-wise scales matter.
    a = _gauss(m, k) * torch.linspace(0.01, 10, m)[:, None]
    b = _gauss(n, k, seed=1) * torch.linspace(0.1, 3, n)[:, None]
    return quantize(a, fmt_a, scaling), quantize(b, fmt_b, scaling)


@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE], ids=lambda s: s.value)
@pytest.mark.parametrize(
    ("fmt_a", "fmt_b"),
    [(Fp8Format.E4M3, Fp8Format.E4M3), (Fp8Format.E5M2, Fp8Format.E4M3), (Fp8Format.E5M2, Fp8Format.E5M2)],
    ids=["e4m3xe4m3", "e5m2xe4m3", "e5m2xe5m2"],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_scaled_mm_cpu_matches_emulated(scaling, fmt_a, fmt_b, out_dtype):
    a_q, b_q = _operands(fmt_a, fmt_b, scaling)
    bias = _gauss(40, seed=2)
    ref = get_backend("emulated")(a_q, b_q, out_dtype=torch.float32, bias=bias)
    got = get_backend("torch_scaled_mm")(a_q, b_q, out_dtype=out_dtype, bias=bias)
    assert got.dtype == out_dtype and got.shape == (48, 40)
    threshold = 120.0 if out_dtype == torch.float32 else 45.0
    assert float(sqnr_db(ref, got)) > threshold


def test_bf16_backend_close_to_emulated():
    a_q, b_q = _operands(Fp8Format.E4M3, Fp8Format.E4M3, Scaling.ROWWISE)
    ref = get_backend("emulated")(a_q, b_q, out_dtype=torch.float32)
    got = get_backend("bf16")(a_q, b_q, out_dtype=torch.float32)
    assert float(sqnr_db(ref, got)) > 40.0


@pytest.mark.parametrize(
    ("scaling", "block_2d_b"),
    [(Scaling.BLOCK, True), (Scaling.BLOCK, False), (Scaling.MX, False)],
    ids=["block_1x128_128x128", "block_1x128_1x128", "mx"],
)
def test_emulated_handles_block_and_mx(scaling, block_2d_b):
    a = _gauss(64, 256)
    b = _gauss(128, 256, seed=1)
    a_q = quantize(a, "e4m3", scaling)
    b_q = quantize(b, "e4m3", scaling, block_2d=block_2d_b)
    out = get_backend("emulated")(a_q, b_q, out_dtype=torch.float32)
    # Two operands at ~31.5 dB each: the product error is ~3 dB worse than either.
    assert float(sqnr_db(a @ b.t(), out)) > 26.0


def test_emulated_rejects_operands_not_scaled_along_k():
    a_q = quantize(_gauss(8, 32), "e4m3", "rowwise", axis=0)
    b_q = quantize(_gauss(4, 32), "e4m3", "rowwise")
    with pytest.raises(ValueError, match="along K"):
        get_backend("emulated")(a_q, b_q, out_dtype=torch.float32)
