"""Plans re-decided for an inference batch size: an FP8 forward only where it pays there.

Training decides each site's plan at the training batch, its backward's casts weighed in; a
served model runs at another batch size and casts only its inputs. :func:`decide_for_batch`
times, at the shapes one call of the served model gives each site, the site's FP8 candidates
against high precision, the way a served site runs them: the FP8 GEMM on pre-quantized operands
plus the quantization of its input (a weight quantized once is not charged), against the bf16
GEMM (:func:`~loka_train.dispatch.ledger.measure_ledger`; CUDA-graph replays on a GPU). A site
whose weight is not quantized once (a batched ``bmm`` site's second activation, a horizontally
fused site's concatenated weight, ``ServeConfig.quantize_weights_once`` off) pays that cast too;
a site with the ReLU before it folded in pays the ReLU pass where its cast does not apply it, as
bf16 does.

The candidates are the trained FP8 forward and, given ``safe`` (:class:`SafeForwards`, e.g.
``TrainedModel.safe_forwards``), every FP8 forward the Probe judged safe for the site when
training stopped, made from the run's Dispatch config (its scalings and backends) where a
backend takes the serving shape: a site that trained in bf16 because its backward's casts cost
more than its GEMMs saved may pay in inference. The fastest candidate is kept where it is at
least ``margin`` times faster than bf16, else the site runs in high precision.

Example:
    >>> plans, rows = decide_for_batch(served, lambda m: m(dense, sparse), device=torch.device("cuda"))
    >>> serve(served, plans=plans)
    >>> print(format_decisions(rows))
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loka_train.dispatch import planning
from loka_train.dispatch.config import DispatchConfig
from loka_train.dispatch.ledger import Fp8Times, Ledger, LedgerGemm, LedgerRow, measure_ledger
from loka_train.export.serving import weight_servable_sites
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.mods.convert import sites as find_sites
from loka_train.mods.planned import fp8_padding
from loka_train.mods.site import Site

logger = logging.getLogger(__name__)

__all__ = ["InferenceDecision", "SafeForwards", "decide_for_batch", "format_decisions", "forward_ledger"]


@dataclass(frozen=True)
class SafeForwards:
    """The FP8 forwards a run's Probe judged safe, per site: the inference candidates besides
    the trained plan.

    Attributes:
        verdicts: the Probe's verdicts when training stopped (``Probe.verdicts()``), keyed
            ``(site, role, fmt, scaling)``; only the forward's are read.
        config: the run's Dispatch config: the scalings, backends and forward format the
            candidates are made of, as Dispatch makes its own.
    """

    verdicts: Mapping[Any, Any]
    config: DispatchConfig

    def plans(self, name: str, site: Site, shape: tuple[int, int, int], *, device_type: str,
              out_dtype: torch.dtype) -> list[GemmPlan]:
        """`site`'s FP8 forwards at `shape` that a backend takes (K and N padded where the site
        pads) and the site can run, whose verdict is safe; in Dispatch's config order."""
        plans, _ = planning.candidates(
            self.config, "forward", shape, device_type=device_type, out_dtype=out_dtype,
            pad_to_multiple=site.pad_to_multiple, current=site.plan, site_supports=site.supports_plan,
        )
        # A served forward pads K and N only (the rows only where grad-weight runs FP8, which
        # serving never does): a plan whose backend needs the rows padded at this M cannot serve.
        m, k, n = shape
        return [p for p in planning.eligible(self.verdicts, name, "forward", plans)
                if fp8_padding(LinearPlan(forward=p), m, k, n, site.pad_to_multiple, device_type, out_dtype,
                               False) is not None]


@dataclass(frozen=True)
class InferenceDecision:
    """One site's forward at an inference batch: its times and what was chosen."""

    site: str
    shape: tuple[int, int, int]
    """(M, K, N) of the forward at this batch."""
    trained: str
    """The trained forward plan."""
    high_ms: float
    """The bf16 GEMM, and the ReLU pass before it where the site has one folded in."""
    fp8_ms: float
    """The fastest FP8 candidate: its GEMM, its input's quantization, its weight's where that is
    not made once, and the ReLU pass where its cast does not apply it (inf where every backend
    failed at this shape)."""
    chosen: str
    """The plan chosen (the trained one, or another the Probe judged safe), or "high"."""

    @property
    def speedup(self) -> float:
        return self.high_ms / self.fp8_ms if self.fp8_ms > 0 else float("inf")


def forward_ledger(
    model: nn.Module,
    run: Callable[[nn.Module], Any],
    *,
    device: torch.device,
    plans: Mapping[str, LinearPlan] | None = None,
    safe: SafeForwards | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> Ledger:
    """The forward GEMMs `model` runs in FP8 (`plans`' forwards, default each site's own), and
    with `safe` every forward that has a safe FP8 candidate, at the shapes one call (`run`,
    eager, under ``torch.no_grad()``) gives its sites, each timed in bf16 and in its FP8
    candidates (the plan's, `safe`'s at that shape in `out_dtype`;
    :func:`~loka_train.dispatch.ledger.measure_ledger`), as a served site runs them: the ReLU pass
    a folded site's bf16 forward runs charged, tensor-wise inputs with static scales where the
    site has them. A row's plan is the site's (high precision for a site `safe` adds). Sites
    the call did not reach are left out.

    Raises:
        ValueError: where `plans` names sites the model does not have.
    """
    return _forward_ledger(model, run, device, plans, safe, out_dtype, timer)[0]


def _forward_ledger(
    model: nn.Module, run: Callable[[nn.Module], Any], device: torch.device, plans: Mapping[str, LinearPlan] | None,
    safe: SafeForwards | None, out_dtype: torch.dtype, timer: Callable[[Callable[[], object]], float] | None,
    fast_accum: bool = False,
) -> tuple[Ledger, dict[str, tuple[GemmPlan, ...]]]:
    """:func:`forward_ledger`, and each timed site's FP8 candidates (with their backends' fast
    accumulation where `fast_accum`)."""
    found = find_sites(model)
    unknown = sorted(set(plans or {}) - set(found))
    if unknown:
        raise ValueError(f"forward_ledger: plans name sites the model does not have: {unknown}")
    with torch.no_grad():
        run(model)
    gemms = _forward_gemms(found, plans, safe, device, out_dtype)
    if fast_accum:
        gemms = [dataclasses.replace(g, plan=g.plan.with_fast_accum(),
                                     candidates=tuple(dict.fromkeys(p.with_fast_accum() for p in g.candidates)))
                 for g in gemms]
    candidates = {g.site: g.candidates for g in gemms}
    order = {g.site: i for i, g in enumerate(gemms)}
    parts = []
    with torch.autocast(device.type, enabled=False):  # the ledger times its own dtypes
        for static in (False, True):
            group = [g for g in gemms if (found[g.site].static_slots is not None) == static]
            if group:
                parts.append(measure_ledger(group, device=device, timer=timer, static_scales=static))
    if not parts:
        return Ledger(rows=[], device=str(device), timing="none", notes=["no FP8 forward ran"]), candidates
    return Ledger(rows=sorted((r for part in parts for r in part.rows), key=lambda r: order[r.site]),
                  device=parts[0].device, timing=parts[0].timing,
                  notes=list(dict.fromkeys(n for part in parts for n in part.notes))), candidates


def _forward_gemms(found: Mapping[str, Site], plans: Mapping[str, LinearPlan] | None, safe: SafeForwards | None,
                   device: torch.device, out_dtype: torch.dtype) -> list[LedgerGemm]:
    """The ledger's GEMMs (:func:`forward_ledger`) at the forward shapes the sites recorded."""
    gemms = []
    for name, site in found.items():
        shape = site.gemm_shapes()["forward"]
        if shape[0] <= 0:
            continue
        plan = (plans or {}).get(name, site.plan).forward
        options = [plan] if plan.is_fp8 else []
        if safe is not None:
            options += [p for p in safe.plans(name, site, shape, device_type=device.type, out_dtype=out_dtype)
                        if p not in options]
        if options:
            # No grad-weight: nothing runs a backward, so a folded ReLU never runs again there.
            gemms.append(LedgerGemm(name, "forward", shape, plan, tuple(options),
                                    input_relu=bool(site.input_relu), grad_weight_plan=None))
    return gemms


def decide_for_batch(
    model: nn.Module,
    run: Callable[[nn.Module], Any],
    *,
    device: torch.device,
    plans: Mapping[str, LinearPlan] | None = None,
    safe: SafeForwards | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    quantize_weights_once: bool = True,
    fast_accum: bool = False,
    margin: float = 1.0,
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> tuple[dict[str, LinearPlan], list[InferenceDecision]]:
    """Each site's forward plan for the batch `run` feeds `model`.

    Args:
        model: a served model (:func:`~loka_train.export.serve`) or a converted one.
        run: one call of the model at the inference batch, e.g. ``lambda m: m(dense, sparse)``
            (run eagerly under ``torch.no_grad()``: the sites record their shapes).
        device: where to time.
        plans: the trained plans (default: each site's current plan).
        safe: more candidates, the FP8 forwards the Probe judged safe (:class:`SafeForwards`,
            ``TrainedModel.safe_forwards``); None: the trained FP8 forward only.
        out_dtype: the served compute dtype (what the backends must write).
        quantize_weights_once: as the model will be served (``ServeConfig``): where on, an FP8
            linear layer's weight cast is not charged.
        fast_accum: as the model will be served (``ServeConfig``): every candidate is timed
            and chosen with its backend's fast accumulation where it has one.
        margin: an FP8 forward is chosen where ``high_ms >= margin * fp8_ms``.
        timer: ``timer(fn) -> ms`` (default: graph replays on a GPU, the host clock elsewhere).

    Returns:
        The plans (the forward only: nothing serves a backward) and one row per site with an
        FP8 candidate that the call reached (one it did not reach keeps its plan).

    Raises:
        ValueError: for ``margin <= 0``, or plans naming sites the model does not have.
    """
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    found = find_sites(model)
    trained = {name: (plans or {}).get(name, site.plan) for name, site in found.items()}
    ledger, options = _forward_ledger(model, run, device, plans, safe, out_dtype, timer, fast_accum)
    once = weight_servable_sites(model) if quantize_weights_once else set()
    out = {name: LinearPlan(forward=plan.forward) for name, plan in trained.items()}
    rows = []
    for row in ledger.rows:
        best = _fastest(row, options[row.site], weight_once=row.site in once)
        fp8_ms = float("inf") if best is None else best[1]
        keep = best is not None and row.high_total_ms >= margin * fp8_ms
        chosen = best[0] if keep and best is not None else None
        out[row.site] = LinearPlan() if chosen is None else LinearPlan(forward=chosen)
        rows.append(InferenceDecision(
            site=row.site, shape=row.shape, trained=str(trained[row.site].forward), high_ms=row.high_total_ms,
            fp8_ms=fp8_ms, chosen="high" if chosen is None else str(chosen),
        ))
        if chosen is None:
            logger.info("decide_for_batch: %s runs its forward in high precision at %s (bf16 %.4f ms, FP8 %.4f ms)",
                        row.site, "x".join(map(str, row.shape)), row.high_total_ms, fp8_ms)
    return out, rows


def _fastest(row: LedgerRow, candidates: tuple[GemmPlan, ...], *, weight_once: bool) -> tuple[GemmPlan, float] | None:
    """The one of `row`'s `candidates` a served site runs fastest, and its ms as served: the GEMM, the
    input's cast, the ReLU pass where the cast does not apply it, the weight's cast where it is
    not made once. None where no candidate has a time (the backends failed at this shape)."""
    def served_ms(t: Fp8Times) -> float:
        return t.gemm_ms + t.quant_a_ms + t.relu_ms + (0.0 if weight_once else t.quant_b_ms)

    times = {t.plan: t for t in row.fp8}
    timed = [(plan, served_ms(times[str(plan)])) for plan in candidates if str(plan) in times]
    timed = [(p, ms) for p, ms in timed if math.isfinite(ms)]
    return min(timed, key=lambda o: o[1]) if timed else None


def format_decisions(rows: list[InferenceDecision]) -> str:
    """The decisions as a Markdown table."""
    lines = ["| site | M x K x N | trained forward | bf16 ms | FP8 ms (input cast incl.) | x | chosen |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.site} | {'x'.join(map(str, r.shape))} | {r.trained} | {r.high_ms:.4f} | "
                     f"{r.fp8_ms:.4f} | {r.speedup:.2f} | {r.chosen} |")
    return "\n".join(lines)
