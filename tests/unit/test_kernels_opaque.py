"""``kernels.opaque``: under torch.compile, LoKA's FP8 Functions (``fp8_linear``,
``layernorm_linear``, ``planned_bmm``) are opaque custom ops: a loop over FP8 layers compiles as
one graph (``fullgraph=True`` raises at any graph break) and computes what eager code computes,
bit for bit, gradients included."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._dynamo.testing import AotEagerAndRecordGraphs

from loka_train.kernels import LinearPlan, Scaling, fp8_linear, opaque
from loka_train.kernels.fused import layernorm_linear
from loka_train.mods.planned import planned_bmm


def _tower(
    x: Tensor, ws: list[Tensor], plans: tuple[LinearPlan, LinearPlan], lnw: Tensor, lnb: Tensor, w2: Tensor
) -> Tensor:
    """A DCN-like loop of FP8 linears, a fused LayerNorm -> FP8 Linear -> ReLU and an FP8 bmm."""
    plan, bmm_plan = plans
    x0 = x
    for w in ws:
        x = x0 * fp8_linear(x, w, None, plan) + x
    y = layernorm_linear(x, lnw, lnb, w2, None, plan, activation="relu")
    z = planned_bmm(y.reshape(4, -1, 8), y.reshape(4, -1, 8).transpose(1, 2), bmm_plan)
    return z.square().mean() + y.square().mean()


def _inputs() -> list[Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    ws = [torch.randn(32, 32) / 4 for _ in range(3)]
    return [t.requires_grad_() for t in (x, *ws, torch.rand(32) + 0.5, torch.randn(32) / 10, torch.randn(16, 32) / 4)]


def _run(
    fn, params: list[Tensor], plans: tuple[LinearPlan, LinearPlan], autocast: bool
) -> tuple[Tensor, tuple[Tensor, ...]]:
    x, w0, w1, w2, lnw, lnb, wo = params
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, [w0, w1, w2], plans, lnw, lnb, wo)
    return loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize(
    "scaling, autocast, backend",
    # Tensor-wise: the forward hands its FP8 operands to the backward (saved op outputs).
    # triton (interpreted here): the fused and transposing quantizers and the Triton GEMM run
    # inside the ops, and through torch.ops while the ops' fake implementations trace them.
    [(Scaling.ROWWISE, False, "emulated"), (Scaling.TENSORWISE, False, "emulated"),
     (Scaling.ROWWISE, True, "emulated"), (Scaling.ROWWISE, False, "triton"),
     (Scaling.TENSORWISE, False, "triton")],
)
def test_compiled_fp8_loop_is_one_graph_and_matches_eager_bit_for_bit(
    scaling: Scaling, autocast: bool, backend: str
) -> None:
    # The bmm site runs FP8 on the emulated backend only.
    plan = LinearPlan.fp8(scaling=scaling, backend=backend)
    bmm_plan = LinearPlan.fp8(scaling=scaling)
    params = _inputs()
    loss, grads = _run(_tower, params, (plan, bmm_plan), autocast)
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(_tower, backend=backend, fullgraph=True, dynamic=False)
    loss_c, grads_c = _run(compiled, params, (plan, bmm_plan), autocast)
    assert torch.equal(loss, loss_c)
    for g, gc in zip(grads, grads_c, strict=True):
        assert g.dtype == gc.dtype and torch.equal(g, gc)
    ops = [str(n.target) for g in backend.fw_graphs + backend.bw_graphs for n in g.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("loka.")]
    assert ops.count("loka.planned_linear.default") == 3, ops
    assert ops.count("loka.layernorm_linear.default") == 1 and ops.count("loka.planned_bmm.default") == 1, ops
    assert ops.count("loka.fn_backward.default") == 5, ops


def test_eager_code_keeps_the_autograd_functions() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    y = fp8_linear(x, torch.randn(3, 8), None, LinearPlan.fp8())
    assert type(y.grad_fn).__name__ == "_PlannedLinearFnBackward"
    assert not opaque.opaque("custom")


def test_the_ops_run_eagerly_with_the_functions_gradients() -> None:
    """The op itself (what compiled code calls) outside compile: same output and gradients."""
    from loka_train.kernels.linear import _planned_linear_op

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE)
    torch.manual_seed(1)
    x, w, b = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True), torch.randn(5, requires_grad=True)
    y = fp8_linear(x, w, b, plan)
    g = torch.autograd.grad(y.square().sum(), (x, w, b))
    y_op = _planned_linear_op(x, w, b, plan.key, None, False, True, None, False, False, None, None, None, False, None,
                              opaque.needs_grad(x, w, b))[0]
    g_op = torch.autograd.grad(y_op.square().sum(), (x, w, b))
    assert torch.equal(y, y_op)
    for a, c in zip(g, g_op, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("mask", ["x", "bits"])
def test_the_op_masks_the_gradient_of_x_with_the_folded_relus_mask(mask: str) -> None:
    """A folded ReLU's mask handed to the op (its ``relu_mask``: ``x`` or its bits) masks the
    gradient of ``x`` in the op's own backward: output and gradients are those of the linear
    of ``relu(x)``, bit for bit. Without a mask the op refuses to run where ``x`` needs a
    gradient (its Function returns the gradient for ``relu(x)``, unmasked)."""
    from loka_train.kernels.linear import _planned_linear_op, relu_mask_bits

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
    torch.manual_seed(1)
    x, w, b = torch.randn(6, 16, requires_grad=True), torch.randn(5, 16, requires_grad=True), torch.randn(5, requires_grad=True)
    y = fp8_linear(torch.relu(x), w, b, plan)
    g = torch.autograd.grad(y.square().sum(), (x, w, b))
    given = x.detach() if mask == "x" else relu_mask_bits(x.detach())
    y_op = _planned_linear_op(x, w, b, plan.key, None, False, True, None, True, False, None, None, given, False,
                              None, opaque.needs_grad(x, w, b))[0]
    g_op = torch.autograd.grad(y_op.square().sum(), (x, w, b))
    assert torch.equal(y, y_op)
    for a, c in zip(g, g_op, strict=True):
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="relu_mask"):
        _planned_linear_op(x, w, b, plan.key, None, False, True, None, True, False, None, None, None, False, None,
                           opaque.needs_grad(x, w, b))


def test_a_ctx_attribute_that_is_not_plain_data_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="dynamic=False"):
        opaque._encode(object())


def test_plans_round_trip_through_their_key() -> None:
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton", grad_weight_fp8=False)
    assert LinearPlan.from_key(plan.key) == plan
    assert plan.key != LinearPlan.fp8().key


@pytest.mark.parametrize("autocast", [False, True])
def test_the_bias_gradient_is_traced_in_the_ops_backward_and_matches_eager(autocast: bool) -> None:
    """Under compile the op's registered backward sums dY's rows as a node of the backward graph
    (inductor fuses it into dY's producer; opaque.define's traced_grads), in the compute dtype
    named (the backward is traced under the forward's autocast, where CUDA would sum bf16 into
    fp32), bit for bit the eager gradient."""
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE)

    def layer(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return torch.relu(fp8_linear(x, w, b, plan)).square().mean()

    torch.manual_seed(2)
    params = [torch.randn(12, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True),
              torch.randn(6, requires_grad=True)]

    def grads(fn) -> tuple[Tensor, ...]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*params)
        return torch.autograd.grad(loss, params)

    eager = grads(layer)
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    compiled = grads(torch.compile(layer, backend=backend, fullgraph=True, dynamic=False))
    for g, gc in zip(eager, compiled, strict=True):
        assert g.dtype == gc.dtype and torch.equal(g, gc)
    (bw,) = backend.bw_graphs
    nodes = list(bw.graph.nodes)
    sums = [n for n in nodes if n.op == "call_function" and str(n.target) == "aten.sum.dim_IntList"]
    assert len(sums) == 1 and sums[0].args[1] == [0]
    assert sums[0].kwargs.get("dtype") == (torch.bfloat16 if autocast else torch.float32)
    # Traced before the op: the node inductor can fuse with dY's producer (next test).
    (op,) = [n for n in nodes if n.op == "call_function" and "fn_backward" in str(n.target)]
    assert nodes.index(sums[0]) < nodes.index(op)


def test_inductor_fuses_the_traced_bias_gradient_into_the_kernel_that_writes_dy() -> None:
    """DCN's fused cross layer: ``addcmul(x, x0, fp8_linear(xv, W, b))`` with the op's backward in
    high precision. The bias gradient (a column sum of ``dY = x0 * g``) is computed in the kernel
    that writes ``dY``, before the op, as inductor does for ``F.linear``'s; traced after the op,
    it was a kernel of its own that read ``g`` and ``x0`` again. (The CPU's code; on a GPU,
    inductor's split reductions may still sum in a kernel of their own.)"""
    from loka_train.kernels.plan import GemmPlan, Precision
    from tests.inductor_code import backward_code

    plan = LinearPlan(forward=GemmPlan(precision=Precision.FP8), grad_input=GemmPlan(), grad_weight=GemmPlan())

    def layer(x0: Tensor, xv: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return torch.addcmul(x0, x0, fp8_linear(xv, w, b, plan))

    torch.manual_seed(3)
    params = (torch.randn(*s, requires_grad=True) for s in ((64, 24), (64, 8), (24, 8), (24,)))
    lines, op_at = backward_code(layer, *params)
    calls = [(i, ln.split("(")[0]) for i, ln in enumerate(lines)  # kernel calls, not their definitions
             if ln.startswith("cpp_fused_") and " = " not in ln.split("(")[0]]
    summing = [(i, name) for i, name in calls if "sum" in name]
    assert len(summing) == 1, calls
    at, name = summing[0]
    assert at < op_at and "mul" in name, calls
