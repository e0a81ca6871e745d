"""The planned GEMMs of the sites: ``y = x W^T + b`` and ``bmm(a, bt)`` with each of their three
GEMMs (forward, grad-input, grad-weight) as a :class:`~loka_train.kernels.plan.LinearPlan` says.

Padding (``pad_to_multiple > 1``): when a backend of an FP8 plan refuses the unpadded shape
(``torch._scaled_mm`` on CUDA needs ``K`` and ``N`` divisible by 16), the GEMM dims ``K``, ``N``
and, when the grad-weight GEMM (which contracts over ``M``) is FP8, ``M`` are zero-padded to the
multiple at call time (``F.pad`` of the input, weight and bias: one copy of each per step) and
the output is sliced back. Backends that take ragged shapes (``emulated``, ``triton``) run
unpadded; the answer is cached per (plan, shape). Zero rows and columns change neither the
amax of any scaling group nor any dot product, so the result equals the unpadded FP8 GEMM up
to fp32 summation order (bit-equal when the arithmetic is exact, see the tests).
High-precision GEMMs are never padded.

Shape legend: ``B`` batches, ``M`` rows, ``K`` contraction (in features), ``N`` out features.

Example:
    >>> y = planned_linear(torch.randn(4, 13), torch.randn(7, 13), None, LinearPlan.fp8(),
    ...                    pad_to_multiple=16)
    >>> y.shape
    torch.Size([4, 7])
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.formats import Scaling, dequantize, quantize
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.linear import compute_dtype, fp8_linear
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend
from loka_train.utils.profiling import profiled

__all__ = ["any_fp8", "fp8_padding", "gemm_plans", "planned_bmm", "planned_linear"]


def any_fp8(plan: LinearPlan) -> bool:
    """Whether any of the plan's three GEMMs runs in FP8."""
    return plan.forward.is_fp8 or plan.grad_input.is_fp8 or plan.grad_weight.is_fp8


def gemm_plans(plan: LinearPlan) -> dict[str, GemmPlan]:
    """Role -> that GEMM's plan."""
    return {"forward": plan.forward, "grad_input": plan.grad_input, "grad_weight": plan.grad_weight}


# --------------------------------------------------------------------------------- linear


def _pad_to(n: int, multiple: int) -> int:
    return (-n) % multiple if multiple > 1 else 0


def _role_problem(role: str, gp: GemmPlan, m: int, k: int, n: int, device_type: str, cdtype: torch.dtype) -> GemmProblem:
    """The backend problem of one role of a ``(M, K) x (K, N)`` linear layer."""
    dims = {"forward": (m, k, n), "grad_input": (m, n, k), "grad_weight": (n, m, k)}[role]
    out_dtype = torch.float32 if role == "grad_weight" else cdtype
    return GemmProblem(
        m=dims[0], k=dims[1], n=dims[2], fmt=gp.fmt, fmt_b=gp.operand_b_fmt, scaling=gp.scaling,
        device_type=device_type, out_dtype=out_dtype, role=role, fast_accum=gp.fast_accum,
    )


def _backends_accept(plan: LinearPlan, m: int, k: int, n: int, device_type: str, cdtype: torch.dtype) -> bool:
    for role, gp in gemm_plans(plan).items():
        if gp.is_fp8 and not get_backend(gp.backend).supports(
            _role_problem(role, gp, m, k, n, device_type, cdtype)
        )[0]:
            return False
    return True


def fp8_padding(
    plan: LinearPlan, m: int, k: int, n: int, multiple: int, device_type: str, cdtype: torch.dtype,
    n_only: bool,
) -> tuple[int, int, int] | None:
    """The zero rows/cols ``(pad_m, pad_k, pad_n)`` of :func:`_padding_for`, cached; keyed also by the backend objects (not only their names),
    so a backend registered anew under the same name is asked again.

    ``m`` may be symbolic (``torch.export`` with a dynamic batch dim): the backends' checks do not
    read ``M`` except block scaling's, and only an FP8 grad-weight pads it, so the padding is
    that of any ``M`` for other plans; for those two it raises (export with a static batch)."""
    if not isinstance(m, int):
        rows_matter = multiple > 1 and (plan.grad_weight.is_fp8 or any(
            gp.is_fp8 and gp.scaling is Scaling.BLOCK for gp in gemm_plans(plan).values()))
        if rows_matter:
            raise ValueError(
                f"a plan whose padding depends on the rows ({plan}) cannot take a symbolic batch "
                "size: export with a static batch (export_dense(..., dynamic_batch=False), or the "
                "export job's dynamic_batch=false)"
            )
        m = 16
    backends = tuple(get_backend(gp.backend) for gp in gemm_plans(plan).values() if gp.is_fp8)
    return _padding_for(plan, backends, m, k, n, multiple, device_type, cdtype, n_only)


@functools.lru_cache(maxsize=4096)
def _padding_for(
    plan: LinearPlan, backends: tuple[object, ...], m: int, k: int, n: int, multiple: int,
    device_type: str, cdtype: torch.dtype, n_only: bool,
) -> tuple[int, int, int] | None:
    """Zero rows/cols ``(pad_m, pad_k, pad_n)`` the plan's FP8 backends need: ``(0, 0, 0)`` when
    they take the shape as it is, None when padding (only ``N`` with ``n_only``) does not help."""
    if multiple <= 1 or _backends_accept(plan, m, k, n, device_type, cdtype):
        return (0, 0, 0)
    pad_m = _pad_to(m, multiple) if plan.grad_weight.is_fp8 and not n_only else 0
    pad_k = 0 if n_only else _pad_to(k, multiple)
    pad = (pad_m, pad_k, _pad_to(n, multiple))
    if pad != (0, 0, 0) and _backends_accept(plan, m + pad[0], k + pad[1], n + pad[2], device_type, cdtype):
        return pad
    return None


def planned_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: LinearPlan,
    *,
    pad_to_multiple: int = 1,
    compiled_quantizer: str = "custom",
    static_slots: Tensor | None = None,
    input_relu: bool = False,
    mask_bits: bool = False,
    input_relu_grad: bool = True,
    output_relu: bool = False,
) -> Tensor:
    """``y = x W^T + b`` with each GEMM as ``plan`` says, FP8 dims zero-padded where needed
    (of ``relu(x)`` with ``input_relu``).

    An all-HIGH plan calls ``F.linear`` (bit-identical to ``nn.Linear``, also in its
    gradients); otherwise :func:`loka_train.kernels.fp8_linear` runs, on zero-padded operands
    when ``pad_to_multiple > 1`` and a backend of the plan refuses the unpadded shape (see the
    module docstring).

    Args:
        x: ``(..., K)``.
        weight: ``(N, K)``.
        bias: ``(N,)`` or None (added in high precision).
        plan: per-GEMM plans.
        pad_to_multiple: pad multiple for FP8 GEMMs (1: no padding).
        compiled_quantizer: what quantizes under ``torch.compile`` (``mods.compiled_quantizer``).
        static_slots: static-scale slots of ``x`` and ``dY`` (``kernels.fp8_linear``), or None.
        input_relu: the layer takes ``torch.relu(x)``: applied by the FP8 cast of ``x`` where
            ``kernels.fp8_linear`` folds it, else computed first (and always for a padded call).
        mask_bits: the folded ReLU's mask kept as bits (``kernels.fp8_linear``).
        input_relu_grad, output_relu: as ``kernels.fp8_linear`` takes them; a padded call or
            an all-high plan applies ``output_relu``'s mask as a ReLU on its output.

    Returns:
        ``(..., N)``.
    """
    if not any_fp8(plan):
        y = F.linear(torch.relu(x) if input_relu else x, weight, bias)
        return torch.relu(y) if output_relu else y
    n, k = weight.shape
    m = x.numel() // k if k else 0  # not x.reshape(-1, k): that copies a non-contiguous x
    pad = fp8_padding(plan, m, k, n, pad_to_multiple, x.device.type, compute_dtype(x), False)
    if pad is None or pad == (0, 0, 0):
        # None: padding cannot help; fp8_linear raises with the backend's reason.
        return fp8_linear(x, weight, bias, plan, compiled_quantizer=compiled_quantizer, static_slots=static_slots,
                          input_relu=input_relu, mask_bits=mask_bits, input_relu_grad=input_relu_grad,
                          output_relu=output_relu)
    if input_relu:
        x = torch.relu(x)
    pad_m, pad_k, pad_n = pad
    with profiled("loka/mods/pad"):
        xp = F.pad(x.reshape(-1, k), (0, pad_k, 0, pad_m))
        wp = F.pad(weight, (0, pad_k, 0, pad_n))
        bp = None if bias is None else F.pad(bias, (0, pad_n))
    y_MN = fp8_linear(xp, wp, bp, plan, compiled_quantizer=compiled_quantizer, static_slots=static_slots)[:m, :n]
    y = y_MN.reshape(*x.shape[:-1], n)
    return torch.relu(y) if output_relu else y


# ------------------------------------------------------------------------------------ bmm


def _fp8_bmm(a_BMK: Tensor, b_BNK: Tensor, plan: GemmPlan, axes: tuple[int, int]) -> Tensor:
    """``a @ b^T`` per batch with both operands quantized along ``axes`` (emulated backend)."""
    qa = quantize(a_BMK, plan.fmt, plan.scaling, axis=axes[0])
    qb = quantize(b_BNK, plan.operand_b_fmt, plan.scaling, axis=axes[1])
    return torch.bmm(dequantize(qa), dequantize(qb).transpose(1, 2))


class _PlannedBmmFn(torch.autograd.Function):
    """``torch.bmm(a, bt)`` whose three GEMMs follow a LinearPlan (roles as for a linear layer
    with ``x = a`` and ``W = bt^T`` per batch)."""

    @staticmethod
    def forward(ctx, a_BMK: Tensor, bt_BKN: Tensor, plan: LinearPlan) -> Tensor:
        dev = a_BMK.device.type
        cdtype = compute_dtype(a_BMK)
        with torch.autocast(dev, enabled=False):
            a = a_BMK.to(cdtype)
            bt = bt_BKN.to(cdtype)
            if plan.forward.is_fp8:
                # Both operands along K: a is (B, M, K), b = bt^T is (B, N, K).
                y = _fp8_bmm(a, bt.transpose(1, 2), plan.forward, (-1, -1)).to(cdtype)
            else:
                y = torch.bmm(a, bt)
        ctx.save_for_backward(a, bt)
        ctx.plan = plan
        ctx.dtypes = (a_BMK.dtype, bt_BKN.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        a, bt = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        need_a, need_b = ctx.needs_input_grad[:2]
        grad_a = grad_bt = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g_BMN = grad_y.to(a.dtype)
            if need_a:
                # dA = dY @ b: contraction over N (dY along its last dim, b = bt^T along dim 1).
                if plan.grad_input.is_fp8:
                    grad_a = _fp8_bmm(g_BMN, bt, plan.grad_input, (-1, -1))
                else:
                    grad_a = g_BMN.bmm(bt.transpose(1, 2))
                grad_a = grad_a.to(ctx.dtypes[0])
            if need_b:
                # d(bt) = a^T @ dY: contraction over M.
                if plan.grad_weight.is_fp8:
                    grad_b_BNK = _fp8_bmm(
                        g_BMN.transpose(1, 2), a.transpose(1, 2), plan.grad_weight, (-1, -1)
                    )
                    grad_bt = grad_b_BNK.transpose(1, 2)
                else:
                    grad_bt = a.transpose(1, 2).bmm(g_BMN)
                grad_bt = grad_bt.to(ctx.dtypes[1])
        return grad_a, grad_bt, None


def _planned_bmm_impl(
    a_BMK: Tensor, bt_BKN: Tensor, plan: str, autocast_dtype: torch.dtype | None, needs_grad: list[bool]
) -> list[Tensor]:
    return opaque.run_forward(
        "planned_bmm", (a_BMK, bt_BKN, LinearPlan.from_key(plan)), needs_grad, autocast_dtype,
        a_BMK.device.type,
    )


_planned_bmm_op = opaque.define("planned_bmm", _PlannedBmmFn, _planned_bmm_impl, num_extra_args=2)
"""``planned_bmm`` as one opaque op for compiled code (``kernels.opaque``)."""


def planned_bmm(
    a_BMK: Tensor, bt_BKN: Tensor, plan: LinearPlan, *, compiled_quantizer: str = "custom"
) -> Tensor:
    """``torch.bmm(a, bt)`` with its three GEMMs as ``plan`` says (FP8 emulated).

    The roles are those of a linear layer with input ``a`` and weight ``bt^T`` per batch:
    forward ``a @ bt``, grad-input ``dY @ bt^T``, grad-weight ``a^T @ dY`` (the gradient of
    ``bt``). An all-HIGH plan calls ``torch.bmm`` itself.

    Example:
        >>> y = planned_bmm(torch.randn(2, 5, 8), torch.randn(2, 8, 5), LinearPlan.fp8())
    """
    if not any_fp8(plan):
        return torch.bmm(a_BMK, bt_BKN)
    if opaque.opaque(compiled_quantizer):
        return _planned_bmm_op(
            a_BMK, bt_BKN, plan.key, opaque.autocast_dtype(a_BMK.device.type),
            opaque.needs_grad(a_BMK, bt_BKN),
        )[0]
    return _PlannedBmmFn.apply(a_BMK, bt_BKN, plan)
