"""GPU tests of loka_train.kernels: every backend against the emulated oracle on the same
quantized inputs, torch.compile of the FP8 linear, the Triton kernels against their
references, and opcheck of the custom ops on CUDA.

Tolerances (dB) against ``emulated`` (dequantize + fp32 matmul, TF32 off):
    fp32 output, fp32 accumulation:      > 70   (summation order only)
    bf16 output:                         > 45   (one bf16 rounding, ~2^-9 relative -> ~52)
    fast accumulation (Hopper FP8 acc.):  > 35   (reduced-precision accumulator)
Triton quantizer: scales equal ``formats.quantize`` of the kernel's own high-precision output
to 1 ulp of fp32, and at most 0.1 % of FP8 codes differ, by one step (GPU division rounding).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import Fp8Format, Scaling, quantize, sqnr_db
from loka_train.kernels.fused import layernorm_linear
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.linear import folds_bias_grad, fp8_linear
from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.registry import get_backend, registered_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
# Backends that must run on an H100 with the GPU stack (fbgemm only if its GenAI ops import).
REQUIRED_ON_HOPPER = {"emulated", "bf16", "torch_scaled_mm", "triton"}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _gauss(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def _require_fp8():
    ok, why = fp8_available(DEV)
    if not ok:
        pytest.skip(f"no FP8 tensor cores: {why}")


CASES = [
    # (scaling, fmt_a, fmt_b, b_block_2d)
    (Scaling.TENSORWISE, Fp8Format.E4M3, Fp8Format.E4M3, False),
    (Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3, False),
    (Scaling.ROWWISE, Fp8Format.E5M2, Fp8Format.E4M3, False),
    (Scaling.BLOCK, Fp8Format.E4M3, Fp8Format.E4M3, True),
    (Scaling.BLOCK, Fp8Format.E4M3, Fp8Format.E4M3, False),
]
CASE_IDS = ["tensorwise", "rowwise", "rowwise_e5m2xe4m3", "block_1x128_128x128", "block_1x128_1x128"]


@pytest.mark.parametrize("backend_name", sorted(REQUIRED_ON_HOPPER | {"fbgemm_rowwise"}))
@pytest.mark.parametrize(("scaling", "fmt_a", "fmt_b", "b_2d"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(256, 512, 384), (1024, 256, 1024), (1024, 1024, 1024), (1000, 384, 1008)],
    ids=["256x512x384", "1024x256x1024", "1024x1024x1024", "1000x384x1008"],
)
def test_backend_matches_emulated(backend_name, scaling, fmt_a, fmt_b, b_2d, out_dtype, fast_accum, m, k, n):
    _require_fp8()
    a = _gauss(m, k) * torch.linspace(0.05, 5, m, device=DEV)[:, None]
    b = _gauss(n, k, seed=1)
    a_q = quantize(a, fmt_a, scaling)
    b_q = quantize(b, fmt_b, scaling, block_2d=b_2d)
    bias = _gauss(n, seed=2)
    problem = GemmProblem.from_operands(a_q, b_q, out_dtype=out_dtype, fast_accum=fast_accum)
    backend = get_backend(backend_name)
    ok, why = backend.supports(problem)
    if not ok:
        expected_unsupported = (
            backend_name == "fbgemm_rowwise"
            or (backend_name == "triton" and scaling is Scaling.BLOCK)
            or (backend_name == "torch_scaled_mm" and scaling is Scaling.BLOCK
                and (out_dtype != torch.bfloat16 or fast_accum or k % 512))
        )
        assert expected_unsupported, f"{backend_name} should run {problem}: {why}"
        pytest.skip(f"{backend_name}: {why}")
    ref = get_backend("emulated")(a_q, b_q, out_dtype=torch.float32, bias=bias)
    out = backend(a_q, b_q, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)
    assert out.dtype == out_dtype and out.shape == (m, n)
    if backend_name == "bf16":
        threshold = 40.0  # bf16 operands: dequantized e4m3 x fp32 scale is not exact in bf16
    elif fast_accum:
        threshold = 35.0
    elif out_dtype == torch.float32 and backend_name != "fbgemm_rowwise":
        threshold = 70.0
    else:
        # bf16 outputs; also fbgemm's f8f8bf16_rowwise with out_dtype fp32, which is its bf16
        # result upcast (55.6 dB measured on an H100).
        threshold = 45.0
    db = float(sqnr_db(ref, out))
    assert db > threshold, f"{backend_name} {db:.1f} dB"


def test_registry_on_hopper_offers_required_backends():
    _require_fp8()
    p = GemmProblem(m=8192, k=1024, n=1024, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE,
                    device_type="cuda", out_dtype=torch.bfloat16)
    from loka_train.kernels.registry import available_backends

    avail = available_backends(p)
    for name in REQUIRED_ON_HOPPER:
        assert avail[name] is None, f"{name}: {avail[name]}"
    assert set(registered_backends()) >= REQUIRED_ON_HOPPER | {"fbgemm_rowwise"}


@pytest.mark.parametrize("backend", ["emulated", "torch_scaled_mm", "triton"])
def test_torch_compile_fp8_linear(backend):
    _require_fp8()
    plan = LinearPlan.fp8(backend=backend)
    x = _gauss(4, 256, 512, dtype=torch.bfloat16)
    w = _gauss(256, 512, seed=1, dtype=torch.bfloat16)
    b = _gauss(256, seed=2, dtype=torch.bfloat16)
    g = _gauss(4, 256, 256, seed=3, dtype=torch.bfloat16)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = fn(*leaves)
        y.backward(g)
        return [y.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: fp8_linear(x, w, b, plan))
    eager = run(lambda x, w, b: fp8_linear(x, w, b, plan))
    got = run(compiled)
    for i, (r, o) in enumerate(zip(eager, got)):
        assert o.dtype == r.dtype
        assert float(sqnr_db(r, o)) > 40, i


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize(("layernorm", "activation"), [(False, "none"), (True, "relu"), (True, "silu")])
@pytest.mark.parametrize(("m", "k"), [(1000, 64), (4096, 1024), (513, 4096)])
def test_triton_quantizer_vs_reference(fmt, layernorm, activation, m, k):
    from loka_train.kernels import triton_kernels as tk

    _require_fp8()
    x = (3 * _gauss(m, k)).bfloat16()
    kw = dict(fmt=fmt, layernorm=layernorm, activation=activation, return_hp=True)
    if layernorm:
        kw.update(ln_weight=(1 + _gauss(k, seed=1)).bfloat16(), ln_bias=_gauss(k, seed=2).bfloat16())
    q, s, h, _, _, _ = tk.fused_rowwise_quant(x, **kw)
    _, _, rh, _, _, _ = tk.rowwise_quant_reference(x, **kw)
    assert float(sqnr_db(rh, h)) > 45  # bf16 LayerNorm, different reduction order
    own = quantize(h, fmt, Scaling.ROWWISE)
    torch.testing.assert_close(s, own.scale, rtol=2e-7, atol=0)
    diff = q.float() != own.data.float()
    assert float(diff.float().mean()) <= 1e-3
    # Where codes differ, they are neighbours.
    if diff.any():
        qi = q.view(torch.uint8)[diff].int()
        ri = own.data.view(torch.uint8)[diff].int()
        assert int((qi - ri).abs().max()) <= 1


def _codes_match(q, ref):
    """At most 0.1 % of FP8 codes differ from the reference's, each by one step (the GPU's
    fp32 division is not IEEE-rounded in every case)."""
    diff = q.float() != ref.float()
    assert float(diff.float().mean()) <= 1e-3
    if diff.any():
        qi = q.view(torch.uint8)[diff].int()
        ri = ref.view(torch.uint8)[diff].int()
        assert int((qi - ri).abs().max()) <= 1


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("per_column", [False, True], ids=["tensorwise", "per_column"])
@pytest.mark.parametrize(("r", "c"), [(8192, 1024), (1000, 300), (4096, 4096)])
def test_transposed_quant_vs_reference(fmt, per_column, r, c):
    from loka_train.kernels import triton_block as tb

    _require_fp8()
    x = (3 * _gauss(r, c)).bfloat16()
    q, s, colsum = tb.transposed_quant(x, fmt=fmt, per_column=per_column, return_colsum=True)
    rq, rs, rcol = tb.transposed_quant_reference(x, fmt=fmt, per_column=per_column, return_colsum=True)
    assert q.shape == (c, r) and q.is_contiguous()
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    _codes_match(q, rq)
    assert float(sqnr_db(rcol, colsum)) > 100  # fp32 sums, another order
    if not per_column:  # the amax a fused producer hands over gives the same result
        q2, s2, _ = tb.transposed_quant(x, fmt=fmt, amax=x.float().abs().amax())
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.mark.parametrize(("m", "k"), [(8192, 1024), (1000, 4096), (4096, 96)])
def test_layernorm_backward_vs_aten(m, k):
    from loka_train.kernels import triton_layernorm as tln

    _require_fp8()
    x = (2 + 3 * _gauss(m, k)).bfloat16()
    w = (1 + 0.1 * _gauss(k, seed=1)).bfloat16()
    b = (0.1 * _gauss(k, seed=2)).bfloat16()
    dy = _gauss(m, k, seed=3).bfloat16()
    _, mean, rstd = torch.native_layer_norm(x, [k], w, b, 1e-5)  # fp32 statistics on CUDA
    ref = torch.ops.aten.native_layer_norm_backward(dy, x, [k], mean, rstd, w, b, [True] * 3)
    got = tln.layernorm_backward(dy, x, mean.reshape(-1), rstd.reshape(-1), w)
    # Both compute in fp32 and round once to bf16: they differ in summation order only.
    for name, r, o in zip(["dx", "dw", "db"], ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert float(sqnr_db(r.float(), o.float())) > 45, name


def test_opcheck_block_kernels_on_cuda():
    from loka_train.kernels import triton_block as tb  # noqa: F401  (registers the ops)
    from loka_train.kernels import triton_layernorm as tln  # noqa: F401  (registers the ops)

    _require_fp8()
    x = _gauss(256, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.loka.transposed_quant.default, (x, None, "e4m3", True, True, None, None, None, None))
    torch.library.opcheck(torch.ops.loka.transposed_quant.default, (x, x.float().abs().amax(), "e5m2", False, False, None, None, None, None))
    mean = x.float().mean(1)
    rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)
    torch.library.opcheck(
        torch.ops.loka.layernorm_backward.default,
        (_gauss(256, 128, seed=1, dtype=torch.bfloat16), x, mean, rstd, torch.ones(128, device=DEV, dtype=torch.bfloat16), True, True, True),
    )


@pytest.mark.parametrize(("m", "k", "n"), [(2048, 256, 256), (8192, 1024, 1024), (1000, 4096, 64), (4096, 512, 2048)])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
def test_triton_gemm_vs_reference(m, k, n, activation, fast_accum):
    from loka_train.kernels import triton_gemm as tg

    _require_fp8()
    a = quantize(_gauss(m, k), Fp8Format.E4M3, Scaling.ROWWISE)
    b = quantize(_gauss(n, k, seed=1), Fp8Format.E4M3, Scaling.ROWWISE)
    bias = _gauss(n, seed=2)
    # Tuned or not as the registry's triton backend (LOKA_TRITON_AUTOTUNE=0: untuned).
    out, _ = tg.fp8_gemm(a.data, b.data, a.scale, b.scale, bias_N=bias, activation=activation,
                         out_dtype=torch.bfloat16, fast_accum=fast_accum,
                         autotune=get_backend("triton").autotune)
    ref, _ = tg.fp8_gemm_reference(a.data, b.data, a.scale, b.scale, bias_N=bias,
                                   activation=activation, out_dtype=torch.float32)
    assert float(sqnr_db(ref, out)) > (35 if fast_accum else 45)


def test_opcheck_rowwise_quant_on_cuda():
    from loka_train.kernels import triton_kernels as tk  # noqa: F401  (registers the ops)

    _require_fp8()
    x = _gauss(64, 128, dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.loka.rowwise_quant.default,
        (x, None, torch.ones(128, device=DEV, dtype=torch.bfloat16), None, 1e-5, True, "relu", "e4m3", True, True),
    )


def test_opcheck_fp8_gemm_on_cuda():
    from loka_train.kernels import triton_gemm as tg  # noqa: F401  (registers the ops)

    _require_fp8()
    a = quantize(_gauss(64, 128), Fp8Format.E4M3, Scaling.ROWWISE)
    b = quantize(_gauss(32, 128, seed=1), Fp8Format.E4M3, Scaling.ROWWISE)
    # test_schema does arithmetic on the (FP8) inputs, which torch does not implement.
    torch.library.opcheck(
        torch.ops.loka.fp8_gemm.default,
        (a.data, b.data, a.scale, b.scale, torch.ones(32, device=DEV), "relu", torch.bfloat16, False, True,
         get_backend("triton").autotune),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("activation", ["relu", "silu"])
@pytest.mark.parametrize("backend", ["triton", "torch_scaled_mm", "tensorwise_grad_weight"])
def test_fused_block_matches_unfused_on_gpu(activation, backend):
    _require_fp8()
    m, k, n = 2048, 512, 256
    params = [
        _gauss(m, k, dtype=torch.bfloat16),
        (1 + 0.1 * _gauss(k, seed=1)).bfloat16(),
        (0.1 * _gauss(k, seed=2)).bfloat16(),
        (_gauss(n, k, seed=3) / 16).bfloat16(),
        _gauss(n, seed=4).bfloat16(),
    ]
    g = _gauss(m, n, seed=5, dtype=torch.bfloat16)

    def run(plan):
        leaves = [p.clone().requires_grad_(True) for p in params]
        y = layernorm_linear(*leaves, plan, activation=activation)
        y.backward(g)
        return [y.detach()] + [p.grad for p in leaves]

    if backend == "tensorwise_grad_weight":
        # dZ^T and H^T from the transposing quantizer with the fused kernels' row amaxes.
        plan = LinearPlan.fp8(backend="torch_scaled_mm")
        plan = dataclasses.replace(plan, grad_weight=dataclasses.replace(plan.grad_weight, scaling=Scaling.TENSORWISE))
        ref_plan = dataclasses.replace(plan, grad_weight=dataclasses.replace(plan.grad_weight, backend="emulated"),
                                       forward=dataclasses.replace(plan.forward, backend="emulated"),
                                       grad_input=dataclasses.replace(plan.grad_input, backend="emulated"))
    else:
        plan, ref_plan = LinearPlan.fp8(backend=backend), LinearPlan.fp8(backend="emulated")
    fused = run(plan)
    unfused = run(ref_plan)
    for i, (r, o) in enumerate(zip(unfused, fused)):
        assert float(sqnr_db(r, o)) > 30, i
    # And close to the bf16 block.
    hp = run(LinearPlan.high_precision())
    assert float(sqnr_db(hp[0], fused[0])) > 20
    ref = F.relu if activation == "relu" else F.silu
    z = ref(F.linear(F.layer_norm(params[0], (k,), params[1], params[2]), params[3], params[4]))
    assert float(sqnr_db(z, hp[0])) > 60


def _fwd_bwd_autocast(fn, x, w, b, g):
    """[y, dx, dw, db] of ``fn(x, w, b)`` under bf16 autocast, from fresh leaves."""
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(*leaves)
    y.backward(g)
    return [y.detach()] + [t.grad for t in leaves]


def _high_plan_and_f_linear(m, k, n):
    """``x``, ``dY`` and the [y, dx, dw, db] of F.linear and of the all-high fp8_linear on them
    under bf16 autocast (M x K input, N x K weight, a bias)."""
    x = _gauss(m, k)
    w = _gauss(n, k, seed=1)
    b = _gauss(n, seed=2)
    g = _gauss(m, n, seed=3, dtype=torch.bfloat16)
    ref = _fwd_bwd_autocast(F.linear, x, w, b, g)
    got = _fwd_bwd_autocast(lambda x, w, b: fp8_linear(x, w, b, LinearPlan.high_precision()), x, w, b, g)
    return x, g, ref, got


@pytest.mark.parametrize(("m", "k", "n"), [(2048, 13, 24), (1024, 256, 512), (8192, 512, 256)])
def test_high_plan_is_f_linear_bit_for_bit_under_autocast(m, k, n):
    """All-high fp8_linear under bf16 autocast runs exactly autograd's GEMMs (the grad-weight
    GEMM as dY^T @ X, not (X^T dY)^T, which cuBLAS computes with another kernel), where the bias
    gradient is a sum of dY (the folded form is the next test's)."""
    assert not folds_bias_grad(LinearPlan.high_precision(), k, n, need_w=True, need_b=True)
    x, g, ref, got = _high_plan_and_f_linear(m, k, n)
    for name, r, o in zip(["y", "dx", "dw", "db"], ref, got):
        assert torch.equal(r, o), name


@pytest.mark.parametrize(("m", "k", "n"), [(2048, 13, 512), (4096, 512, 3456)])
def test_high_plan_with_the_bias_gradient_folded_into_grad_weight(m, k, n):
    """Where the bias gradient comes out of the grad-weight GEMM (``folds_bias_grad``: DCN's
    cross layers), the forward and dx are F.linear's bit for bit; dw is the same product from
    a wider GEMM (another kernel may accumulate in another order: within bf16 rounding); db is
    dY's rows summed in fp32 and rounded once."""
    assert folds_bias_grad(LinearPlan.high_precision(), k, n, need_w=True, need_b=True)
    x, g, ref, got = _high_plan_and_f_linear(m, k, n)
    for name, r, o in zip(["y", "dx"], ref[:2], got[:2]):
        assert torch.equal(r, o), name
    exact_dw = g.float().t() @ x.to(torch.bfloat16).float()
    assert got[2].dtype == ref[2].dtype
    torch.testing.assert_close(got[2].float(), exact_dw, rtol=2**-7, atol=1e-3 * exact_dw.abs().max().item())
    exact_db = g.float().sum(0)
    torch.testing.assert_close(got[3].float(), exact_db, rtol=2**-8, atol=1e-4 * exact_db.abs().max().item())


@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE], ids=lambda s: s.value)
def test_inductor_keeps_the_eager_fp8_codes(scaling):
    """Compiled as the Trainer compiles (inductor, emulate_precision_casts), the reference
    quantizer rounds x to bf16 before dividing, as eager does: same FP8 codes, same results.
    fp32 inputs under bf16 autocast are the case inductor would otherwise fuse away."""
    _require_fp8()
    plan = LinearPlan.fp8(scaling=scaling, backend="torch_scaled_mm")
    x = _gauss(1024, 512)
    w = _gauss(256, 512, seed=1)
    b = _gauss(256, seed=2)
    g = _gauss(1024, 256, seed=3, dtype=torch.bfloat16)

    torch._dynamo.reset()
    fn = lambda x, w, b: fp8_linear(x, w, b, plan)  # noqa: E731
    eager = _fwd_bwd_autocast(fn, x, w, b, g)
    compiled = torch.compile(fn, backend="inductor", options={"emulate_precision_casts": True})
    got = _fwd_bwd_autocast(compiled, x, w, b, g)
    for name, r, o in zip(["y", "dx", "dw", "db"], eager, got):
        assert float(sqnr_db(r.float(), o.float())) > 100, name


@pytest.mark.parametrize("m, k, n", [(8192, 1024, 2048), (4096, 2048, 512)])
def test_tensorwise_site_takes_its_transposes_from_the_quantizing_pass(m, k, n, monkeypatch):
    """Under an all-tensor-wise plan the backward GEMMs get contiguous FP8 transposes written in
    the forward's and grad-input's quantizing passes, and the layer's output and gradients are
    bit for bit those of reusing transposed views (which the backend copies)."""
    from loka_train.kernels import triton_tensorwise

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(m, k, device="cuda", generator=g)
    w0 = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    dy = torch.randn(m, n, device="cuda", generator=g)

    def run():
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_linear(x, w, None, plan)
        y.backward(dy.to(y.dtype))
        return y.detach(), x.grad, w.grad

    both = triton_tensorwise.tensorwise_quant_both
    calls = []

    def counted(t, *, fmt, relu=False, mask=None):
        calls.append(tuple(t.shape))
        return both(t, fmt=fmt, relu=relu, mask=mask)

    monkeypatch.setattr(triton_tensorwise, "tensorwise_quant_both", counted)
    got = run()
    assert calls == [(m, k), (n, k), (m, n)]  # x and W in the forward, dY in the backward

    def one_layout(t, *, fmt, relu=False, mask=None):
        q, scale, _ = both(t, fmt=fmt, relu=relu, mask=mask)
        return q, scale, q.t()

    monkeypatch.setattr(triton_tensorwise, "tensorwise_quant_both", one_layout)
    views = run()
    for a, b in zip(got, views):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_transposed_rows_are_the_reshaped_copy_bit_for_bit(dtype):
    """loka::transposed_rows at Wukong's first-layer shape (32768 x 27 x 128 fp32) and a ragged
    one, against x.to(dtype).reshape(-1, N)."""
    from loka_train.kernels.triton_layout import transposed_rows

    for shape in ((32768, 27, 128), (7, 70, 130)):
        x = torch.randn(*shape, device="cuda").transpose(1, 2)
        want = x.to(dtype).reshape(-1, shape[1])
        assert torch.equal(transposed_rows(x, dtype), want)
        width = -(-shape[1] // 16) * 16 + 64  # zero-padded columns past N, a 64-wide tile of only them
        padded = transposed_rows(x, dtype, width)
        assert torch.equal(padded[:, : shape[1]], want) and not padded[:, shape[1]:].any()


def test_fp8_linear_pads_the_transposed_rows_of_a_27_wide_input_on_the_gpu():
    """Wukong's first projection (K = 27) takes its rows zero-padded to 32 and its weight padded
    to match: the output and the gradients are the unpadded layer's, eager and compiled."""
    from loka_train.kernels.linear import fp8_linear
    from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision

    plan = LinearPlan(forward=GemmPlan(), grad_input=GemmPlan(precision=Precision.FP8), grad_weight=GemmPlan())
    x_BND = torch.randn(256, 27, 128, device="cuda")
    w = torch.randn(64, 27, device="cuda") / 5
    b = torch.randn(64, device="cuda")
    g = torch.randn(256, 128, 64, device="cuda", dtype=torch.bfloat16)

    def run(fn):  # type: ignore[no-untyped-def]
        xb, wl, bl = (t.clone().requires_grad_() for t in (x_BND, w, b))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xb.transpose(1, 2), wl, bl)
        y.backward(g)
        return [y.detach().float(), xb.grad, wl.grad, bl.grad]

    ref = run(lambda x, w_, b_: torch.nn.functional.linear(x, w_, b_))
    eager = run(lambda x, w_, b_: fp8_linear(x, w_, b_, plan))
    compiled = run(torch.compile(lambda x, w_, b_: fp8_linear(x, w_, b_, plan), dynamic=False))
    for got in (eager, compiled):
        torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)  # bf16 forward
        torch.testing.assert_close(got[2], ref[2], rtol=2e-2, atol=0.5)   # bf16 grad-weight
        torch.testing.assert_close(got[3], ref[3], rtol=2e-2, atol=0.5)
        rel = (got[1] - ref[1]).norm() / ref[1].norm()  # the FP8 grad-input (e4m3 operands)
        assert got[1].shape == ref[1].shape and rel < 0.1, float(rel)
