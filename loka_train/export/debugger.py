"""Numerics debugger: where a served model loses precision, site by site, on one batch.

:func:`compare_sites` runs the model once (``run(model)``, e.g. one forward on a held-out
batch) and, for every site that runs, measures:

* **local error**: the site's output against the same GEMM in fp32 on the *same* input (the
  LayerNorm, ReLU and bias it applies included), as SQNR in dB (of the whole output, and the
  10% quantile over its rows, the samples) and as the largest error relative to the output's
  largest magnitude: what this site's FP8 costs by itself;
* **saturation and underflow** of the site's FP8 input (``x``, or ``a`` of a batched site): the
  fraction beyond what its static scale represents (such a tensor is cast with its dynamic
  scale instead, and counted), and the fraction of nonzero values its cast flushes to zero;
* **drift** (with a ``reference`` model, e.g. the same weights with every plan in high
  precision): the site's output against the reference's output at the same site, the errors
  of every site before it included: where the served model's activations leave the
  reference's.

A site with a low local SQNR hurts by itself; one with a high local SQNR and a low drift SQNR
inherits the error of the sites before it. :func:`format_numerics` prints the rows as a table.

Example::

    rows = compare_sites(served, lambda m: m.model(dense, sparse), reference=high_model)
    print(format_numerics(rows))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loka_train.kernels import static_scales
from loka_train.kernels.formats import SQNR_CAP_DB, QTensor, Scaling, dequantize, sqnr_db
from loka_train.kernels.fused import apply_activation
from loka_train.kernels.linear import quantize_operand
from loka_train.mods.convert import sites as find_sites
from loka_train.mods.site import Fp8Linear, GemmSite, Site

__all__ = ["SiteNumerics", "compare_sites", "format_numerics", "low_quantile", "row_sqnr_db"]

ROW_QUANTILE = 0.1
"""The low quantile of the rows' SQNR that :class:`SiteNumerics` reports (the Probe's default)."""


@dataclass(frozen=True)
class SiteNumerics:
    """The numerics of one site's forward on the debugged batch."""

    site: str
    plan: str
    """The forward plan the site ran."""
    local_sqnr_db: float
    """Its output against the same GEMM in fp32 on the same input (200 dB: identical)."""
    local_row_sqnr_low_db: float
    """The 10% quantile of that SQNR over the output's rows (samples): a few samples whose
    inputs the cast flushes or clips show here where the whole output's SQNR hides them."""
    local_max_rel_err: float
    """Largest absolute error against that fp32 output, over the fp32 output's largest magnitude."""
    saturated: float
    """Fraction of its FP8 input beyond the largest value its static scale represents (a tensor
    that does not fit is cast with its dynamic scale instead and counted as the site's
    static-scale fallback: nothing clips); 0 with dynamic scales or high precision."""
    underflow: float
    """Fraction of its nonzero FP8 input that the cast flushes to zero (0 for high precision)."""
    drift_sqnr_db: float | None
    """Its output against the reference model's at the same site; None without a reference."""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class _Call:
    """The first call of a site in the debugged run: what it computed and its fp32 version."""

    output: Tensor
    reference_fp32: Tensor
    saturated: float
    underflow: float


def compare_sites(
    model: nn.Module, run: Callable[[nn.Module], object], *, reference: nn.Module | None = None
) -> list[SiteNumerics]:
    """Run ``run(model)`` (and ``run(reference)``) once and measure the first call of every site
    that ran (see the module docstring), in the order the sites first ran. The models run as
    they are (call it under ``torch.no_grad()`` and the autocast the model serves under): like
    any call, it may re-seed a static-scale slot that does not fit the batch.

    Args:
        model: a model with LoKA sites (served with :func:`~loka_train.export.serve`, or not).
        run: one forward of a model, e.g. ``lambda m: m.model(dense, sparse)``.
        reference: a model with the same site names (the same weights with high-precision
            plans) for the drift column; None leaves it out.

    Raises:
        ValueError: where `model` has no site, or no site ran.
    """
    found = find_sites(model)
    if not found:
        raise ValueError("compare_sites: the model has no LoKA site (loka_train.mods.convert it first)")
    with _capturing(found) as calls:
        run(model)
    if not calls:
        raise ValueError("compare_sites: no site of the model ran in run(model)")
    drift: dict[str, float] = {}
    if reference is not None:
        ref_sites = find_sites(reference)
        with _capturing(ref_sites) as ref_calls:
            run(reference)
        for name, call in calls.items():
            if name in ref_calls:
                drift[name] = float(sqnr_db(ref_calls[name].output, call.output))
    rows = []
    for name, call in calls.items():
        out32, ref32 = call.output.float(), call.reference_fp32
        peak = float(ref32.abs().max()) if ref32.numel() else 0.0
        err = float((out32 - ref32).abs().max()) if ref32.numel() else 0.0
        rows.append(
            SiteNumerics(
                site=name,
                plan=str(found[name].plan.forward),
                local_sqnr_db=float(sqnr_db(ref32, out32)),
                local_row_sqnr_low_db=low_quantile(row_sqnr_db(ref32, out32), ROW_QUANTILE),
                local_max_rel_err=err / peak if peak > 0 else (0.0 if err == 0 else math.inf),
                saturated=call.saturated,
                underflow=call.underflow,
                drift_sqnr_db=drift.get(name),
            )
        )
    return rows


def format_numerics(rows: list[SiteNumerics]) -> str:
    """The rows of :func:`compare_sites` as a fixed-width table, lowest local SQNR first."""
    head = ("site", "forward plan", "local SQNR dB", "rows q10 dB", "max rel err", "saturated", "underflow",
            "drift SQNR dB")
    body = [
        (
            r.site, r.plan, f"{r.local_sqnr_db:.1f}", f"{r.local_row_sqnr_low_db:.1f}", f"{r.local_max_rel_err:.2e}",
            f"{r.saturated:.2%}",
            f"{r.underflow:.2%}",
            "-" if r.drift_sqnr_db is None else f"{r.drift_sqnr_db:.1f}",
        )
        for r in sorted(rows, key=lambda r: r.local_sqnr_db)
    ]
    table = [head, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


def row_sqnr_db(ref: Tensor, out: Tensor) -> Tensor:
    """SQNR in dB of every row (every sample, the last dim the features) of `out` against
    `ref`, fp32 on their device; an exact row gives ``SQNR_CAP_DB``."""
    n = ref.shape[-1] if ref.ndim else 1
    ref32, out32 = ref.detach().float().reshape(-1, n), out.detach().float().reshape(-1, n)
    signal = torch.linalg.vector_norm(ref32, dim=1)
    noise = torch.linalg.vector_norm(ref32 - out32, dim=1)
    sqnr = 20 * torch.log10(signal / noise)
    return torch.where(noise == 0, torch.full_like(sqnr, SQNR_CAP_DB), sqnr)


def low_quantile(values: Tensor, q: float) -> float:
    """The `q` quantile of `values` (the lower one of two neighbours), NaN where it is empty."""
    if values.numel() == 0:
        return math.nan
    ordered = values.flatten().sort().values
    return float(ordered[min(ordered.numel() - 1, int(q * ordered.numel()))])


# ----------------------------------------------------------------------------- capture
def _static_scale(site: Site) -> float:
    """The site's static scale of ``x`` (0: none, or not seeded yet)."""
    slots = site.static_slots
    if slots is None or site.plan.forward.scaling is not Scaling.TENSORWISE:
        return 0.0
    return float(slots[0, static_scales.SCALE])


def _input_fractions(site: Site, x: Tensor, static_scale: float) -> tuple[float, float]:
    """``(saturated, underflow)`` of ``x`` under the site's forward plan: the fraction beyond
    the largest value `static_scale` (the one the call found) represents, and the fraction of
    nonzero values its cast flushes to zero."""
    gemm = site.plan.forward
    if not gemm.is_fp8 or x.numel() == 0:
        return 0.0, 0.0
    x_2d = x.reshape(-1, x.shape[-1]).float()
    saturated = 0.0
    if static_scale > 0:
        saturated = float((x_2d.abs() > gemm.fmt.max * static_scale).float().mean())
    if static_scale > 0:
        # The cast the call ran: the static scale where the tensor fits it (a copy of the slot).
        assert site.static_slots is not None  # a static scale was read from them
        slot = site.static_slots[0].clone()
        slot[static_scales.SCALE] = static_scale
        codes, scale = static_scales.quantize_static_reference(x_2d, slot, gemm.fmt)
        dequantized = codes.float() * scale
    else:
        q: QTensor = quantize_operand(x_2d, gemm.fmt, gemm, is_weight=False, reference_quantizer=True)
        dequantized = dequantize(q)
    nonzero = x_2d != 0
    flushed = nonzero & (dequantized == 0)
    underflow = float(flushed.sum()) / max(1, int(nonzero.sum()))
    return saturated, underflow




@contextlib.contextmanager
def _capturing(found: Mapping[str, Site], *, fractions: bool = True) -> Iterator[dict[str, _Call]]:
    """Record the first call of every site (its output, the fp32 reference of that output and,
    with `fractions`, its input's saturation and underflow) while the block runs; the sites'
    methods are wrapped on the instances for the block only."""
    calls: dict[str, _Call] = {}
    depth = {"n": 0}
    wrapped: list[tuple[Site, str]] = []

    def record(name: str, site: Site, fn: Callable[..., Any], ref: Callable[..., tuple[Tensor, Tensor]]):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = depth["n"] == 0
            # Before the call: a tensor its static scale does not fit re-seeds the slot.
            static_scale = _static_scale(site) if fractions and outer and name not in calls else 0.0
            depth["n"] += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                depth["n"] -= 1
            if outer and name not in calls and isinstance(out, Tensor):
                with torch.no_grad():
                    ref32, x_q = ref(*args, **kwargs)
                    measured = _input_fractions(site, x_q, static_scale) if fractions else (math.nan, math.nan)
                    calls[name] = _Call(out.detach(), ref32, *measured)
            return out

        return wrapper

    def linear_ref(site: GemmSite):
        def ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, input_relu: bool | None = None):
            relu = site.input_relu if input_relu is None else input_relu
            x32 = torch.relu(x.float()) if relu else x.float()
            return F.linear(x32, weight.float(), None if bias is None else bias.float()), x32

        return ref

    def fp8_linear_ref(site: Fp8Linear):
        def ref(x: Tensor, *, input_relu: bool | None = None):
            bias = site.active_bias()
            return linear_ref(site)(x, site.weight, bias, input_relu=input_relu)

        return ref

    def norm_ref(site: Fp8Linear):
        def ref(x: Tensor, norm: nn.LayerNorm, *, activation: str = "relu"):
            h32 = F.layer_norm(x.float(), norm.normalized_shape, None if norm.weight is None else norm.weight.float(),
                               None if norm.bias is None else norm.bias.float(), norm.eps)
            bias = site.active_bias()
            z = F.linear(h32, site.weight.float(), None if bias is None else bias.float())
            return apply_activation(z, activation), h32

        return ref

    def bmm_ref(a: Tensor, bt: Tensor):
        return torch.bmm(a.float(), bt.float()), a

    try:
        for name, site in found.items():
            if isinstance(site, Fp8Linear):
                targets = [("forward", fp8_linear_ref(site)), ("forward_layernorm", norm_ref(site))]
            elif isinstance(site, GemmSite):
                targets = [("linear", linear_ref(site))]
            elif site.kind == "bmm":
                targets = [("forward", bmm_ref)]
            else:
                continue
            for attr, ref in targets:
                if attr in site.__dict__:
                    raise ValueError(
                        f"{name}: its {attr} is already wrapped (compare_sites or a Monitor's sampled call "
                        "is running): they cannot run inside one another"
                    )
                setattr(site, attr, record(name, site, getattr(site, attr), ref))
                wrapped.append((site, attr))
        yield calls
    finally:
        for site, attr in wrapped:
            del site.__dict__[attr]
