"""A served model's NE held to a budget: the FP8 forwards that cost it most go finer, then high.

The Probe judges each FP8 forward by its own SQNR; what a user serves for is the model's NE.
:func:`hold_ne` measures the served model's NE against the same weights in high precision on
held-out batches (keep them apart from the batches you report: the gate chooses on these) and,
while the served NE exceeds the high-precision one by more than ``budget`` (relative), moves one
FP8 forward one rung toward high precision: the move that brings the NE down the most, each FP8
site tried in turn (NE, not a site's SQNR, is what is held). The rungs: a tensor-wise forward
goes row-wise first (the same formats and backend, where the backend takes row-wise scales and,
given the Probe's verdicts, one judged that forward safe), which keeps most of what its FP8 GEMM
saves; a row-wise or block-scaled forward goes to high precision. It stops within the budget or
with no FP8 forward left, and returns every step, so a report says what the budget cost.

Example::

    def ne(model):  # the NE of `model` on held-out batches the report does not use
        logits, labels = your_eval(model, gate_batches)
        return normalized_entropy(logits, labels)

    steps = hold_ne(served, ne, reference_ne=ne(high), budget=2e-4, config=ServeConfig(),
                    verdicts=trained.safe_forwards.verdicts)
    print(format_gate(steps))
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from loka_train.dispatch import planning
from loka_train.export.config import ServeConfig
from loka_train.export.serving import serve
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import BACKEND_CONSTRAINTS, GemmPlan, LinearPlan
from loka_train.mods.convert import sites as find_sites

logger = logging.getLogger(__name__)

__all__ = ["GateStep", "format_gate", "hold_ne", "next_rung"]


@dataclass(frozen=True)
class GateStep:
    """One step of :func:`hold_ne`: the model after it."""

    moved: str | None
    """The site whose forward moved one rung at this step (None: the model as served)."""
    ne_delta: float
    """Its NE relative to the high-precision model's (``ne / reference_ne - 1``)."""
    fp8_forwards: int
    """Sites still serving an FP8 forward."""
    tried: dict[str, float]
    """Each FP8 site tried at this step -> the NE delta with its forward one rung toward high
    precision (:func:`next_rung`; empty for the first step)."""
    to: str = "high"
    """The moved site's forward after the step: ``high``, or its row-wise FP8 plan (e.g.
    ``fp8:e4m3/rowwise@torch_scaled_mm``)."""


def _fp8_sites(model: nn.Module) -> list[str]:
    return [name for name, site in find_sites(model).items() if site.plan.forward.is_fp8]


def next_rung(name: str, forward: GemmPlan, verdicts: Mapping[Any, Any] | None = None) -> GemmPlan:
    """Site `name`'s FP8 `forward` one rung toward high precision: a tensor-wise forward's
    row-wise twin (same formats, backend and accumulation) where the backend is a built-in one
    that takes row-wise scales and, given the Probe's `verdicts` (``Probe.verdicts()``), the
    twin's verdict is safe; else high precision (also for a row-wise or block-scaled forward)."""
    if forward.is_fp8 and forward.scaling is Scaling.TENSORWISE:
        finer = dataclasses.replace(forward, scaling=Scaling.ROWWISE)
        takes = BACKEND_CONSTRAINTS.get(forward.backend)
        if takes is not None and Scaling.ROWWISE in takes[0] and (
                verdicts is None or planning.eligible(verdicts, name, "forward", [finer])):
            return finer
    return GemmPlan()


def hold_ne(
    model: nn.Module, ne: Callable[[nn.Module], float], *, reference_ne: float, budget: float, config: ServeConfig,
    verdicts: Mapping[Any, Any] | None = None, rowwise_first: bool = True,
) -> list[GateStep]:
    """Move `model`'s FP8 forwards toward high precision, one rung at a time, until its NE is
    within `budget` of `reference_ne` (see the module docstring). `model` is changed in place
    (served again with `config`); returns the steps (``moved`` and ``to`` of each after the first).

    Args:
        model: a served model (:func:`~loka_train.export.serve`), eager.
        ne: the NE of a model on the held-out batches the gate judges on.
        reference_ne: the NE of the same weights in high precision on those batches.
        budget: the relative NE increase allowed (2e-4: 0.02%).
        config: how the model was served (its dtype), to serve it again the same way.
        verdicts: the Probe's verdicts when training stopped (``TrainedModel.safe_forwards.verdicts``):
            a tensor-wise forward goes row-wise only where its row-wise verdict is safe. None:
            wherever the backend takes it (the gate's NE judges it).
        rowwise_first: False: every move goes straight to high precision.

    Raises:
        ValueError: where `budget` is negative, `reference_ne` not a positive number, or the served
            model's NE not a number.
    """
    if not budget >= 0:
        raise ValueError(f"hold_ne: budget={budget} must be >= 0 (a relative NE increase, 2e-4 for 0.02%)")
    if not (math.isfinite(reference_ne) and reference_ne > 0):
        raise ValueError(f"hold_ne: reference_ne={reference_ne} must be a positive number")

    def delta() -> float:
        got = ne(model)
        if not math.isfinite(got):
            raise ValueError(f"hold_ne: the served model's NE is {got} (plans {_fp8_sites(model)} in FP8): "
                             "nothing to hold to a budget; check its logits (compare_sites shows where they go)")
        return got / reference_ne - 1

    now = delta()
    steps = [GateStep(moved=None, ne_delta=now, fp8_forwards=len(_fp8_sites(model)), tried={})]
    while now > budget and (fp8 := _fp8_sites(model)):
        tried: dict[str, float] = {}
        rungs: dict[str, LinearPlan] = {}
        for name in fp8:
            kept = find_sites(model)[name].plan
            forward = next_rung(name, kept.forward, verdicts) if rowwise_first else GemmPlan()
            rungs[name] = LinearPlan(forward=forward)
            serve(model, plans={name: rungs[name]}, config=config)
            try:
                tried[name] = delta()
            finally:  # the model as it was, whatever the trial raised
                serve(model, plans={name: kept}, config=config)
        moved = min(tried, key=lambda n: tried[n])
        serve(model, plans={moved: rungs[moved]}, config=config)
        now = tried[moved]
        to = str(rungs[moved].forward)
        steps.append(GateStep(moved=moved, ne_delta=now, fp8_forwards=len(_fp8_sites(model)), tried=tried, to=to))
        logger.info("NE budget %.4f%%: %s served %s, NE %+.4f%% of high precision's",
                    100 * budget, moved, "in high precision" if to == "high" else to, 100 * now)
    if now > budget:
        logger.warning("NE budget %.4f%%: no FP8 forward left and the NE still %+.4f%% of high precision's "
                       "(the served model differs from it elsewhere: its tables or dtype)", 100 * budget, 100 * now)
    return steps


def format_gate(steps: list[GateStep]) -> str:
    """`steps` as a Markdown table."""
    lines = ["| step | site moved | its forward now | NE vs high precision | FP8 forwards left |",
             "|---|---|---|---|---|"]
    for i, s in enumerate(steps):
        to = "" if s.moved is None else s.to
        lines.append(f"| {i} | {s.moved or '(as served)'} | {to} | {100 * s.ne_delta:+.4f}% | {s.fp8_forwards} |")
    return "\n".join(lines)
