"""The Probe's shadow measurement of one GEMM: statistics of its operands and the error of each
FP8 candidate against the high-precision result, all on the operands' device.

Operands as the caller passes them, contraction axes per role (leading dims of activations and
gradients are flattened into ``M``; the axis is the one handed to
:func:`~loka_train.kernels.formats.quantize`):

==============  ======================  =====================  =======================
role            a                       b                      result
==============  ======================  =====================  =======================
forward         ``x_MK`` (axis 1)       ``w_NK`` (axis 1)      ``y_MN = x @ w.T``
grad_input      ``dy_MN`` (axis 1)      ``w_NK`` (axis 0)      ``dx_MK = dy @ w``
grad_weight     ``dy_MN`` (axis 0)      ``x_MK`` (axis 0)      ``dw_NK = dy.T @ x``
==============  ======================  =====================  =======================

Shape legend: ``M`` rows (batch), ``K`` input features, ``N`` output features, ``G`` scaling
groups.

* **Shadow SQNR.** For each candidate (format, scaling) both operands are quantized with the
  reference quantizers and multiplied with fp32 products and sums: dequantized, in fp32, or on
  CUDA, for tensor-wise and row-wise candidates, the FP8 payloads as a bf16 GEMM returning
  fp32 with the scales applied after (:func:`scaled_payload_gemm`); the error energy
  ``sum((ref - fp8)**2)`` and the signal energy ``sum(ref**2)`` are stored, not the dB value
  (see :mod:`loka_train.probe.window` for why). Saturation and underflow are stored as counts
  (:func:`~loka_train.kernels.formats.clipped_counts`) for the same reason.
* **No host sync.** Constants are written with fill kernels; there is no ``.item()``, no
  host-to-device copy. Non-finite inputs are counted and zeroed before the statistics are
  computed, so they never poison the window and never raise.
* **CUDA graphs.** On CUDA each (role, operand shapes) measurement is captured once and
  replayed (:class:`CudaGraphs`).

Example:
    >>> import torch
    >>> from loka_train.probe.candidates import candidates_of
    >>> from loka_train.probe.config import ProbeConfig
    >>> from loka_train.probe.window import WindowLayout
    >>> cfg = ProbeConfig(formats=("e4m3",), scalings=("rowwise",))
    >>> m = Measurement(cfg, candidates_of(cfg), WindowLayout(1), device=torch.device("cpu"))
    >>> x_MK, w_NK = torch.randn(8, 16), torch.randn(4, 16)
    >>> nf = count_nonfinite(x_MK)
    >>> vec_sum, vec_max = m.measure("forward", x_MK, w_NK, nf, nf, None, graphable=False)
    >>> tuple(vec_sum.shape) == (m.layout.num_sum,)
    True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from loka_train.kernels.formats import (
    Fp8Format,
    QTensor,
    Scaling,
    clipped_counts,
    dequantize,
    quantize,
    scale_from_amax,
)
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import Candidate, operand_b_format
from loka_train.probe.config import ProbeConfig
from loka_train.probe.window import WindowLayout
from loka_train.utils.capture import capture_stream

logger = logging.getLogger(__name__)


__all__ = ["CudaGraphs", "Measurement", "count_nonfinite", "gemm", "operands_2d", "split_bf16"]

# Contraction axes (operand a, operand b) per role, on the 2-D operands.
_ROLE_AXES = {"forward": (1, 1), "grad_input": (1, 0), "grad_weight": (0, 0)}
# Operand b is a weight (2-D tiles for block scaling) in these roles.
_B_IS_WEIGHT = {"forward": True, "grad_input": True, "grad_weight": False}

MeasureFn = Callable[..., tuple[Tensor, Tensor]]
"""``(role, a, b, nf_a, nf_b) -> (SUM vector, MAX vector)``: what :class:`CudaGraphs` captures."""


def count_nonfinite(x: Tensor) -> Tensor:
    """How many values of `x` are inf or NaN (an int64 tensor on `x`'s device, no host sync).

    ``x * 0.0`` is (signed) zero exactly where `x` is finite and NaN elsewhere; on CUDA
    ``count_nonzero`` is a ``ne`` and a ``sum``. So three passes, two of them full-size writes
    of a bool or of `x`'s dtype, where ``numel - isfinite(x).sum()`` takes five (``isfinite``
    is ``abs``, ``ne``, ``eq`` and ``mul`` on the H100: 0.6 ms a step of a 3-step window of DCN
    at 32768). The float zero matters: inductor folds ``x * 0`` with an integer zero to zeros,
    which would count nothing under ``torch.compile``.

    Example:
        >>> int(count_nonfinite(torch.tensor([1.0, float("inf"), float("nan")])))
        2
    """
    return torch.count_nonzero(x.detach().mul(0.0))


def operands_2d(
    site: str, role: str, a: Tensor, b: Tensor, *, weight_shape: tuple[int, int] | None
) -> tuple[Tensor, Tensor]:
    """The operands of one GEMM as 2-D tensors (leading dims flattened into rows), checked.

    Args:
        site: the site's name (for the error messages).
        role: the GEMM role.
        a: operand a.
        b: operand b.
        weight_shape: the registered ``(N, K)`` of the weight, checked when given.

    Raises:
        ValueError: an unknown role, or shapes that do not fit the role's GEMM.
    """
    if role not in _ROLE_AXES:
        raise ValueError(f"unknown GEMM role {role!r}; use one of {ROLES}")
    if a.dim() < 1 or b.dim() < 1:
        raise ValueError(f"{site}/{role}: operands must have at least one dim")
    a2 = a.reshape(-1, a.shape[-1])
    if role == "grad_weight":
        b2 = b.reshape(-1, b.shape[-1])
        if a2.shape[0] != b2.shape[0]:
            raise ValueError(
                f"{site}/grad_weight: dY has {a2.shape[0]} rows but X has {b2.shape[0]}"
            )
    else:
        if b.dim() != 2:
            raise ValueError(f"{site}/{role}: the weight must be 2-D, got {tuple(b.shape)}")
        b2 = b
        if weight_shape is not None and tuple(b2.shape) != weight_shape:
            raise ValueError(
                f"{site}/{role}: weight shape {tuple(b2.shape)} != registered {weight_shape}"
            )
        contraction_b = b2.shape[1] if role == "forward" else b2.shape[0]
        if a2.shape[1] != contraction_b:
            raise ValueError(
                f"{site}/{role}: contraction mismatch {tuple(a.shape)} vs {tuple(b.shape)}"
            )
    return a2, b2


def _clean(x: Tensor) -> Tensor:
    """fp32 copy with non-finite values zeroed (one ``nan_to_num`` after the cast; the callers
    have the non-finite counts of the whole operands already)."""
    return torch.nan_to_num(x.detach().float(), nan=0.0, posinf=0.0, neginf=0.0)


def gemm(role: str, a: Tensor, b: Tensor, *, out_dtype: torch.dtype | None = None) -> Tensor:
    """The GEMM of ``role`` on 2-D operands (see the table of the module docstring); with
    ``out_dtype``, ``torch.mm``'s accumulate-and-return in that dtype (CUDA)."""
    x, y = (a, b.T) if role == "forward" else (a, b) if role == "grad_input" else (a.T, b)
    if out_dtype is None:
        return x @ y
    return torch.mm(x, y, out_dtype=out_dtype)


def _bf16_exact(t: Tensor) -> bool:
    """Whether every value of ``t`` is a bf16 value: bf16 itself and the FP8 formats (3 or 2
    mantissa bits, exponents within bf16's)."""
    return t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def split_bf16(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A finite fp32 tensor as three bf16 tensors whose sum is `x`: each part is the top 8
    significant bits of what the earlier parts left (truncated, so nothing overflows), and the
    remainders are exact in fp32. Exact for every ``|x| >= 2**-110`` (smaller values lose the
    bits that fall below the smallest normal number in the last part)."""

    def top8(t: Tensor) -> Tensor:
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)  # 0xFFFF0000

    hi = top8(x)
    r1 = x - hi
    mid = top8(r1)
    lo = r1 - mid  # at most 8 significant bits: exact in bf16
    return hi.to(torch.bfloat16), mid.to(torch.bfloat16), lo.to(torch.bfloat16)


def scaled_payload_gemm(role: str, qa: QTensor, qb: QTensor, mm: Callable[[str, Tensor, Tensor], Tensor]) -> Tensor:
    """The GEMM of two tensor-wise or row-wise quantized operands as ``payload GEMM x row
    scales x column scales``: both scalings put their scales on the non-contraction axis, so
    they factor out of every dot product. ``mm(role, a, b)`` multiplies the payloads (FP8
    values, exact in bf16: a bf16 GEMM that accumulates in fp32 computes the fp32 GEMM's result
    up to fp32 rounding).

    Example:
        >>> x, w = torch.randn(8, 16), torch.randn(4, 16)
        >>> qa = quantize(x, Fp8Format.E4M3, Scaling.ROWWISE, axis=1)
        >>> qb = quantize(w, Fp8Format.E4M3, Scaling.ROWWISE, axis=1)
        >>> ref = gemm("forward", dequantize(qa), dequantize(qb))
        >>> out = scaled_payload_gemm("forward", qa, qb, lambda r, a, b: gemm(r, a.float(), b.float()))
        >>> bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-6))
        True
    """
    for q in (qa, qb):
        if q.scaling not in (Scaling.TENSORWISE, Scaling.ROWWISE):
            raise ValueError(f"scales factor out of the GEMM for tensor-wise and row-wise only, not {q.scaling}")
    out = mm(role, qa.data, qb.data)
    # Output rows follow operand a's non-contraction axis, columns operand b's.
    rows = qa.scale.float().reshape(-1, 1) if qa.scale.numel() > 1 else qa.scale.float().reshape(())
    cols = qb.scale.float().reshape(1, -1) if qb.scale.numel() > 1 else qb.scale.float().reshape(())
    return out * rows * cols


class Measurement:
    """Computes the statistics of one GEMM sample as a (SUM vector, MAX vector) pair laid out
    by a :class:`~loka_train.probe.window.WindowLayout`, graphed on CUDA.

    Args:
        config: the Probe's configuration (``backward_fmt_b``, ``block_size``,
            ``cuda_graphs``, ``max_cuda_graphs``).
        candidates: the candidates, in window order.
        layout: the slot layout the vectors follow.
        device: the device of the measured tensors; graphs are used on CUDA only.
    """

    def __init__(
        self,
        config: ProbeConfig,
        candidates: Sequence[Candidate],
        layout: WindowLayout,
        *,
        device: torch.device,
    ) -> None:
        self.config = config
        self.candidates = tuple(candidates)
        self.layout = layout
        self.graphs: CudaGraphs | None = None
        """The measurement graphs (None off CUDA or with ``cuda_graphs=False``)."""
        if config.cuda_graphs and device.type == "cuda":
            self.graphs = CudaGraphs(self.measure_selected, max_graphs=config.max_cuda_graphs)
        self.exact_bf16_gemms = device.type == "cuda"
        """On CUDA, shadow GEMMs whose operands are all bf16 values (FP8 payloads; bf16
        activations and gradients) run as bf16 GEMMs that accumulate and return fp32: exact
        products, sums equal to the fp32 GEMM's up to fp32 rounding, on tensor cores instead of
        fp32 SIMT. Off after a failure (``exact_gemm_fallback``)."""
        self.exact_gemm_fallback: str | None = None
        """Why the bf16-input GEMMs were turned off (logged once; the fp32 GEMMs run), or None."""
        self.fast_scalings = True
        """Tensor-wise and row-wise candidates quantize from the operand's amax already reduced,
        one division serving payload and counts, bit for bit what :func:`quantize` and
        :func:`clipped_counts` give (False: through those two, which the tests compare)."""

    def measure(
        self,
        role: str,
        a: Tensor,
        b: Tensor,
        nf_a: Tensor,
        nf_b: Tensor,
        out_ref: Tensor | None,
        *,
        graphable: bool,
    ) -> tuple[Tensor, Tensor]:
        """All statistics of one GEMM on the selected rows, as (SUM vector, MAX vector).

        Args:
            role: the GEMM role.
            a: operand a, cut to the selected rows (:func:`~loka_train.probe.sampling.select`).
            b: operand b, likewise.
            nf_a: non-finite values of the full operand a.
            nf_b: non-finite values of the full operand b.
            out_ref: the high-precision result on the selected rows, or None.
            graphable: whether a CUDA graph may run it (the caller passed no ``out_ref``).
        """
        if self.graphs is not None and graphable:
            return self.graphs.run(role, a, b, nf_a, nf_b)
        return self.measure_selected(role, a, b, nf_a, nf_b, out_ref)

    def measure_selected(
        self, role: str, a: Tensor, b: Tensor, nf_a: Tensor, nf_b: Tensor, out_ref: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`measure` without graphs (what the CUDA graphs capture)."""
        # Hooks run inside the model's autocast region: the shadow GEMMs must stay in fp32.
        with torch.autocast(device_type=a.device.type, enabled=False):
            return self._measure_fp32(role, a, b, nf_a, nf_b, out_ref)

    def _mm(self, role: str, a16: Tensor, b16: Tensor, fp32: Callable[[], Tensor]) -> Tensor:
        """``gemm(role)`` of operands whose values are all bf16 values, given in bf16: a bf16
        GEMM accumulating and returning fp32 where :attr:`exact_bf16_gemms` holds, else
        ``fp32()``, the fp32 GEMM of the same values (built only then)."""
        if self.exact_bf16_gemms:
            try:
                return gemm(role, a16, b16, out_dtype=torch.float32)
            except torch.OutOfMemoryError:
                raise  # not a missing GEMM: the fp32 one would need more memory still
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                self.exact_gemm_fallback = f"{type(exc).__name__}: {exc}".splitlines()[0]
                self.exact_bf16_gemms = False
                logger.warning(
                    "probe: bf16 GEMMs with an fp32 result failed (%s); the shadow GEMMs run in "
                    "fp32 from now on (slower sampled steps; statistics equal up to fp32 rounding)",
                    self.exact_gemm_fallback,
                )
        return fp32()

    def _split_mm(self, role: str, a16: Tensor, b32: Tensor, fp32: Callable[[], Tensor]) -> Tensor:
        """``gemm(role)`` of a bf16-valued `a16` and an fp32 `b32` (the forward's and the
        grad-input's fp32 weight) as three bf16 GEMMs returning fp32, one per bf16 part of
        `b32` (:func:`split_bf16`): every product is exact and the sums are fp32, so the result
        is the fp32 GEMM's up to the order of the sums, on tensor cores (the fp32 GEMM of a
        1024-row sample at 4096 x 4096 took 0.68 ms on an H100, as SIMT)."""
        parts = [self._mm(role, a16, part, fp32) for part in split_bf16(b32)]
        if not self.exact_bf16_gemms:  # a GEMM fell back (and gave fp32()): one fp32 GEMM
            return fp32()
        return parts[0] + parts[1] + parts[2]

    def _measure_fp32(
        self, role: str, a: Tensor, b: Tensor, nf_a: Tensor, nf_b: Tensor, out_ref: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        L, cfg = self.layout, self.config
        ax_a, ax_b = _ROLE_AXES[role]
        a_c = _clean(a)
        b_c = _clean(b)
        if out_ref is None:
            if _bf16_exact(a) and _bf16_exact(b):
                ref = self._mm(role, a_c.to(torch.bfloat16), b_c.to(torch.bfloat16), lambda: gemm(role, a_c, b_c))
            elif self.exact_bf16_gemms and _bf16_exact(a) and b_c.dtype == torch.float32:
                ref = self._split_mm(role, a_c.to(torch.bfloat16), b_c, lambda: gemm(role, a_c, b_c))
            else:
                ref = gemm(role, a_c, b_c)
        else:
            ref = _clean(out_ref.reshape(-1, out_ref.shape[-1]))
        dev = a_c.device
        sums: list[Tensor | None] = [None] * L.num_sum
        maxes: list[Tensor | None] = [None] * L.num_max
        # Fill kernels, not host-to-device copies: nothing here waits for the device.
        sums[L.count] = torch.ones((), device=dev)
        sums[L.signal] = ref.square().sum()
        operands = {"a": (a_c, nf_a, ax_a), "b": (b_c, nf_b, ax_b)}
        nnz: dict[str, Tensor] = {}
        nonzero: dict[str, Tensor] = {}
        num_zeros: dict[str, Tensor] = {}
        zero = torch.zeros((), device=dev)
        amaxes: dict[tuple[str, Scaling], Tensor] = {}
        for o, (x, nf, axis) in operands.items():
            row_amax_G = x.abs().amax(dim=axis)
            # What compute_scale would reduce again for these two scalings (same values: the
            # max of |x|), kept in the layouts of QTensor.scale.
            amaxes[(o, Scaling.ROWWISE)] = row_amax_G.unsqueeze(axis)
            nonzero[o] = x != 0
            nnz_i = nonzero[o].sum()
            nnz[o] = nnz_i.float()
            sums[L.numel[o]] = torch.full((), float(x.numel()), device=dev)
            num_zeros[o] = x.numel() - nnz_i  # int64: exact at any size
            sums[L.nnz[o]] = nnz[o]
            sums[L.sumsq[o]] = x.square().sum()
            sums[L.nonfinite[o]] = nf.float()
            maxes[L.amax[o]] = amaxes[(o, Scaling.TENSORWISE)] = row_amax_G.amax()
            maxes[L.neg_row_min[o]] = -torch.where(row_amax_G > 0, row_amax_G, math.inf).amin()
        # Quantized operands and their counts, shared by candidates with the same (format,
        # scaling) for an operand (operand b of the backward GEMMs has one format).
        cache: dict[tuple[str, Fp8Format, Scaling], tuple[QTensor, Tensor, Tensor]] = {}

        def quantized(o: str, fmt: Fp8Format, scaling: Scaling) -> tuple[QTensor, Tensor, Tensor]:
            hit = cache.get((o, fmt, scaling))
            if hit is not None:
                return hit
            x, _, axis = operands[o]
            amax = amaxes.get((o, scaling)) if self.fast_scalings else None
            if amax is not None:
                # quantize() and clipped_counts() in fewer passes, bit for bit: the amax is the
                # operand's (computed above), the scaled values are divided once for the
                # payload and the counts, and every scale is finite (the operands are cleaned).
                # Nothing saturates: every scale is at least its group's amax / fmt.max, so
                # |x / scale| <= fmt.max up to one rounding, far below the count's 1e-6 margin.
                # The zeros are all below min_subnormal: the underflowing non-zero values are
                # the values below it minus the zeros (counted in int64, then converted once,
                # as the reference converts its count).
                scale = scale_from_amax(amax, fmt)
                scaled = x / (scale.reshape(1, 1) if scale.ndim == 0 else scale)
                q = QTensor(data=scaled.to(fmt.dtype), scale=scale, fmt=fmt, scaling=scaling, axis=axis)
                below = (scaled.abs() < fmt.min_subnormal).sum()
                cache[(o, fmt, scaling)] = out = (q, zero, (below - num_zeros[o]).float())
                return out
            kw: dict[str, Any] = {}
            if scaling is Scaling.BLOCK:
                kw = {"block_size": cfg.block_size, "block_2d": o == "b" and _B_IS_WEIGHT[role]}
            q = quantize(x, fmt, scaling, axis=axis, **kw)
            sat, und = clipped_counts(x, fmt, scaling, nonzero=nonzero[o], axis=axis, scale=q.scale, **kw)
            cache[(o, fmt, scaling)] = out = (q, sat, und)
            return out

        # bf16 copies of the FP8 payloads, once per payload (candidates share operand b).
        payload16: dict[int, Tensor] = {}

        def quantize_together(o: str, fmt: Fp8Format, scalings: list[Scaling]) -> None:
            """`quantized` for tensor-wise and row-wise `scalings` of operand `o` in `fmt` at
            once, stacked on a new first axis: one scale computation, division, cast and
            underflow count for all of them instead of one each (a sampled step is hundreds
            of such small kernels), and one bf16 copy of their payloads where the GEMMs take
            bf16. Every value is the one `quantized` computes alone (the same elementwise
            operations; the tensor-wise scale broadcast to the row-wise one's shape)."""
            x, _, axis = operands[o]
            rows = amaxes[(o, Scaling.ROWWISE)]  # x's shape with the contraction axis reduced to 1
            scale_S = scale_from_amax(torch.stack([amaxes[(o, s)].expand_as(rows) for s in scalings]), fmt)
            scaled_S = x / scale_S
            payload_S = scaled_S.to(fmt.dtype)
            # As in `quantized`: nothing saturates; the non-zero values below min_subnormal underflow.
            below_S = (scaled_S.abs() < fmt.min_subnormal).sum(dim=(1, 2))
            underflow_S = (below_S - num_zeros[o]).float()
            payload16_S = payload_S.to(torch.bfloat16) if self.exact_bf16_gemms else None
            for i, scaling in enumerate(scalings):
                scale = scale_S[i] if scaling is Scaling.ROWWISE else scale_S[i].reshape(-1)[0]
                q = QTensor(data=payload_S[i], scale=scale, fmt=fmt, scaling=scaling, axis=axis)
                cache[(o, fmt, scaling)] = (q, zero, underflow_S[i])
                if payload16_S is not None:
                    payload16[id(q.data)] = payload16_S[i]

        if self.fast_scalings:
            together: dict[tuple[str, Fp8Format], list[Scaling]] = {}
            for cand in self.candidates:
                if cand.scaling in (Scaling.TENSORWISE, Scaling.ROWWISE):
                    for o, fmt in (("a", cand.fmt), ("b", operand_b_format(role, cand.fmt, cfg.backward_fmt_b))):
                        group = together.setdefault((o, fmt), [])
                        if cand.scaling not in group:
                            group.append(cand.scaling)
            for (o, fmt), scalings in together.items():
                if len(scalings) > 1:  # alone, `quantized` does it in fewer kernels
                    quantize_together(o, fmt, scalings)

        def as_bf16(payload: Tensor) -> Tensor:
            out = payload16.get(id(payload))
            if out is None:
                out = payload16[id(payload)] = payload.to(torch.bfloat16)
            return out

        approxes: list[Tensor] = []
        for c, cand in enumerate(self.candidates):
            q_a, sat_a, und_a = quantized("a", cand.fmt, cand.scaling)
            fmt_b = operand_b_format(role, cand.fmt, cfg.backward_fmt_b)
            q_b, sat_b, und_b = quantized("b", fmt_b, cand.scaling)
            if self.exact_bf16_gemms and cand.scaling in (Scaling.TENSORWISE, Scaling.ROWWISE):
                approx = scaled_payload_gemm(
                    role, q_a, q_b,
                    lambda r, pa, pb: self._mm(r, as_bf16(pa), as_bf16(pb),
                                               lambda: gemm(r, pa.float(), pb.float())),
                )
            else:
                approx = gemm(role, dequantize(q_a), dequantize(q_b))
            approxes.append(approx)
            sums[L.saturated["a"] + c], sums[L.underflow["a"] + c] = sat_a, und_a
            sums[L.saturated["b"] + c], sums[L.underflow["b"] + c] = sat_b, und_b
        # Every candidate's squared error in one pass over the stacked results (one candidate:
        # no stack to pay for).
        if len(approxes) > 1:
            # In place on the stack, the candidates' outputs let go first: ((a - r)^2 is (r - a)^2.)
            diff_C = torch.stack(approxes)
            approxes.clear()
            errors_C = diff_C.sub_(ref).square_().sum(dim=(1, 2))
        else:
            errors_C = (ref - approxes[0]).square().sum().reshape(1)
        for c in range(len(self.candidates)):
            sums[L.error + c] = errors_C[c]
        assert all(t is not None for t in sums) and all(t is not None for t in maxes)
        vec_sum = torch.stack([t.float() for t in sums])  # type: ignore[union-attr]
        vec_max = torch.stack([t.float() for t in maxes])  # type: ignore[union-attr]
        return vec_sum.to(torch.float64), vec_max.to(torch.float64)


class _Staging:
    """Input buffers that the graphs of a :class:`CudaGraphs` share: one per operand position,
    as large as the largest operand yet, each graph reading views at its start.

    Replays run one at a time on one stream and each copies its inputs in just before, so
    one set of buffers serves every graph: the static inputs cost the largest sample's
    operands, not their sum over the (site, role, shape) graphs (dozens on Wukong, each with
    a ``max_rows`` x K activation and a cut weight). A buffer too small for a new graph is
    replaced by one at least twice as large; the graphs captured on the old one keep it (their
    views hold it), so no graph is captured again, and all the buffers together stay below
    twice the last ones.

    Example:
        >>> staging = _Staging()
        >>> views = staging.views((torch.zeros(4, 8), torch.zeros(())))
        >>> [tuple(v.shape) for v in views]
        [(4, 8), ()]
    """

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []

    def views(self, operands: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Contiguous views of the shared buffers with the shapes and dtypes of `operands`
        (their values are not copied)."""
        views = []
        for i, t in enumerate(operands):
            nbytes = t.numel() * t.element_size()
            buf = self._buffers[i] if i < len(self._buffers) else None
            if buf is not None:
                assert buf.device == t.device, "a Probe's operands are on its device"
            if buf is None or buf.numel() < nbytes:
                buf = torch.empty(max(nbytes, 2 * buf.numel() if buf is not None else 0), dtype=torch.uint8,
                                  device=t.device)
                if i < len(self._buffers):
                    self._buffers[i] = buf
                else:
                    self._buffers.append(buf)
            views.append(buf[:nbytes].view(t.dtype).view(t.shape))
        return tuple(views)

    @property
    def nbytes(self) -> int:
        """Bytes of the current buffers (earlier, smaller ones live on in the graphs that read them)."""
        return sum(b.numel() for b in self._buffers)


class CudaGraphs:
    """Replays the measurement of each (role, operand shapes and dtypes) as one CUDA graph.

    A sample is a few hundred small kernels; launched eagerly, their CPU cost dominates
    the probe's overhead. Captured once, a replay is one launch. Its inputs are the rows that
    :func:`~loka_train.probe.sampling.select` chose (at most ``max_rows``) and the two
    non-finite counts, copied into static buffers; the full operands never enter a graph (at
    batch 32768 their copies were a large part of a sample's cost,
    ``bench/results/e2e_graph_outputs_h100_2026-11-25d/NOTES.md``). The graphs read their
    inputs from shared buffers (:class:`_Staging`), so they cost about one sample's operands,
    not one copy per graph. Outputs are copied out of static buffers by the caller. All graphs share one
    memory pool: every tensor allocated during a capture is dead at its end (outputs are written
    into buffers allocated outside the pool), so replays in any order cannot clobber each other's
    live memory.

    Costs and fallbacks: a capture synchronizes the device once (``torch.cuda.graph``), on the
    first sample of each shape. Beyond ``max_graphs`` shapes, or if a capture fails, the
    measurement runs eagerly (same numbers); both are logged and counted (``num_eager``).

    Args:
        measure: the eager measurement, ``(role, a, b, nf_a, nf_b) -> (SUM, MAX)``.
        max_graphs: most graphs kept.
    """

    def __init__(self, measure: MeasureFn, *, max_graphs: int) -> None:
        self._measure = measure
        self._max_graphs = max_graphs
        self._entries: dict[tuple, tuple[tuple[Tensor, ...], Any, Tensor, Tensor]] = {}
        self._staging = _Staging()
        self._pool: Any = None
        self.disabled_reason: str | None = None
        self.num_captures = 0
        self.num_eager = 0
        self._warned_full = False

    def run(self, role: str, *operands: Tensor) -> tuple[Tensor, Tensor]:
        """The measurement of ``operands`` (a, b, nf_a, nf_b): a replay, a capture, or eager."""
        key = (role, operands[0].device, *((tuple(t.shape), t.dtype) for t in operands))
        entry = self._entries.get(key)
        if entry is None:
            if self.disabled_reason is not None or len(self._entries) >= self._max_graphs:
                self.num_eager += 1
                if self.disabled_reason is None and not self._warned_full:
                    self._warned_full = True
                    logger.warning(
                        "probe: %d CUDA graphs cached (max_cuda_graphs); new shapes such as "
                        "%s/%s x %s (selected rows) are measured eagerly (slower, same numbers)",
                        self._max_graphs, role, tuple(operands[0].shape), tuple(operands[1].shape),
                    )
                return self._measure(role, *operands)
            try:
                entry = self._capture(role, operands)
            except RuntimeError as exc:
                self.disabled_reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                self.num_eager += 1
                logger.warning(
                    "probe: CUDA graph capture failed (%s); measuring eagerly from now on "
                    "(slower, same numbers)", self.disabled_reason,
                )
                return self._measure(role, *operands)
            self._entries[key] = entry
        statics, graph, out_sum, out_max = entry
        for static, given in zip(statics, operands):
            static.copy_(given)
        graph.replay()
        return out_sum, out_max

    def _capture(self, role: str, operands: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], Any, Tensor, Tensor]:
        statics = self._staging.views(operands)
        for static, given in zip(statics, operands):
            static.copy_(given)
        device = operands[0].device
        side = capture_stream(device)  # one per device: each new stream keeps a cuBLAS workspace
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # Warm-up outside the capture (lazy inits, cuBLAS workspaces); also this sample.
            vec_sum, vec_max = self._measure(role, *statics)
            out_sum, out_max = vec_sum.clone(), vec_max.clone()
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            vec_sum, vec_max = self._measure(role, *statics)
            out_sum.copy_(vec_sum)
            out_max.copy_(vec_max)
        self.num_captures += 1
        logger.debug("probe: captured a CUDA graph for %s %s", role, [tuple(t.shape) for t in operands])
        return statics, graph, out_sum, out_max
