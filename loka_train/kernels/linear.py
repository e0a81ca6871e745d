"""An FP8 linear layer whose three GEMMs each follow their own :class:`GemmPlan`.

``fp8_linear(x, W, b, plan)`` computes ``y = x W^T + b`` with an autograd function whose
forward (``y = x W^T``), grad-input (``dX = dY W``) and grad-weight (``dW = dY^T X``) GEMMs are
planned separately. A HIGH GEMM is the plain matmul in the compute dtype, with the same ops
autograd uses for ``F.linear`` (outputs and gradients are bit-identical to it). An FP8 GEMM
quantizes both operands along its contraction dim (``plan.fmt`` for ``a``, ``plan.fmt_b`` for
``b``; weights in 128x128 tiles under block scaling) and calls the plan's backend. The bias is
always added in high precision.

The compute dtype is ``x.dtype``, or the autocast dtype when autocast is on (bf16 on GPU);
the high-precision ``x`` and ``W`` (in that dtype) are saved for backward, like ``F.linear``.

An explicit plan that its backend cannot run raises (naming the backend's reason): there is no
silent fallback.

Shape legend: ``M`` rows (all leading dims of ``x`` flattened), ``K`` in features, ``N`` out
features.

Example:
    >>> x = torch.randn(4, 8, 32, requires_grad=True)
    >>> w = torch.randn(16, 32, requires_grad=True)
    >>> y = fp8_linear(x, w, None, LinearPlan.fp8(backend="emulated"))
    >>> y.shape
    torch.Size([4, 8, 16])
    >>> y.sum().backward()
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loka_train.kernels import opaque
from loka_train.kernels.backends import TRITON_INSTALLED
from loka_train.kernels.formats import Fp8Format, QTensor, Scaling, is_row_strided, quantize
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

__all__ = [
    "cross_tail_linear",
    "fp8_linear",
    "fp8_gemm_planned",
    "folds_bias_grad",
    "folds_input_relu",
    "grad_weight_takes_x",
    "inductor_quantizes",
    "grad_weight_dtype",
    "is_transposed_view",
    "quantize_operand",
    "quantize_with_transpose",
    "reference_fallbacks",
    "run_backend",
    "takes_cross_tail",
    "takes_triton_quantizers",
    "transposed_reuse",
    "use_fused_quantizer",
    "use_tensorwise_quantizer",
    "use_transposed_quantizer",
    "writes_both_layouts",
]


# Backends whose operands may come from the fused Triton quantizer. The emulated and bf16
# backends keep the reference quantizer: they are the oracle the fused one is tested against.
_FUSED_QUANT_BACKENDS = frozenset({"triton", "torch_scaled_mm", "fbgemm_rowwise"})


def takes_triton_quantizers(backend: str) -> bool:
    """Whether ``backend``'s FP8 operands come from the Triton quantizers where Triton runs (the
    emulated and bf16 backends keep the reference quantizer: they are the oracle)."""
    return backend in _FUSED_QUANT_BACKENDS


def inductor_quantizes(compiled_quantizer: str) -> bool:
    """Whether FP8 operands are quantized with plain torch ops for inductor to fuse: traced by
    ``torch.compile`` with ``compiled_quantizer == "inductor"``
    (``settings.KernelSettings.compiled_quantizer``).

    An FP8 Function called where this holds takes ``reference_quantizer=True``.
    """
    return compiled_quantizer == "inductor" and torch.compiler.is_compiling()


@functools.lru_cache(maxsize=4096)
def _supports(backend: Any, problem: GemmProblem) -> tuple[bool, str]:
    # Keyed by the backend object (not its name), so a backend registered anew under the same
    # name is asked again. Capabilities do not change within a process; problems repeat.
    return backend.supports(problem)


def _triton_quantizes(
    plan: GemmPlan, t: Tensor, fmt: Fp8Format, scalings: tuple[Scaling, ...], reference_quantizer: bool
) -> bool:
    """What both Triton quantizers need: a backend that takes their operands, a scaling in
    ``scalings``, an e4m3/e5m2 format, a float input, and Triton running on ``t``'s device;
    never where inductor quantizes (``reference_quantizer``, see :func:`inductor_quantizes`)."""
    if reference_quantizer:
        return False
    if not (
        plan.backend in _FUSED_QUANT_BACKENDS
        and plan.scaling in scalings
        and fmt in (Fp8Format.E4M3, Fp8Format.E5M2)
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return False
    if plan.backend == "triton":
        return True  # the triton backend's supports() has checked that Triton runs here
    if not TRITON_INSTALLED:
        return False
    from loka_train.kernels.triton_kernels import triton_runnable

    return triton_runnable(t.device)[0]


def use_fused_quantizer(
    plan: GemmPlan, t: Tensor, fmt: Fp8Format, *, reference_quantizer: bool = False
) -> bool:
    """Whether :func:`quantize_operand` takes the one-pass Triton quantizer for ``t``
    (never with ``reference_quantizer``)."""
    if not _triton_quantizes(plan, t, fmt, (Scaling.ROWWISE,), reference_quantizer):
        return False
    from loka_train.kernels.triton_kernels import MAX_QUANT_ROW

    # The fused quantizer holds a row in registers; longer rows (the grad-weight GEMM's
    # operands, whose rows run over the batch) take the reference quantizer instead.
    return t.shape[-1] <= MAX_QUANT_ROW


def is_transposed_view(t: Tensor) -> bool:
    """Whether ``t`` is the transpose of a contiguous 2-D tensor (and not contiguous itself)."""
    return t.ndim == 2 and not t.is_contiguous() and t.t().is_contiguous()


def use_transposed_quantizer(
    plan: GemmPlan, t: Tensor, fmt: Fp8Format, *, reference_quantizer: bool = False
) -> bool:
    """Whether :func:`quantize_operand` quantizes ``t`` (a transposed view: ``W^T``, ``dY^T``,
    ``X^T``) with the transposing Triton quantizer instead of copying it contiguous first
    (never with ``reference_quantizer``)."""
    return is_transposed_view(t) and _triton_quantizes(
        plan, t, fmt, (Scaling.ROWWISE, Scaling.TENSORWISE), reference_quantizer
    )


def use_tensorwise_quantizer(
    plan: GemmPlan, t: Tensor, fmt: Fp8Format, *, reference_quantizer: bool = False
) -> bool:
    """Whether :func:`quantize_operand` takes the Triton tensor-wise quantizer for ``t`` (an
    operand of a tensor-wise plan that is not a transposed view, which takes the transposing
    one; never with ``reference_quantizer``). A non-contiguous ``t`` is copied contiguous first:
    a gradient that reaches a site as a slice of a concatenation's (Wukong's FM output) has
    rows strided apart, and one copy costs a fraction of the reference quantizer's passes."""
    return not is_transposed_view(t) and _triton_quantizes(
        plan, t, fmt, (Scaling.TENSORWISE,), reference_quantizer
    )


def quantize_operand(
    t_RC: Tensor,
    fmt: Fp8Format,
    plan: GemmPlan,
    *,
    is_weight: bool,
    reference_quantizer: bool = False,
    count_fallbacks: bool = False,
    static: Tensor | None = None,
    relu: bool = False,
) -> QTensor:
    """Quantize a 2-D GEMM operand along its last (contraction) dim as ``plan`` asks.

    Row-wise operands of the triton, torch_scaled_mm and fbgemm_rowwise backends go through the
    fused one-pass quantizer (``loka::rowwise_quant``) where Triton runs, and row-wise or
    tensor-wise operands that are transposed views (the backward GEMMs' ``W^T``, ``dY^T``,
    ``X^T``) through the transposing one (``loka::transposed_quant``: no transposed copy);
    other tensor-wise operands of those backends through the tensor-wise one, copied contiguous
    first where they are not (``loka::tensorwise_quant``, bit-identical to the reference);
    everything else through the
    reference :func:`formats.quantize`. The row-wise kernels give the reference's scales and
    codes (on a GPU at most ~0.1 % of codes one step off: fp32 division). Under block scaling,
    weights get 128x128 tiles and activations/gradients 1x128 groups. ``reference_quantizer``
    (code traced for inductor to fuse, see :func:`inductor_quantizes`) always takes
    :func:`formats.quantize`. ``count_fallbacks``: a site's own quantization (not a timing or
    a trace), whose reference-quantizer fallbacks :func:`reference_fallbacks` counts.
    ``static``: the operand's static-scale slot (``kernels.static_scales``) for a tensor-wise
    plan: the Triton tensor-wise quantizer then takes it (``loka::tensorwise_quant_static``),
    other backends (the emulated oracle) its PyTorch reference (host syncs: eager code only;
    traced code quantizes dynamically); row-wise and block plans ignore it.
    ``relu``: quantize ``torch.relu(t_RC)``: the Triton tensor-wise quantizers apply it as they
    read ``t_RC`` (no pass writes the ReLU's output); every other path computes it first.
    """
    if relu and not use_tensorwise_quantizer(plan, t_RC, fmt, reference_quantizer=reference_quantizer):
        t_RC, relu = torch.relu(t_RC), False
    if use_transposed_quantizer(plan, t_RC, fmt, reference_quantizer=reference_quantizer):
        from loka_train.kernels.triton_block import transposed_quant

        rowwise = plan.scaling is Scaling.ROWWISE
        q, scale, _ = transposed_quant(t_RC.t(), fmt=fmt, per_column=rowwise)
        return QTensor(data=q, scale=scale, fmt=fmt, scaling=plan.scaling, axis=1)
    if use_tensorwise_quantizer(plan, t_RC, fmt, reference_quantizer=reference_quantizer):
        from loka_train.kernels.triton_tensorwise import tensorwise_quant, tensorwise_quant_static

        if static is not None:
            q, scale, _ = tensorwise_quant_static(t_RC.contiguous(), static, fmt=fmt, relu=relu)
        else:
            q, scale = tensorwise_quant(t_RC.contiguous(), fmt=fmt, relu=relu)
        return QTensor(data=q, scale=scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1)
    if use_fused_quantizer(plan, t_RC, fmt, reference_quantizer=reference_quantizer):
        from loka_train.kernels.triton_kernels import fused_rowwise_quant

        q, scale, _, _, _, _ = fused_rowwise_quant(t_RC.contiguous(), fmt=fmt)
        return QTensor(data=q, scale=scale, fmt=fmt, scaling=Scaling.ROWWISE, axis=1)
    if static is not None and plan.scaling is Scaling.TENSORWISE and not reference_quantizer and not opaque.tracing():
        # The emulated oracle (and any backend without the Triton quantizer) takes the same
        # static scale, with the reference's fit rule and slot update: the numerics of
        # ``mods.static_scales`` do not depend on the backend. The reference decides on the
        # host, which a CUDA graph capture cannot: there the operand takes its dynamic scale,
        # counted as a fallback.
        if t_RC.is_cuda and torch.cuda.is_current_stream_capturing():
            if count_fallbacks:
                _note_reference_fallback(
                    f"static-scale operand {tuple(t_RC.shape)} on {plan.backend} in a CUDA graph capture "
                    "(dynamic scale instead: only the Triton quantizer decides on the device)"
                )
        else:
            from loka_train.kernels.static_scales import quantize_static_reference

            q_data, q_scale = quantize_static_reference(t_RC, static, fmt)
            return QTensor(data=q_data, scale=q_scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1)
    if (
        count_fallbacks
        and not opaque.tracing()
        and _triton_quantizes(plan, t_RC, fmt, (Scaling.ROWWISE, Scaling.TENSORWISE), reference_quantizer)
    ):
        # A Triton quantizer runs here for this plan, but not for this operand's shape or layout.
        _note_reference_fallback(
            f"{plan.scaling.value} operand {tuple(t_RC.shape)} with strides {t_RC.stride()} on {plan.backend}"
        )
    block_2d = is_weight and plan.scaling is Scaling.BLOCK
    return quantize(t_RC, fmt, plan.scaling, axis=-1, block_2d=block_2d)


_STATIC_X, _STATIC_DY = 0, 1
"""Rows of ``fp8_linear``'s static-scale slots: the forward's ``x``, the backward's ``dY``."""

_REFERENCE_FALLBACKS: collections.Counter[str] = collections.Counter()
"""Operands the reference quantizer took where a Triton quantizer runs for their plan, by
what they were (see :func:`reference_fallbacks`)."""


def _note_reference_fallback(what: str) -> None:
    if what not in _REFERENCE_FALLBACKS:
        logger.warning(
            "kernels: the reference quantizer (eager amax, division and cast passes) quantizes a %s: "
            "no Triton quantizer takes its shape or layout; counted in reference_fallbacks()", what,
        )
    _REFERENCE_FALLBACKS[what] += 1


def reference_fallbacks() -> dict[str, int]:
    """How many of the sites' operands (``count_fallbacks``; not Dispatch's or the ledger's
    timings) the reference quantizer quantized, by shape and layout, where the Triton quantizers
    run for their plan but not for them (e.g. a row-wise operand with rows longer than the fused
    kernel holds): each costs several times the kernel's passes, which neither Dispatch's
    timings nor the ledger include. Logged once per kind; the LoKA report lists the counts of
    its run (since ``on_train_start``). Process-wide, never reset."""
    return dict(_REFERENCE_FALLBACKS)


def run_backend(
    plan: GemmPlan,
    a_q: QTensor,
    b_q: QTensor,
    *,
    out_dtype: torch.dtype,
    role: str,
    bias_N: Tensor | None = None,
) -> Tensor:
    """Call ``plan.backend`` on quantized operands after checking it supports the problem.

    Raises:
        RuntimeError: if the backend cannot run this problem (the reason is included).
    """
    backend: Any = get_backend(plan.backend)  # hashed by identity in _supports
    problem = GemmProblem.from_operands(
        a_q, b_q, out_dtype=out_dtype, role=role, fast_accum=plan.fast_accum
    )
    # Under torch.compile the check runs once at trace time; dynamo does not trace lru_caches.
    compiling = torch.compiler.is_compiling()
    ok, why = backend.supports(problem) if compiling else _supports(backend, problem)
    if not ok:
        raise RuntimeError(
            f"GEMM plan {plan} cannot run {role} {problem.m}x{problem.k}x{problem.n} on "
            f"{problem.device_type}: {why}. Choose another backend in the plan."
        )
    with profiled(f"loka/gemm/{role}/{plan.backend}"):
        return backend(a_q, b_q, out_dtype=out_dtype, bias=bias_N, fast_accum=plan.fast_accum)


def fp8_gemm_planned(
    a_MK: Tensor,
    b_NK: Tensor | None,
    plan: GemmPlan,
    *,
    out_dtype: torch.dtype,
    role: str,
    bias_N: Tensor | None = None,
    b_is_weight: bool = False,
    a_q: QTensor | None = None,
    b_q: QTensor | None = None,
    reference_quantizer: bool = False,
    count_fallbacks: bool = False,
    static_a: Tensor | None = None,
) -> Tensor:
    """``a @ b^T (+ bias)`` in FP8 as ``plan`` says: quantize both along K, call the backend.

    ``a_q`` / ``b_q``, when given, are the operands already quantized exactly as ``plan``
    would quantize them (see :func:`transposed_reuse`); they are used instead.
    ``reference_quantizer``, ``count_fallbacks``: see :func:`quantize_operand`; ``static_a``
    is ``static`` there for ``a``.

    Raises:
        RuntimeError: if the plan's backend cannot run this problem (the reason is included).
    """
    if not plan.is_fp8:
        raise ValueError("fp8_gemm_planned needs an FP8 plan")
    get_backend(plan.backend)  # unknown names fail before any work
    if a_q is None:
        a_q = quantize_operand(
            a_MK, plan.fmt, plan, is_weight=False, reference_quantizer=reference_quantizer,
            count_fallbacks=count_fallbacks, static=static_a,
        )
    if b_q is None:
        if b_NK is None:
            raise ValueError("fp8_gemm_planned needs b_NK or its quantized b_q")
        b_q = quantize_operand(
            b_NK, plan.operand_b_fmt, plan, is_weight=b_is_weight, reference_quantizer=reference_quantizer,
            count_fallbacks=count_fallbacks,
        )
    return run_backend(plan, a_q, b_q, out_dtype=out_dtype, role=role, bias_N=bias_N)


def transposed_reuse(q: QTensor | None, fmt: Fp8Format, plan: GemmPlan) -> QTensor | None:
    """``q`` transposed, as the operand of another GEMM that ``plan`` runs, when that is exactly
    what quantizing the transposed tensor would give; else None.

    A tensor-wise scale is one amax over the whole tensor, whatever its layout, so the FP8
    payload of ``t.T`` is ``q.data.T`` element for element: a linear layer whose GEMMs are
    all tensor-wise quantizes ``x``, ``W`` and ``dY`` once each instead of twice (as torchao's
    tensor-wise recipe does). Row-wise and block scales follow the contraction axis and differ.
    """
    if (
        q is None
        or not plan.is_fp8
        or plan.scaling is not Scaling.TENSORWISE
        or q.scaling is not Scaling.TENSORWISE
        or q.fmt is not fmt
        or q.data.ndim != 2
    ):
        return None
    return QTensor(data=q.data.t(), scale=q.scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1)


def writes_both_layouts(
    plan: GemmPlan,
    t: Tensor,
    fmt: Fp8Format,
    other: GemmPlan,
    other_fmt: Fp8Format,
    *,
    reference_quantizer: bool = False,
) -> bool:
    """Whether :func:`quantize_with_transpose` quantizes ``t`` for ``plan`` in one pass that
    also writes the transpose the GEMM ``other`` takes over: both tensor-wise in the same
    format, ``t`` 2-D and quantized by the Triton tensor-wise quantizer
    (:func:`use_tensorwise_quantizer`)."""
    return (
        t.ndim == 2
        and plan.is_fp8
        and plan.scaling is Scaling.TENSORWISE
        and other.is_fp8
        and other.scaling is Scaling.TENSORWISE
        and other_fmt is fmt
        and use_tensorwise_quantizer(plan, t, fmt, reference_quantizer=reference_quantizer)
    )


def quantize_with_transpose(
    t_RC: Tensor,
    fmt: Fp8Format,
    plan: GemmPlan,
    other: GemmPlan,
    other_fmt: Fp8Format,
    *,
    is_weight: bool,
    reference_quantizer: bool = False,
    count_fallbacks: bool = False,
    static: Tensor | None = None,
    relu: bool = False,
    mask: Tensor | None = None,
) -> tuple[QTensor, QTensor | None]:
    """``t_RC`` quantized for ``plan`` (:func:`quantize_operand`) and, where the GEMM ``other``
    takes its transpose over as operand in ``other_fmt`` (:func:`transposed_reuse`), that
    transpose; else None.

    Where the Triton tensor-wise quantizer runs (:func:`use_tensorwise_quantizer`), one pass
    writes both payloads of a 16-bit ``t`` (``loka::tensorwise_quant_both``; an fp32 one's
    transpose is copied from its payload) and the transpose is contiguous, the
    K-major layout the other GEMM's backend takes as it is; elsewhere it is the transposed view
    of the payload (``torch._scaled_mm`` then copies it contiguous in a pass of its own). The
    codes are the same either way. ``static``, ``relu``: as in :func:`quantize_operand`.
    ``mask``: :func:`relu_mask_bits` of a folded ReLU's pre-activation, applied to ``t_RC`` as the
    two-layout cast reads it (only where it runs: the caller masks first elsewhere).
    """
    if writes_both_layouts(plan, t_RC, fmt, other, other_fmt, reference_quantizer=reference_quantizer):
        from loka_train.kernels.triton_tensorwise import (
            tensorwise_quant_both,
            tensorwise_quant_static,
        )

        src = _both_layouts_input(t_RC)
        if static is not None:
            data, scale, both_t = tensorwise_quant_static(src, static, fmt=fmt, both=True, relu=relu, mask=mask)
            assert both_t is not None
            data_t = both_t
        else:
            data, scale, data_t = tensorwise_quant_both(src, fmt=fmt, relu=relu, mask=mask)
        return (
            QTensor(data=data, scale=scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1),
            QTensor(data=data_t, scale=scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1),
        )
    if mask is not None:
        raise ValueError("quantize_with_transpose applies a mask in the two-layout cast only: mask the tensor first")
    q = quantize_operand(
        t_RC, fmt, plan, is_weight=is_weight, reference_quantizer=reference_quantizer, count_fallbacks=count_fallbacks,
        static=static, relu=relu,
    )
    return q, transposed_reuse(q, other_fmt, other)


def _both_layouts_input(t: Tensor) -> Tensor:
    """What the two-layout casts read: ``t`` itself when it is contiguous or only its rows lie
    apart (:func:`is_row_strided`), else a contiguous copy."""
    return t if is_row_strided(t) else t.contiguous()


def grad_weight_dtype(w_dtype: torch.dtype) -> torch.dtype:
    """Output dtype of an FP8 grad-weight GEMM: the weight's own when a backend writes it
    (fp32 master weights, or bf16: one rounding of the fp32 accumulator either way, without a
    separate conversion pass over dW), else fp32."""
    return w_dtype if w_dtype in (torch.float32, torch.bfloat16) else torch.float32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _extended_k(k: int) -> int:
    """Columns of ``[X, 1, 0...]`` for a bias folded into grad-weight: ``K + 1`` rounded up to a
    multiple of 8 (cuBLAS's aligned 16-bit kernels)."""
    return _round_up(k + 1, 8)


def folds_bias_grad(plan: LinearPlan, k: int, n: int, *, need_w: bool, need_b: bool) -> bool:
    """Whether ``fp8_linear``'s bias gradient comes out of its grad-weight GEMM, as column ``K``
    of ``dY^T @ [X, 1, 0...]``, instead of a column sum of ``dY``: for a high-precision
    grad-weight that runs, a bias that wants a gradient, and ``N >= 2 x`` the extended ``K``
    (:func:`_extended_k`), where copying ``X`` one column wider moves fewer bytes than a
    reduction reading ``dY`` (``M x N``). DCN's cross layers (``K`` = rank 512, ``N`` 3456)
    are such sites: under ``torch.compile`` their sum ran as a split reduction of its own.

    The weight's gradient is unchanged in value up to the GEMM's kernel choice; the bias's is
    dY's rows summed in fp32 and rounded once to the compute dtype, as the sum rounds.
    """
    return need_w and need_b and not plan.grad_weight.is_fp8 and n >= 2 * _extended_k(k)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a GEMM on ``x`` computes in: autocast's where it is on for ``x``'s device, else
    ``x``'s own."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _PlannedLinearFn(torch.autograd.Function):
    """:func:`fp8_linear` on rows: ``x`` is 2-D ``(M, K)`` (fp8_linear folds N-D inputs).

    With ``input_relu`` (an FP8 forward whose ``x`` the Triton tensor-wise quantizer takes,
    :func:`folds_input_relu`) the GEMMs take ``relu(x)``: the forward's cast applies it, a
    grad-weight GEMM that does not take the forward's transposed payload over recomputes it
    (one more pass over ``x`` in the backward), and the gradient returned for ``x`` is the one
    for ``relu(x)``: fp8_linear masks it (:class:`_ReluGradFn` in eager code, the opaque op's
    traced backward in compiled code), unless the site before applies that mask.

    With ``output_relu`` the output feeds a ReLU folded into the next site, which leaves the
    ReLU's backward to this one: the gradient that arrives is the one for ``relu(y)``, and this
    Function masks it with ``y``'s bits (:func:`relu_mask_bits`, taken in the forward), in the
    two-layout cast of ``dY`` where that runs (``ctx.fuses_output_mask``), else first.

    With ``tail_x0`` (and ``tail_xl``, None where ``x_l`` is ``x0``: a DCN cross layer's ``W``
    GEMM, :func:`cross_tail_linear`) the tensor-wise FP8 forward runs as
    ``triton_cross.cross_epilogue``: the Function returns ``(y, x_l + x0 * y, its bf16 copy)``,
    the last two non-differentiable (the caller's code differentiates the tail); ``y`` and the
    backward are the GEMM's as without them."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        plan: LinearPlan,
        out_dtype: torch.dtype | None,
        reference_quantizer: bool,
        grad_enabled: bool,
        static_slots: Tensor | None,
        input_relu: bool = False,
        output_relu: bool = False,
        tail_x0: Tensor | None = None,
        tail_xl: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        dev = x.device.type
        tail: tuple[Tensor, Tensor] | None = None
        rq = reference_quantizer
        cdtype = compute_dtype(x)
        # Tensor-wise FP8 operands of the forward that a backward GEMM takes as they are
        # (transposed): then it need not quantize them again, nor keep the high-precision x.
        # Only for a backward GEMM that will run: grad-weight takes x^T, grad-input W^T.
        # (``grad_enabled``: the caller's grad mode, which ``needs_input_grad`` does not see
        # in eager code.)
        x_q_t = w_q_t = None
        need_x, need_w = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        with torch.autocast(dev, enabled=False):
            xc = x.to(cdtype)
            wc = weight.to(cdtype)
            bc = None if bias is None else bias.to(cdtype)
            odtype = cdtype if out_dtype is None else out_dtype
            if plan.forward.is_fp8:
                x_MK = xc.reshape(-1, xc.shape[-1])
                fwd = plan.forward
                none = GemmPlan()  # no GEMM takes the transpose over
                gi = plan.grad_input if need_x else none
                gw = plan.grad_weight if need_w else none
                x_q, x_q_t = quantize_with_transpose(
                    x_MK, fwd.fmt, fwd, gw, gw.operand_b_fmt, is_weight=False, reference_quantizer=rq,
                    count_fallbacks=True, static=None if static_slots is None else static_slots[_STATIC_X],
                    relu=input_relu,
                )
                w_q, w_q_t = quantize_with_transpose(
                    wc, fwd.operand_b_fmt, fwd, gi, gi.operand_b_fmt, is_weight=True, reference_quantizer=rq,
                    count_fallbacks=True,
                )
                if tail_x0 is not None:
                    from loka_train.kernels.triton_cross import cross_epilogue

                    assert fwd.scaling is Scaling.TENSORWISE and odtype == torch.bfloat16, "cross_tail_linear checks"
                    y_MN, tail_out, tail_copy = cross_epilogue(
                        x_q.data, x_q.scale, w_q.data, w_q.scale, bc, tail_x0, tail_xl, fast_accum=fwd.fast_accum)
                    tail = (tail_out, tail_copy)
                else:
                    y_MN = fp8_gemm_planned(
                        x_MK, wc, fwd, out_dtype=odtype, role="forward", bias_N=bc, a_q=x_q, b_q=w_q,
                        reference_quantizer=rq,
                    )
                # fp8_linear hands in rows (it folds N-D inputs outside): y_MN as it is, no
                # view made here, which would refuse an in-place op on the output.
                y = y_MN
            else:
                y = F.linear(torch.relu(xc) if input_relu else xc, wc, bc).to(odtype)
            out_bits = None
            if output_relu and grad_enabled and any(ctx.needs_input_grad[:3]):
                out_bits = _output_bits(y)
        ctx.fuses_output_mask = out_bits is not None and bool(need_x and need_w) and writes_both_layouts(
            plan.grad_input, y, plan.grad_input.fmt, plan.grad_weight, plan.grad_weight.fmt, reference_quantizer=rq)
        ctx.save_for_backward(
            xc if x_q_t is None else None,
            wc,
            *((None, None) if x_q_t is None else (x_q_t.data, x_q_t.scale)),
            *((None, None) if w_q_t is None else (w_q_t.data, w_q_t.scale)),
            static_slots,
            out_bits,
        )
        ctx.plan = plan
        ctx.reference_quantizer = rq
        ctx.has_bias = bias is not None
        if folds_bias_grad(plan, x.shape[-1], weight.shape[0], need_w=bool(need_w),
                           need_b=bias is not None and grad_enabled and ctx.needs_input_grad[2]):
            ctx.own_grads = (2,)  # the bias gradient comes out of the grad-weight GEMM (opaque.define)
        ctx.cdtype = cdtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_relu = input_relu
        if tail_x0 is not None:
            assert tail is not None, "cross_tail_linear runs only a tensor-wise FP8 forward"
            ctx.mark_non_differentiable(*tail)
            ctx.set_materialize_grads(False)  # no zero tensors for the tail outputs' gradients
            return y, *tail
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, *tail_grads: Tensor | None):
        # tail_grads: the non-differentiable tail outputs' (None), where tail_x0 was given; there
        # grads are not materialized, and grad_y is None where y fed nothing that needs one.
        if grad_y is None:
            return (None,) * 12
        xc, wc, xq_data, xq_scale, wq_data, wq_scale, static_slots, out_bits = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        # The mask of a ReLU folded into the next site (output_relu): in dY's two-layout cast, or
        # here first, unless the opaque op's traced backward has masked the gradient already.
        out_mask = out_bits if ctx.fuses_output_mask else None
        if out_bits is not None and out_mask is None and not getattr(ctx, "output_grad_masked", False):
            grad_y = relu_grad_from_bits(grad_y, out_bits)
        rq: bool = ctx.reference_quantizer
        cdtype = ctx.cdtype
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.input_relu and xc is not None and need_w:
            xc = torch.relu(xc)  # what grad-weight takes (the gradient for x is masked outside)
        grad_x = grad_w = grad_b = None

        def reused(data: Tensor | None, scale: Tensor | None, fmt: Fp8Format) -> QTensor | None:
            if data is None or scale is None:
                return None
            return QTensor(data=data, scale=scale, fmt=fmt, scaling=Scaling.TENSORWISE, axis=1)

        with torch.autocast(grad_y.device.type, enabled=False):
            dy_MN = grad_y.reshape(-1, grad_y.shape[-1]).to(cdtype)
            # dY^T only for a grad-weight GEMM that runs (a frozen weight needs none).
            gw_takes_dy_t = plan.grad_weight if need_w else GemmPlan()
            read_as_is = (
                need_x
                and writes_both_layouts(plan.grad_input, dy_MN, plan.grad_input.fmt, gw_takes_dy_t,
                                        gw_takes_dy_t.fmt, reference_quantizer=rq)
                and (dy_MN.is_contiguous() or is_row_strided(dy_MN))
            )
            if out_mask is not None and not read_as_is:
                dy_MN, out_mask = relu_grad_from_bits(dy_MN, out_mask), None
            if (plan.grad_input.is_fp8 or plan.grad_weight.is_fp8) and not dy_MN.is_contiguous() and not read_as_is:
                # One copy for every quantizer that reads dY: a gradient that reaches the site
                # as a slice of a concatenation's (rows strided apart) would otherwise be
                # copied by each, and grad-weight's dY^T would not be the transposed view of a
                # contiguous tensor that the transposing quantizer reads (at M > 16384 rows the
                # reference quantizer's eager passes would take it). The two-layout cast reads
                # such rows of a 16-bit dY as they are and hands grad-weight its dY^T: no copy
                # here then (an fp32 dY it copies itself).
                dy_MN = dy_MN.contiguous()
            dy_q_t = None
            if need_x:
                gi = plan.grad_input
                if gi.is_fp8:
                    # dX = dY W = dY @ (W^T)^T: contraction over N.
                    dy_q, dy_q_t = quantize_with_transpose(
                        dy_MN, gi.fmt, gi, gw_takes_dy_t, gw_takes_dy_t.fmt, is_weight=False, reference_quantizer=rq,
                        count_fallbacks=True, static=None if static_slots is None else static_slots[_STATIC_DY],
                        mask=out_mask,
                    )
                    dx_MK = fp8_gemm_planned(
                        dy_MN, wc.t(), gi, out_dtype=cdtype, role="grad_input", b_is_weight=True,
                        a_q=dy_q, b_q=reused(wq_data, wq_scale, gi.operand_b_fmt),
                        reference_quantizer=rq, count_fallbacks=True,
                    )
                else:
                    dx_MK = dy_MN.mm(wc)
                grad_x = dx_MK.reshape(*grad_y.shape[:-1], dx_MK.shape[-1]).to(x_dtype)
            if need_w:
                gw = plan.grad_weight
                if gw.is_fp8:
                    # dW = dY^T X = (dY^T) @ (X^T)^T: contraction over M.
                    x_q_t = reused(xq_data, xq_scale, gw.operand_b_fmt)
                    x_KM = None if xc is None else xc.reshape(-1, xc.shape[-1]).t()
                    grad_w = fp8_gemm_planned(
                        dy_MN.t(), x_KM, gw, out_dtype=grad_weight_dtype(w_dtype),
                        role="grad_weight", a_q=dy_q_t, b_q=x_q_t, reference_quantizer=rq,
                        count_fallbacks=True,
                    ).to(w_dtype)
                elif getattr(ctx, "own_grads", ()):
                    # dY^T @ [X, 1, 0...]: the bias gradient is the GEMM's column K (fp32
                    # accumulation rounded once to the compute dtype, as the sum rounds), where
                    # a reduction of its own would read all of dY again (folds_bias_grad).
                    x_MK = xc.reshape(-1, xc.shape[-1])
                    k = x_MK.shape[1]
                    x_ext = x_MK.new_empty(x_MK.shape[0], _extended_k(k))
                    # A copy into the rows and two fills (no host scalar copied: CUDA graph
                    # capture); torch.cat with an expanded tail was slower.
                    x_ext[:, :k].copy_(x_MK)
                    x_ext[:, k + 1:].zero_()
                    x_ext[:, k].fill_(1)
                    gwb = dy_MN.t().mm(x_ext)
                    # Copies of their own: contiguous, as F.linear's, and not keeping gwb alive.
                    grad_w = gwb.new_empty((gwb.shape[0], k), dtype=w_dtype).copy_(gwb[:, :k])
                    grad_b = gwb.new_empty(gwb.shape[0], dtype=b_dtype).copy_(gwb[:, k])
                else:
                    # The GEMM autograd's linear backward runs (mm_mat2_backward with a
                    # contiguous W: dY^T @ X), so HIGH matches F.linear bit for bit, also on
                    # CUDA where (X^T dY)^T picks another cuBLAS kernel (1.7e-4 apart in bf16).
                    grad_w = dy_MN.t().mm(xc.reshape(-1, xc.shape[-1])).to(w_dtype)
            if need_b and ctx.has_bias and grad_b is None:
                # A reduction of its own: summing dY's columns inside the two-layout cast made
                # the casts about twice as slow in an H100 step, more than this pass costs.
                grad_b = (dy_MN if out_mask is None else relu_grad_from_bits(dy_MN, out_mask)).sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def _planned_linear_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: str,
    out_dtype: torch.dtype | None,
    reference_quantizer: bool,
    grad_enabled: bool,
    static_slots: Tensor | None,
    input_relu: bool,
    output_relu: bool,
    tail_x0: Tensor | None,
    tail_xl: Tensor | None,
    relu_mask: Tensor | None,
    producer_masks: bool,
    autocast_dtype: torch.dtype | None,
    needs_grad: list[bool],
) -> list[Tensor]:
    # The op runs the Function's eager code: the Triton quantizers, never the reference (the
    # caller passes False), and its needs_grad already holds the caller's grad mode
    # (opaque.needs_grad; the caller passes True). The static-scale slots are updated in place
    # in both the forward and the backward op, undeclared in their schemas: no traced code
    # reads them (the host does, between steps), and a declared mutation would hand the
    # backward a functional copy whose updates are lost. ``relu_mask`` is for the op's
    # backward alone (_relu_grad); ``producer_masks``: the site before applies that mask instead
    # (its ``output_relu``).
    if input_relu and needs_grad[0] and relu_mask is None and not producer_masks:
        raise ValueError("loka::planned_linear with input_relu and a gradient for x needs relu_mask (x, or "
                         "relu_mask_bits(x)) or a producer that masks: without it the gradient of x would not "
                         "be masked")
    return opaque.run_forward(
        "planned_linear",
        (x, weight, bias, LinearPlan.from_key(plan), out_dtype, reference_quantizer, grad_enabled, static_slots,
         input_relu, output_relu, tail_x0, tail_xl),
        needs_grad, autocast_dtype, x.device.type,
    )


def _bias_grad(attrs: Mapping[str, Any], grad_y: Tensor) -> Tensor:
    """The bias gradient as ``_PlannedLinearFn.backward`` computes it (``dY`` summed over its
    rows in the compute dtype), as code the compiled backward traces: inductor can fuse the
    sum into the pass that produces ``dY`` (on the CPU it does; on a GPU its split reductions
    may read ``dY`` again), where the op would run it as a reduction of its own, one more read
    of ``dY``. Not traced where :func:`folds_bias_grad` takes the gradient from grad-weight.
    The op still adds the bias in its forward GEMM's epilogue."""
    cdtype, b_dtype = attrs["cdtype"], attrs["dtypes"][2]
    # dtype given: the compiled backward is traced under the forward's autocast, where CUDA
    # autocast would sum a bf16 dY into fp32 (the Function sums with autocast off).
    return grad_y.reshape(-1, grad_y.shape[-1]).to(cdtype).sum(0, dtype=cdtype).to(b_dtype)


def _relu_grad(grad_x: Tensor, mask: Tensor) -> Tensor:
    """``torch.relu``'s backward of a folded ReLU from its mask (``x`` itself, or
    :func:`relu_mask_bits` of it), as :class:`_ReluGradFn` applies it, in ``grad_x``'s dtype."""
    if mask.dtype == torch.uint8:
        return relu_grad_from_bits(grad_x, mask)
    return torch.where(mask <= 0, torch.zeros((), dtype=grad_x.dtype, device=grad_x.device), grad_x)


_OUT_BITS = 7
"""Where :class:`_PlannedLinearFn` saves the bits of an ``output_relu`` mask."""

_planned_linear_op = opaque.define(
    "planned_linear", _PlannedLinearFn, _planned_linear_impl, num_extra_args=4, traced_grads={2: _bias_grad},
    masked_grads={0: (12, _relu_grad)}, output_mask=(_OUT_BITS, _relu_grad),
)
"""``fp8_linear`` as one opaque op for compiled code (``kernels.opaque``); its bias gradient is
traced (:func:`_bias_grad`), and so is a folded ReLU's mask on the gradient of ``x`` (its
argument ``relu_mask``: :func:`_relu_grad`) and, with ``output_relu``, on the output's gradient
where the Function does not apply it in its cast."""


def folds_input_relu(plan: LinearPlan, x: Tensor, compiled_quantizer: str = "custom") -> bool:
    """Whether ``fp8_linear(x, ..., input_relu=True)`` folds the ReLU into the cast of ``x``
    (the forward is FP8 and the Triton tensor-wise quantizer takes ``x``; not in code traced
    for inductor to quantize), rather than computing ``torch.relu(x)`` first."""
    fwd = plan.forward
    return fwd.is_fp8 and use_tensorwise_quantizer(
        fwd, x, fwd.fmt, reference_quantizer=inductor_quantizes(compiled_quantizer)
    )


_BIT = 8
"""Elements a byte of :func:`relu_mask_bits` holds."""


def relu_mask_bits(x: Tensor) -> Tensor:
    """Where ``torch.relu``'s backward keeps the gradient (not ``x <= 0``: NaN's kept), one bit
    an element: ``(..., K)`` -> uint8 ``(..., K // 8)``, bit ``j`` of byte ``i`` for element
    ``8 i + j``. Plain torch ops (eagerly several passes; inductor fuses them, one kernel on the
    CPU). ``K`` a multiple of 8."""
    keep = (~(x <= 0)).to(torch.uint8).view(*x.shape[:-1], x.shape[-1] // _BIT, _BIT)
    shifts = torch.arange(_BIT, dtype=torch.uint8, device=x.device)
    return torch.bitwise_left_shift(keep, shifts).sum(-1, dtype=torch.uint8)


def _output_bits(y: Tensor) -> Tensor:
    """:func:`relu_mask_bits` of an ``output_relu`` site's output: one Triton pass where Triton
    runs on ``y`` (``triton_tensorwise.relu_bits``; not in traced code), else the torch ops."""
    if not opaque.tracing() and TRITON_INSTALLED and y.is_contiguous():
        from loka_train.kernels.triton_kernels import triton_runnable

        if triton_runnable(y.device)[0]:
            from loka_train.kernels.triton_tensorwise import relu_bits

            return relu_bits(y)
    return relu_mask_bits(y)


def relu_grad_from_bits(grad: Tensor, bits: Tensor) -> Tensor:
    """``torch.relu``'s backward from :func:`relu_mask_bits`: ``grad`` where the bit is set, else
    0 (what ``threshold_backward(grad, x, 0)`` gives bit for bit for ``x`` of ``grad``'s dtype;
    it returns ``grad``'s dtype)."""
    shifts = torch.arange(_BIT, dtype=torch.uint8, device=bits.device)
    keep = torch.bitwise_and(torch.bitwise_right_shift(bits.unsqueeze(-1), shifts), 1).view(grad.shape)
    return torch.where(keep.bool(), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


def grad_weight_takes_x(plan: LinearPlan) -> bool:
    """Whether `plan`'s grad-weight takes the forward's tensor-wise FP8 ``x`` over, transposed
    (what :func:`quantize_with_transpose` hands it, :func:`transposed_reuse`), so that the
    Function keeps no ``x`` of its own (given a weight that needs its gradient); where the
    forward's cast applies a folded ReLU and grad-weight does not take ``x`` over, the backward
    runs the ReLU again."""
    fwd, gw = plan.forward, plan.grad_weight
    return (fwd.is_fp8 and fwd.scaling is Scaling.TENSORWISE and gw.is_fp8 and gw.scaling is Scaling.TENSORWISE
            and gw.operand_b_fmt is fwd.fmt)


class _ReluGradFn(torch.autograd.Function):
    """The identity forward, ``torch.relu``'s backward (``threshold_backward``: zero where
    ``x <= 0``, NaN's gradient kept): wrapped around an FP8 linear's input when its cast applies
    the ReLU, in eager code (compiled code hands the mask to the opaque op instead, which
    applies it in its traced backward: :func:`_relu_grad`). With ``bits`` it
    keeps the mask, one bit an element (:func:`relu_mask_bits`), instead of ``x``: where the
    site's grad-weight takes the forward's FP8 ``relu(x)`` over, ``x`` then need not live until
    the backward (``mods.relu_mask_bits``)."""

    @staticmethod
    def forward(ctx, x: Tensor, bits: bool = False) -> Tensor:
        ctx.bits = bits
        ctx.save_for_backward(relu_mask_bits(x) if bits else x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (saved,) = ctx.saved_tensors
        if ctx.bits:
            return relu_grad_from_bits(grad, saved), None
        return torch.ops.aten.threshold_backward(grad, saved, 0), None


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: LinearPlan,
    *,
    out_dtype: torch.dtype | None = None,
    compiled_quantizer: str = "custom",
    static_slots: Tensor | None = None,
    input_relu: bool = False,
    mask_bits: bool = False,
    input_relu_grad: bool = True,
    output_relu: bool = False,
) -> Tensor:
    """``y = x W^T + b`` with each of its three GEMMs computed as ``plan`` says.

    Args:
        x: input ``(..., K)``; leading dims are flattened for the GEMMs.
        weight: ``(N, K)`` (``nn.Linear`` layout).
        bias: ``(N,)`` or None; added in high precision.
        plan: per-GEMM plans (forward, grad_input, grad_weight).
        out_dtype: output dtype; default the compute dtype (``x.dtype`` or the autocast dtype).
        compiled_quantizer: what quantizes under ``torch.compile``, ``"custom"`` or
            ``"inductor"`` (``settings.KernelSettings.compiled_quantizer``); eager code is the
            same either way.
        static_slots: ``(2, 4)`` static-scale slots (``kernels.static_scales.new_slots``) of
            ``x`` (row 0) and ``dY`` (row 1), or None: a tensor-wise operand that the Triton
            tensor-wise quantizer takes then quantizes with its slot's static scale where it
            fits (``loka::tensorwise_quant_static``), updating the slot in place.
        input_relu: compute ``fp8_linear(torch.relu(x), ...)`` (forward and gradients the
            same). Where :func:`folds_input_relu` holds, the ReLU is applied by the cast that
            reads ``x``: no pass writes ``relu(x)``, which is what the ReLU module before the
            layer cost; elsewhere ``torch.relu(x)`` runs first.
        mask_bits: with a folded ``input_relu``, ``K`` a multiple of 8, a backward to run and a
            grad-weight that takes the forward's tensor-wise FP8 ``x`` over, keep the ReLU's
            mask for the backward as one bit an element (:func:`relu_mask_bits`) instead of
            ``x`` (``mods.relu_mask_bits``; the same gradients).
        input_relu_grad: with ``input_relu``, apply the ReLU's backward to the gradient of ``x``
            (True); False where the site that produced ``x`` applies it (its ``output_relu``):
            the gradient returned for ``x`` is then the one for ``relu(x)``.
        output_relu: the output feeds a ReLU folded into the next site (``input_relu`` with
            ``input_relu_grad=False`` there), whose backward this layer applies to the gradient
            it receives: in the two-layout FP8 cast of ``dY`` where that runs (no pass writes
            the masked gradient), else before its GEMMs. The output's values are ``x W^T + b``
            as ever. ``N`` a multiple of 8.

    Returns:
        ``(..., N)`` tensor.

    Raises:
        RuntimeError: if an FP8 GEMM's backend cannot run its problem.

    Example:
        >>> y = fp8_linear(torch.randn(8, 32), torch.randn(16, 32), torch.zeros(16),
        ...                LinearPlan.high_precision())
    """
    if not isinstance(plan, LinearPlan):
        raise ValueError(f"plan must be a LinearPlan, got {type(plan).__name__}")
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if output_relu and weight.shape[0] % _BIT:
        raise ValueError(f"output_relu needs N a multiple of {_BIT} (its mask's bits), got N={weight.shape[0]}")
    if x.ndim != 2:
        # The GEMMs see rows either way. Folded out here (as aten::matmul folds, the output no
        # autograd view), the output takes in-place ops, and hooks on it (the Probe's) see its
        # gradient: a view made inside the Function would refuse an inplace ReLU, and after one
        # on a view of the Function's output, a hook on that view would not fire.
        # In the compute dtype first: a copy that the reshape makes (a transposed input) moves
        # what the Function would have cast to anyway.
        x_rows = _rows(x, compute_dtype(x))
        if x_rows.shape[-1] != weight.shape[1]:  # rows zero-padded for aligned GEMMs: the weight too
            weight = F.pad(weight, (0, x_rows.shape[-1] - weight.shape[1]))
        y = _fp8_linear_rows(x_rows, weight, bias, plan, out_dtype, compiled_quantizer, static_slots, input_relu,
                             mask_bits, input_relu_grad, output_relu)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))
    return _fp8_linear_rows(x, weight, bias, plan, out_dtype, compiled_quantizer, static_slots, input_relu,
                            mask_bits, input_relu_grad, output_relu)


def takes_cross_tail(
    x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan, x0: Tensor, xl: Tensor | None
) -> tuple[bool, str]:
    """Whether :func:`cross_tail_linear` runs ``x W^T + b`` with the cross layer's tail in the
    GEMM's epilogue, with the reason where not: a tensor-wise FP8 forward, ``x`` ``(M, K)`` in
    bf16 compute, ``x0`` and ``x_l`` (None: ``x0``) contiguous fp32 ``(M, N)``, ``K`` a multiple
    of 16 and ``N`` of 8, on a backend that takes the Triton quantizers (not the oracle's), where
    Triton runs."""
    from loka_train.kernels.triton_kernels import triton_runnable

    fwd = plan.forward
    if not (fwd.is_fp8 and fwd.scaling is Scaling.TENSORWISE):
        return False, f"the forward runs {fwd}, not a tensor-wise FP8 GEMM"
    if not takes_triton_quantizers(fwd.backend):
        return False, f"backend {fwd.backend} keeps its own GEMM (the emulated and bf16 backends are the oracle)"
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        return False, "x and weight are not (M, K) and (N, K)"
    m, k = x.shape
    n = weight.shape[0]
    if compute_dtype(x) != torch.bfloat16:
        return False, f"the compute dtype is {compute_dtype(x)}, not bf16"
    streams = [x0] if xl is None else [x0, xl]
    if any(t.dtype != torch.float32 or t.shape != (m, n) or not t.is_contiguous() for t in streams):
        return False, "x0 and x_l are not contiguous fp32 (M, N), N the weight's rows"
    if k % 16 or n % 8:
        return False, "K is not a multiple of 16 or N of 8"
    if bias is not None and bias.shape != (n,):
        return False, "the bias is not of shape (N,)"
    if not TRITON_INSTALLED:
        return False, "Triton is not installed"
    return triton_runnable(x.device)


def cross_tail_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: LinearPlan,
    x0: Tensor,
    xl: Tensor | None,
    *,
    compiled_quantizer: str = "custom",
    static_slots: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A DCN cross layer's ``W`` GEMM ``y = x W^T + b`` (``x = x_l V^T``) with the layer's tail
    in its epilogue: ``(y, x_l + x0 * y, that in bf16)``; the GEMM (its quantization, static
    scales, backward) as :func:`fp8_linear` runs it, its forward as
    ``triton_cross.cross_epilogue``. Only ``y`` is differentiable: the caller differentiates the
    tail (``mods.interaction``), which the epilogue computed as ``torch.addcmul`` would.

    Args:
        x: ``(M, K)``, ``K`` the rank.
        weight: ``(N, K)``.
        bias: ``(N,)`` or None.
        plan: the site's plan; its forward tensor-wise FP8 (:func:`takes_cross_tail`).
        x0: ``(M, N)`` fp32, the net's input.
        xl: ``(M, N)`` fp32, the layer's input; None where it is ``x0`` (the first layer: the
            kernel reads it once, and no Function is handed the same tensor twice).
        compiled_quantizer, static_slots: as :func:`fp8_linear` takes them.

    Returns:
        ``(y, x_next, x_next_bf16)``: bf16, fp32, bf16, each ``(M, N)``.

    Raises:
        ValueError: where :func:`takes_cross_tail` does not hold (its reason).
    """
    ok, why = takes_cross_tail(x, weight, bias, plan, x0, xl)
    if not ok:
        raise ValueError(f"cross_tail_linear: {why}")
    return _cross_tail_linear(x, weight, bias, plan, x0, xl, compiled_quantizer, static_slots)


def _cross_tail_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan, x0: Tensor, xl: Tensor | None,
    compiled_quantizer: str, static_slots: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`cross_tail_linear` where the caller has checked :func:`takes_cross_tail`."""
    if opaque.opaque(compiled_quantizer):
        autocast = opaque.autocast_dtype(x.device.type)
        if autocast is not None and x.dtype != autocast:
            x = x.to(autocast)  # as _fp8_linear_rows: a cast the producer's kernel can take
        y, out, out16 = _planned_linear_op(
            x, weight, bias, plan.key, None, False, True, static_slots, False, False, x0, xl, None, False, autocast,
            opaque.needs_grad(x, weight, bias),
        )[:3]
        return y, out, out16
    y, out, out16 = _PlannedLinearFn.apply(
        x, weight, bias, plan, None, inductor_quantizes(compiled_quantizer), torch.is_grad_enabled(), static_slots,
        False, False, x0, xl,
    )
    return y, out, out16


_ALIGNED_K = 16
"""Where the rows are copied anyway (:func:`_rows`), a contraction dimension that is not a
multiple of 8 (what cuBLAS's aligned bf16 kernels need) is zero-padded to a multiple of this
(what the FP8 backends need)."""


def _rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (N-D) as ``(M, K)`` rows in ``dtype``: a view where the layout allows, else a copy;
    ``x_BND.transpose(1, 2)`` on a GPU through ``loka::transposed_rows`` (coalesced on both
    sides, where inductor's copy read with strides: ``kernels.triton_layout``), its rows
    zero-padded to a multiple of ``_ALIGNED_K`` where ``K`` is not a multiple of 8 (more columns
    than ``K``: the caller pads the weight to match). The high-precision GEMMs inside the FP8
    op run in aten, which takes an unaligned ``K`` as it is (cuBLAS's ``align1`` kernels).
    The site's plan was decided at the unpadded ``K`` (its shape, Dispatch's timings,
    ``planned_linear``'s own padding): the padding only adds zero products."""
    if _copies_transposed_rows(x):
        from loka_train.kernels.triton_layout import transposed_rows

        k = x.shape[-1]
        return transposed_rows(x, dtype, k if k % 8 == 0 else _round_up(k, _ALIGNED_K))
    return x.to(dtype).reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _copies_transposed_rows(x: Tensor) -> bool:
    """Whether :func:`_rows` copies ``x``'s rows with ``loka::transposed_rows``: a batch of
    transposed matrices on a GPU where Triton runs."""
    if not (x.is_cuda and TRITON_INSTALLED):
        return False
    from loka_train.kernels.triton_kernels import triton_runnable
    from loka_train.kernels.triton_layout import is_batch_transposed

    return is_batch_transposed(x) and triton_runnable(x.device)[0]


def _fp8_linear_rows(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: LinearPlan,
    out_dtype: torch.dtype | None,
    compiled_quantizer: str,
    static_slots: Tensor | None,
    input_relu: bool,
    mask_bits: bool = False,
    input_relu_grad: bool = True,
    output_relu: bool = False,
) -> Tensor:
    """:func:`fp8_linear` of a 2-D ``x`` (its checks made): the ReLU's fold is decided on the
    rows the Function casts. ``mask_bits``: the folded ReLU's mask kept as bits where a backward
    will run and grad-weight takes the forward's FP8 ``x`` over (:func:`grad_weight_takes_x`;
    elsewhere the Function keeps ``x`` itself, and bits would be one more copy)."""
    if input_relu and not folds_input_relu(plan, x, compiled_quantizer):
        # Masked by autograd here (and by the producer too where it masks: the same mask again).
        x, input_relu = torch.relu(x), False
    bits = input_relu and (mask_bits and x.shape[-1] % _BIT == 0 and torch.is_grad_enabled() and x.requires_grad
                           and weight.requires_grad and grad_weight_takes_x(plan))
    if opaque.opaque(compiled_quantizer):
        # The folded ReLU's mask goes into the op, which applies it to the gradient of x in
        # traced code (opaque.define's masked_grads): a _ReluGradFn around the op's input would
        # hand the op a view of x, which compiled code split between the two (the DDP
        # optimizer's buckets) recreates outside autograd, losing the mask.
        relu_mask = None
        if input_relu and input_relu_grad and torch.is_grad_enabled() and x.requires_grad:
            relu_mask = relu_mask_bits(x) if bits else x
        autocast = opaque.autocast_dtype(x.device.type)
        if autocast is not None and x.dtype != autocast:
            # Cast the activation here, where inductor can fuse the cast into its producer (DCN's
            # cross layers take fp32), instead of as a separate pass inside the op; autograd
            # casts the gradient back. The values are those of the cast inside. The weight stays
            # as it is: its FP8 gradient's dtype follows the weight's.
            x = x.to(autocast)
        return _planned_linear_op(
            x, weight, bias, plan.key, out_dtype, False, True, static_slots, input_relu, output_relu, None, None,
            relu_mask, not input_relu_grad, autocast, opaque.needs_grad(x, weight, bias),
        )[0]
    if input_relu and input_relu_grad:
        x = _ReluGradFn.apply(x, bits)
    return _PlannedLinearFn.apply(
        x, weight, bias, plan, out_dtype, inductor_quantizes(compiled_quantizer), torch.is_grad_enabled(),
        static_slots, input_relu, output_relu,
    )
