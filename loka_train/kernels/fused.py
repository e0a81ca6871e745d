"""LayerNorm -> Linear -> activation, the block recommendation MLPs are made of, with FP8
quantization fused into the kernels that produce each GEMM operand.

``layernorm_linear(x, ln_w, ln_b, W, b, plan, activation="relu")`` equals
``act(F.linear(F.layer_norm(x, ...), W, b))`` with the linear's three GEMMs following
``plan``. When a GEMM is FP8 with row-wise scales on a backend that takes the fused quantizer
(triton, torch_scaled_mm, fbgemm_rowwise; see ``linear.use_fused_quantizer``):

* forward: one kernel computes LayerNorm and quantizes its output per row (also writing the
  bf16 LayerNorm output that the grad-weight GEMM needs, and mean/rstd for LayerNorm's
  backward); the Triton FP8 GEMM applies scales, bias and the activation in its epilogue
  (other backends: bias in their epilogue, the activation as a separate op);
* grad-input: one kernel applies ReLU's backward (``dZ = dY * (Y > 0)``) and quantizes ``dZ``
  per row (writing ``dZ`` in bf16 too, for the grad-weight GEMM and the bias gradient);
  ``W^T`` is quantized without a transposed copy (``triton_block.transposed_quant``);
* grad-weight, FP8 tensor-wise: ``dZ^T`` and ``H^T`` come from the transposing quantizer
  with the amaxes the two fused kernels computed on the way (``H^T`` recomputed from ``x``
  and the LayerNorm statistics, so the forward writes no ``H``), and the bias gradient is
  summed in the same pass over ``dZ``; row-wise: per-column scales, a column-amax pass first;
* LayerNorm's backward: one Triton kernel (``triton_layernorm.layernorm_backward``).

Other plans run the same math unfused (LayerNorm, then :func:`fp8_gemm_planned` or a plain
matmul, and ``aten.native_layer_norm_backward``); the numerics are those of the plan either
way, up to summation order.

Shape legend: ``M`` rows, ``K`` features in (normalized dim), ``N`` features out.

Example:
    >>> from loka_train.kernels.plan import LinearPlan
    >>> x = torch.randn(16, 32, requires_grad=True)
    >>> ln_w, ln_b = torch.ones(32), torch.zeros(32)
    >>> w, b = torch.randn(8, 32, requires_grad=True), torch.zeros(8)
    >>> y = layernorm_linear(x, ln_w, ln_b, w, b, LinearPlan.fp8(), activation="relu")
    >>> y.sum().backward()
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.backends import TritonBackend
from loka_train.kernels.formats import Fp8Format, QTensor, Scaling
from loka_train.kernels.linear import (
    compute_dtype,
    fp8_gemm_planned,
    grad_weight_dtype,
    inductor_quantizes,
    quantize_operand,
    run_backend,
    use_fused_quantizer,
    use_transposed_quantizer,
)
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend

logger = logging.getLogger(__name__)

__all__ = ["layernorm_linear", "layernorm_linear_served", "FUSED_ACTIVATIONS", "apply_activation", "fuses_quantizer"]

FUSED_ACTIVATIONS = ("none", "relu", "silu")


def fuses_quantizer(plan: GemmPlan, t: Tensor, reference_quantizer: bool) -> bool:
    """Whether an FP8 GEMM of ``plan`` on operand ``t`` takes its operand from the kernel that
    produces it (LayerNorm's for the forward, ReLU's backward for grad-input): row-wise on a
    backend that takes the fused quantizer, where Triton runs and inductor does not quantize."""
    return plan.is_fp8 and use_fused_quantizer(plan, t, plan.fmt, reference_quantizer=reference_quantizer)


def _transposable(plan: GemmPlan, t_MC: Tensor, fmt: Fp8Format, reference_quantizer: bool) -> bool:
    """Whether the grad-weight GEMM's operand ``t^T`` (in ``fmt``) takes the transposing
    quantizer."""
    return plan.is_fp8 and use_transposed_quantizer(
        plan, t_MC.t(), fmt, reference_quantizer=reference_quantizer
    )


def _gemm_act(plan, a_q, b_q, *, bias, activation, out_dtype, role):
    """``act(a @ b^T + bias)``: in the Triton GEMM's epilogue (the registered ``triton``
    backend's ``fused``, with its autotune setting), or the backend then ``act``.

    Returns ``(out, preact)``; ``preact`` is None unless SiLU needs it for backward.
    """
    backend = get_backend(plan.backend)
    if isinstance(backend, TritonBackend):
        out, pre = backend.fused(
            a_q, b_q, bias=bias, activation=activation, out_dtype=out_dtype,
            fast_accum=plan.fast_accum, return_preact=activation == "silu",
        )
        return out, (pre if activation == "silu" else None)
    z = run_backend(plan, a_q, b_q, out_dtype=out_dtype, role=role, bias_N=bias)
    return apply_activation(z, activation), (z if activation == "silu" else None)


def layernorm_linear_served(
    x_MK: Tensor,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    eps: float,
    w_q: QTensor,
    bias: Tensor | None,
    plan: GemmPlan,
    *,
    activation: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """The forward of :func:`layernorm_linear` with the weight quantized beforehand (``w_q``,
    as the op's forward quantizes it): the LayerNorm kernel emits the row-wise FP8 input, the
    GEMM takes it with ``w_q`` and applies the bias and activation in its epilogue where the
    backend can. For inference (no autograd); ``plan`` a row-wise forward that
    :func:`fuses_quantizer` takes, ``x_MK`` in the compute dtype."""
    from loka_train.kernels import triton_kernels as tk

    q, s, _, _, _, _ = tk.fused_rowwise_quant(
        x_MK, fmt=plan.fmt, layernorm=True, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps,
    )
    h_q = QTensor(data=q, scale=s, fmt=plan.fmt, scaling=Scaling.ROWWISE, axis=1)
    return _gemm_act(plan, h_q, w_q, bias=bias, activation=activation, out_dtype=out_dtype, role="forward")[0]


def apply_activation(z: Tensor, activation: str) -> Tensor:
    """``activation`` (one of :data:`FUSED_ACTIVATIONS`) of ``z``, as the fused op applies it."""
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return F.silu(z)
    return z


class _LnLinearActFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, plan, activation, eps, out_dtype, reference_quantizer):
        from loka_train.kernels import triton_kernels as tk
        from loka_train.kernels.triton_block import transposed_quant

        rq = reference_quantizer
        dev = x.device.type
        cdtype = compute_dtype(x)
        k = x.shape[-1]
        with torch.autocast(dev, enabled=False):
            x_MK = x.reshape(-1, k).to(cdtype)
            wc = weight.to(cdtype)
            bc = None if bias is None else bias.to(cdtype)
            lnw = None if ln_weight is None else ln_weight.to(cdtype)
            lnb = None if ln_bias is None else ln_bias.to(cdtype)
            odtype = cdtype if out_dtype is None else out_dtype
            fwd = plan.forward
            gw = plan.grad_weight
            pre_MN = None
            # The grad-weight GEMM's H^T, quantized here (then H itself need not be kept).
            h_t_q = None
            fused_ln = fuses_quantizer(fwd, x_MK, rq)
            if fused_ln:
                need_w_grad = ctx.needs_input_grad[3]
                tensorwise_gw = (
                    need_w_grad
                    and gw.scaling is Scaling.TENSORWISE
                    and _transposable(gw, x_MK, gw.operand_b_fmt, rq)
                )
                q, s, h_MK, mean, rstd, h_amax = tk.fused_rowwise_quant(
                    x_MK, fmt=fwd.fmt, layernorm=True, ln_weight=lnw, ln_bias=lnb, eps=eps,
                    # H only for a grad-weight GEMM that does not take H^T from x.
                    return_hp=need_w_grad and not tensorwise_gw, return_amax=tensorwise_gw,
                )
                if tensorwise_gw:
                    # H^T straight from x and the statistics, with the tensor-wise amax the
                    # fused kernel computed: H is neither written nor kept.
                    hq, hs, _ = transposed_quant(
                        x_MK, fmt=gw.operand_b_fmt, amax=h_amax, ln_mean=mean, ln_rstd=rstd,
                        ln_weight=lnw, ln_bias=lnb,
                    )
                    h_t_q = QTensor(data=hq, scale=hs, fmt=gw.operand_b_fmt,
                                    scaling=Scaling.TENSORWISE, axis=1)
                    h_MK = None
                w_q = quantize_operand(
                    wc, fwd.operand_b_fmt, fwd, is_weight=True, reference_quantizer=rq, count_fallbacks=True
                )
                h_q = QTensor(data=q, scale=s, fmt=fwd.fmt, scaling=Scaling.ROWWISE, axis=1)
                y_MN, pre_MN = _gemm_act(
                    fwd, h_q, w_q, bias=bc, activation=activation, out_dtype=odtype, role="forward"
                )
            else:
                h_MK, mean, rstd = torch.native_layer_norm(x_MK, [k], lnw, lnb, eps)
                if fwd.is_fp8:
                    z_MN = fp8_gemm_planned(
                        h_MK, wc, fwd, out_dtype=odtype, role="forward", bias_N=bc,
                        b_is_weight=True, reference_quantizer=rq, count_fallbacks=True,
                    )
                else:
                    z_MN = F.linear(h_MK, wc, bc).to(odtype)
                y_MN = apply_activation(z_MN, activation)
                if activation == "silu":
                    pre_MN = z_MN
        ctx.save_for_backward(
            x_MK, h_MK, mean, rstd, lnw, lnb, wc, y_MN, pre_MN,
            *((None, None) if h_t_q is None else (h_t_q.data, h_t_q.scale)),
        )
        ctx.plan, ctx.activation, ctx.cdtype = plan, activation, cdtype
        ctx.reference_quantizer = rq
        # Statistics from the fused kernel are fp32 (M,): Triton's LayerNorm backward takes them.
        ctx.fused_ln = fused_ln
        ctx.dtypes = tuple(
            None if t is None else t.dtype for t in (x, ln_weight, ln_bias, weight, bias)
        )
        return y_MN.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        from loka_train.kernels import triton_kernels as tk
        from loka_train.kernels.triton_block import transposed_quant
        from loka_train.kernels.triton_layernorm import layernorm_backward

        x_MK, h_MK, mean, rstd, lnw, lnb, wc, y_MN, pre_MN, hq_data, hq_scale = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        rq: bool = ctx.reference_quantizer
        cdtype = ctx.cdtype
        x_dt, lnw_dt, lnb_dt, w_dt, b_dt = ctx.dtypes
        need = ctx.needs_input_grad
        with torch.autocast(grad_y.device.type, enabled=False):
            # Contiguous, so that every layout of grad_y (expanded, strided) takes the same kernels
            # and gives the same gradients.
            dy_MN = grad_y.reshape(-1, grad_y.shape[-1]).to(cdtype).contiguous()
            dz_q = None
            dz_amax = None
            gi, gw = plan.grad_input, plan.grad_weight
            # dZ^T for an FP8 grad-weight GEMM comes from the transposing quantizer, which also
            # sums dZ's columns (the bias gradient) in the same read.
            gw_transposed = need[3] and _transposable(gw, dy_MN, gw.fmt, rq)
            if ctx.activation == "relu" and fuses_quantizer(gi, dy_MN, rq):
                q, s, dz_MN, _, _, dz_amax = tk.fused_rowwise_quant(
                    dy_MN, fmt=gi.fmt, gate=y_MN, return_hp=True,
                    return_amax=gw_transposed and gw.scaling is Scaling.TENSORWISE,
                )
                dz_q = QTensor(data=q, scale=s, fmt=gi.fmt, scaling=Scaling.ROWWISE, axis=1)
            elif ctx.activation == "relu":
                dz_MN = torch.where(y_MN > 0, dy_MN, torch.zeros_like(dy_MN))
            elif ctx.activation == "silu":
                sig = torch.sigmoid(pre_MN.float())
                dz_MN = (dy_MN.float() * sig * (1 + pre_MN.float() * (1 - sig))).to(cdtype)
            else:
                dz_MN = dy_MN

            # grad-input of the linear: dH = dZ W.
            if gi.is_fp8 and dz_q is not None:
                w_t = quantize_operand(
                    wc.t(), gi.operand_b_fmt, gi, is_weight=True, reference_quantizer=rq, count_fallbacks=True
                )
                dh_MK = run_backend(gi, dz_q, w_t, out_dtype=cdtype, role="grad_input")
            elif gi.is_fp8:
                dh_MK = fp8_gemm_planned(
                    dz_MN, wc.t(), gi, out_dtype=cdtype, role="grad_input", b_is_weight=True,
                    reference_quantizer=rq, count_fallbacks=True,
                )
            else:
                dh_MK = dz_MN.mm(wc)

            grad_w = grad_b = None
            need_db = need[4] and b_dt is not None
            if need[3]:
                if gw.is_fp8:
                    dz_t_q = None
                    if gw_transposed:
                        tensorwise = gw.scaling is Scaling.TENSORWISE
                        # From the fused ReLU-backward kernel (tensor-wise only), else computed.
                        amax = dz_amax if tensorwise else None
                        q, s, colsum = transposed_quant(
                            dz_MN, fmt=gw.fmt, amax=amax, per_column=not tensorwise,
                            return_colsum=need_db,
                        )
                        dz_t_q = QTensor(data=q, scale=s, fmt=gw.fmt, scaling=gw.scaling, axis=1)
                        if need_db:
                            # Rounded to the compute dtype as dZ.sum(0) is: the bias gradient
                            # does not depend on which path summed it.
                            grad_b = colsum.to(cdtype).to(b_dt)
                    h_t_q = None
                    if hq_data is not None:
                        h_t_q = QTensor(data=hq_data, scale=hq_scale, fmt=gw.operand_b_fmt,
                                        scaling=Scaling.TENSORWISE, axis=1)
                    grad_w = fp8_gemm_planned(
                        dz_MN.t(), None if h_MK is None else h_MK.t(), gw,
                        out_dtype=grad_weight_dtype(w_dt), role="grad_weight", a_q=dz_t_q,
                        b_q=h_t_q, reference_quantizer=rq, count_fallbacks=True,
                    ).to(w_dt)
                else:
                    grad_w = dz_MN.t().mm(h_MK).to(w_dt)  # autograd's order (see linear.py)
            if need_db and grad_b is None:
                grad_b = dz_MN.sum(0).to(b_dt)

            k = x_MK.shape[1]
            ln_needs = [need[0], lnw is not None and need[1], lnb is not None and need[2]]
            if ctx.fused_ln:
                dx_MK, dlnw, dlnb = layernorm_backward(
                    dh_MK, x_MK, mean, rstd, lnw,
                    need_dx=ln_needs[0], need_dw=ln_needs[1], need_db=ln_needs[2],
                )
                dx_MK, dlnw, dlnb = (
                    t if want else None for t, want in zip((dx_MK, dlnw, dlnb), ln_needs)
                )
            else:
                dx_MK, dlnw, dlnb = torch.ops.aten.native_layer_norm_backward(
                    dh_MK, x_MK, [k], mean, rstd, lnw, lnb, ln_needs
                )
        grad_x = None if dx_MK is None else dx_MK.reshape(*grad_y.shape[:-1], k).to(x_dt)
        dlnw = None if dlnw is None else dlnw.to(lnw_dt)
        dlnb = None if dlnb is None else dlnb.to(lnb_dt)
        return grad_x, dlnw, dlnb, grad_w, grad_b, None, None, None, None, None


def _layernorm_linear_impl(
    x: Tensor,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    plan: str,
    activation: str,
    eps: float,
    out_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    needs_grad: list[bool],
) -> list[Tensor]:
    # The op runs the Function's eager code: the Triton quantizers, never the reference.
    return opaque.run_forward(
        "layernorm_linear",
        (x, ln_weight, ln_bias, weight, bias, LinearPlan.from_key(plan), activation, eps, out_dtype, False),
        needs_grad, autocast_dtype, x.device.type,
    )


_layernorm_linear_op = opaque.define(
    "layernorm_linear", _LnLinearActFn, _layernorm_linear_impl, num_extra_args=2
)
"""``layernorm_linear`` as one opaque op for compiled code (``kernels.opaque``)."""


def layernorm_linear(
    x: Tensor,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    plan: LinearPlan,
    *,
    activation: str = "relu",
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
    compiled_quantizer: str = "custom",
) -> Tensor:
    """``act(linear(layer_norm(x)))`` with the linear's GEMMs planned and FP8 quantization
    fused into the LayerNorm and ReLU-backward kernels where the plan allows (see module doc).

    Args:
        x: input ``(..., K)``.
        ln_weight: LayerNorm weight ``(K,)`` or None.
        ln_bias: LayerNorm bias ``(K,)`` or None.
        weight: linear weight ``(N, K)``.
        bias: linear bias ``(N,)`` or None.
        plan: per-GEMM plans of the linear.
        activation: "relu", "silu" or "none".
        eps: LayerNorm epsilon.
        out_dtype: output dtype; default the compute dtype.
        compiled_quantizer: what quantizes under ``torch.compile``, ``"custom"`` or
            ``"inductor"`` (``settings.KernelSettings.compiled_quantizer``).

    Returns:
        ``(..., N)`` tensor.
    """
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {FUSED_ACTIVATIONS}, got {activation!r}")
    if not isinstance(plan, LinearPlan):
        raise ValueError(f"plan must be a LinearPlan, got {type(plan).__name__}")
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if opaque.opaque(compiled_quantizer):
        return _layernorm_linear_op(
            x, ln_weight, ln_bias, weight, bias, plan.key, activation, eps, out_dtype,
            opaque.autocast_dtype(x.device.type),
            opaque.needs_grad(x, ln_weight, ln_bias, weight, bias),
        )[0]
    return _LnLinearActFn.apply(
        x, ln_weight, ln_bias, weight, bias, plan, activation, eps, out_dtype,
        inductor_quantizes(compiled_quantizer),
    )
