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


def test_the_bias_gradient_folded_into_grad_weight_matches_the_sum_and_captures_in_a_cuda_graph() -> None:
    """A narrow ``K`` (``folds_bias_grad``): the bias gradient is column ``K`` of ``dY^T @ [X, 1,
    0...]``, close to dY's column sums; the backward makes no host copy (it is captured in a
    CUDA graph) and the replay computes what eager code computed, bit for bit."""
    from loka_train.kernels.linear import folds_bias_grad
    from loka_train.kernels.plan import GemmPlan, Precision

    ok, why = fp8_available("cuda")
    if not ok:
        pytest.skip(why)
    plan = LinearPlan(forward=GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm"),
                      grad_input=GemmPlan(), grad_weight=GemmPlan())
    assert folds_bias_grad(plan, 256, 1024, need_w=True, need_b=True)
    torch.manual_seed(5)
    x = torch.randn(4096, 256, device="cuda")
    w = (torch.randn(1024, 256, device="cuda") / 16).requires_grad_()
    b = torch.randn(1024, device="cuda").requires_grad_()
    g = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[Tensor, Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_linear(x, w, b, plan)
        return torch.autograd.grad(y, (w, b), g)

    gw, gb = step()
    ref_b = g.float().sum(0)
    assert gb.dtype == b.dtype and sqnr_db(ref_b, gb) > 40, sqnr_db(ref_b, gb)
    ref_w = g.float().t() @ x.bfloat16().float()
    assert sqnr_db(ref_w, gw) > 40, sqnr_db(ref_w, gw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw_g, gb_g = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gw_g, gw) and torch.equal(gb_g, gb)
