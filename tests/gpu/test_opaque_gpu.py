"""Compiled FP8 Functions on the GPU backends (``kernels.opaque``): a loop of FP8 linears and
a fused LayerNorm -> FP8 Linear compile as one graph (``fullgraph=True``) under bf16 autocast,
on every FP8 backend, and compute what eager code computes (bit for bit with ``aot_eager``:
the same kernels run inside the ops; close with inductor, which fuses the code around them).

Runs on the GPU machine (skipped without CUDA): `pytest tests/gpu/test_opaque_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from loka_train.kernels import Fp8Format, LinearPlan, Scaling, fp8_linear, sqnr_db
from loka_train.kernels.capability import fp8_available
from loka_train.kernels.fused import layernorm_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tower(x: Tensor, ws: list[Tensor], plan: LinearPlan, lnw: Tensor, lnb: Tensor, w2: Tensor) -> Tensor:
    x0 = x
    for w in ws:  # DCN's cross layers: a loop over FP8 sites
        x = x0 * fp8_linear(x, w, None, plan) + x
    return layernorm_linear(x, lnw, lnb, w2, None, plan, activation="relu").float().square().mean()


def _params() -> list[Tensor]:
    torch.manual_seed(0)
    dev = "cuda"
    ts = [torch.randn(512, 256, device=dev)] + [torch.randn(256, 256, device=dev) / 16 for _ in range(3)]
    ts += [torch.rand(256, device=dev) + 0.5, torch.randn(256, device=dev) / 10, torch.randn(128, 256, device=dev) / 16]
    return [t.requires_grad_() for t in ts]


def _run(fn, params: list[Tensor], plan: LinearPlan) -> tuple[Tensor, tuple[Tensor, ...]]:
    x, w0, w1, w2, lnw, lnb, wo = params
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fn(x, [w0, w1, w2], plan, lnw, lnb, wo)
    return loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize(
    "backend, scaling",
    [("torch_scaled_mm", Scaling.ROWWISE), ("torch_scaled_mm", Scaling.TENSORWISE),
     ("fbgemm_rowwise", Scaling.ROWWISE), ("triton", Scaling.ROWWISE)],
)
def test_compiled_fp8_tower_is_one_graph_and_matches_eager(backend: str, scaling: Scaling) -> None:
    ok, why = fp8_available()
    if not ok:
        pytest.skip(why)
    # fbgemm's row-wise GEMM takes e4m3 only: the backward's dY in e4m3 too.
    fmt_bwd = Fp8Format.E4M3 if backend == "fbgemm_rowwise" else Fp8Format.E5M2
    plan = LinearPlan.fp8(fmt_bwd=fmt_bwd, scaling=scaling, backend=backend)
    params = _params()
    loss, grads = _run(_tower, params, plan)
    for compiler in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(_tower, backend=compiler, fullgraph=True, dynamic=False)
        loss_c, grads_c = _run(compiled, params, plan)
        for g, gc in zip(grads, grads_c, strict=True):
            assert g.dtype == gc.dtype
            if compiler == "aot_eager":
                assert torch.equal(g, gc), (compiler, (g - gc).abs().max())
            else:
                assert sqnr_db(g.float(), gc.float()) > 25, (compiler, sqnr_db(g.float(), gc.float()))
        if compiler == "aot_eager":
            assert torch.equal(loss, loss_c)


def test_inductor_fuses_the_traced_bias_gradient_into_the_kernel_that_writes_dy_on_the_gpu() -> None:
    """DCN's fused cross layer at a training-like width, compiled for the GPU: the bias gradient
    of the FP8 site (a column sum of ``dY = x0 * g``) is summed in the Triton kernel that writes
    ``dY``, launched before the op's backward, not by a reduction of its own after it."""
    from loka_train.kernels.plan import GemmPlan, Precision
    from tests.inductor_code import backward_code

    ok, why = fp8_available("cuda")
    if not ok:
        pytest.skip(why)
    plan = LinearPlan(forward=GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm"),
                      grad_input=GemmPlan(), grad_weight=GemmPlan())

    def layer(x0: Tensor, xv: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return torch.addcmul(x0, x0, fp8_linear(xv, w, b, plan))

    torch.manual_seed(4)
    shapes = ((4096, 1024), (4096, 256), (1024, 256), (1024,))
    params = (torch.randn(*s, device="cuda", requires_grad=True) for s in shapes)
    lines, op_at = backward_code(layer, *params, autocast="cuda")
    launches = [(i, ln.split(".run(")[0]) for i, ln in enumerate(lines) if ln.startswith("triton_") and ".run(" in ln]
    # The kernel that multiplies (writes dY) also sums, before the op (a split reduction's
    # second stage may follow anywhere: it reads partial sums only).
    assert any("mul" in name and "sum" in name and i < op_at for i, name in launches), launches
