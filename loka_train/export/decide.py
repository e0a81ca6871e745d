"""Plans re-decided for an inference batch size: keep an FP8 forward only where it pays there.

Training decides each site's plan at the training batch; a served model may run at another
batch size, where a forward's FP8 GEMM plus its input's quantization can cost more than the
bf16 GEMM (small batches, narrow layers). :func:`decide_for_batch` times, at the shapes one
call of the served model gives each site, every site's trained FP8 forward against high
precision, the way a served site runs it: the FP8 GEMM on pre-quantized operands plus the
quantization of its input (its weight is quantized once, so not charged), against the bf16 GEMM
(:func:`~loka_train.dispatch.ledger.measure_ledger`; CUDA-graph replays on a GPU). A site whose
weight is not quantized once (a batched ``bmm`` site's second activation, a horizontally fused
site's concatenated weight, ``ServeConfig.quantize_weights_once`` off) pays that cast too; a site
with the ReLU before it folded in pays the ReLU pass where its cast does not apply it, as bf16
does. A site keeps its FP8 forward where that is at least ``margin`` times faster, else runs in
high precision.
Only the trained plan is a candidate: the Probe judged it safe for this site; no other FP8 plan
was judged there.

Example:
    >>> plans, rows = decide_for_batch(served, lambda m: m(dense, sparse), device=torch.device("cuda"))
    >>> serve(served, plans=plans)
    >>> print(format_decisions(rows))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loka_train.dispatch.ledger import Ledger, LedgerGemm, measure_ledger
from loka_train.kernels.plan import LinearPlan
from loka_train.mods.convert import sites as find_sites

logger = logging.getLogger(__name__)

__all__ = ["InferenceDecision", "decide_for_batch", "format_decisions", "forward_ledger"]


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
    """The FP8 GEMM, its input's quantization, its weight's where that is not made once, and the
    ReLU pass where its cast does not apply it (inf where the backend failed at this shape)."""
    chosen: str
    """The trained plan, or "high"."""

    @property
    def speedup(self) -> float:
        return self.high_ms / self.fp8_ms if self.fp8_ms > 0 else float("inf")


def forward_ledger(
    model: nn.Module,
    run: Callable[[nn.Module], Any],
    *,
    device: torch.device,
    plans: Mapping[str, LinearPlan] | None = None,
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> Ledger:
    """The forward GEMMs `model` runs in FP8 (`plans`' forwards, default each site's own) at the
    shapes one call (`run`, eager, under ``torch.no_grad()``) gives its sites, each timed in
    bf16 and in its plan (:func:`~loka_train.dispatch.ledger.measure_ledger`), as a served site
    runs it: the ReLU pass a folded site's bf16 forward runs charged, tensor-wise inputs with
    static scales where the site has them. Sites the call did not reach are left out.

    Raises:
        ValueError: where `plans` names sites the model does not have.
    """
    found = find_sites(model)
    unknown = sorted(set(plans or {}) - set(found))
    if unknown:
        raise ValueError(f"forward_ledger: plans name sites the model does not have: {unknown}")
    with torch.no_grad():
        run(model)
    gemms = [
        # No grad-weight: nothing runs a backward, so a folded ReLU never runs again there.
        LedgerGemm(name, "forward", site.gemm_shapes()["forward"], plan.forward, (plan.forward,),
                   input_relu=bool(site.input_relu), grad_weight_plan=None)
        for name, site in found.items()
        if (plan := (plans or {}).get(name, site.plan)).forward.is_fp8 and site.gemm_shapes()["forward"][0] > 0
    ]
    order = {g.site: i for i, g in enumerate(gemms)}
    parts = []
    with torch.autocast(device.type, enabled=False):  # the ledger times its own dtypes
        for static in (False, True):
            group = [g for g in gemms if (found[g.site].static_slots is not None) == static]
            if group:
                parts.append(measure_ledger(group, device=device, timer=timer, static_scales=static))
    if not parts:
        return Ledger(rows=[], device=str(device), timing="none", notes=["no FP8 forward ran"])
    return Ledger(rows=sorted((r for part in parts for r in part.rows), key=lambda r: order[r.site]),
                  device=parts[0].device, timing=parts[0].timing,
                  notes=list(dict.fromkeys(n for part in parts for n in part.notes)))


def decide_for_batch(
    model: nn.Module,
    run: Callable[[nn.Module], Any],
    *,
    device: torch.device,
    plans: Mapping[str, LinearPlan] | None = None,
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
        margin: the FP8 forward stays where ``high_ms >= margin * fp8_ms``.
        timer: ``timer(fn) -> ms`` (default: graph replays on a GPU, the host clock elsewhere).

    Returns:
        The plans (the forward only: nothing serves a backward) and one row per site whose
        trained forward is FP8 and that the call reached (one it did not reach keeps its plan).

    Raises:
        ValueError: for ``margin <= 0``, or plans naming sites the model does not have.
    """
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    found = find_sites(model)
    trained = {name: (plans or {}).get(name, site.plan) for name, site in found.items()}
    ledger = forward_ledger(model, run, device=device, plans=plans, timer=timer)
    out = {name: LinearPlan(forward=plan.forward) for name, plan in trained.items()}
    rows = []
    for row in ledger.rows:
        times = row.chosen
        if times is None:  # the backend failed at this shape (named in the ledger's failures)
            fp8_ms = float("inf")
        else:
            weight_once = "served" in found[row.site]._modules
            fp8_ms = times.gemm_ms + times.quant_a_ms + times.relu_ms + (0.0 if weight_once else times.quant_b_ms)
        keep = row.high_total_ms >= margin * fp8_ms
        if not keep:
            out[row.site] = LinearPlan()
        rows.append(InferenceDecision(
            site=row.site, shape=row.shape, trained=str(trained[row.site].forward), high_ms=row.high_total_ms,
            fp8_ms=fp8_ms, chosen=str(trained[row.site].forward) if keep else "high",
        ))
        if not keep:
            logger.info("decide_for_batch: %s runs its forward in high precision at %s (bf16 %.4f ms, FP8 %.4f ms)",
                        row.site, "x".join(map(str, row.shape)), row.high_total_ms, fp8_ms)
    return out, rows


def format_decisions(rows: list[InferenceDecision]) -> str:
    """The decisions as a Markdown table."""
    lines = ["| site | M x K x N | trained forward | bf16 ms | FP8 ms (input cast incl.) | x | chosen |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.site} | {'x'.join(map(str, r.shape))} | {r.trained} | {r.high_ms:.4f} | "
                     f"{r.fp8_ms:.4f} | {r.speedup:.2f} | {r.chosen} |")
    return "\n".join(lines)
