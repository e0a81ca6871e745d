"""A served model's NE held to a budget: the FP8 forwards that cost it most go back to high precision.

The Probe judges each FP8 forward by its own SQNR; what a user serves for is the model's NE.
:func:`hold_ne` measures the served model's NE against the same weights in high precision on
held-out batches (keep them apart from the batches you report: the gate chooses on these) and,
while the served NE exceeds the high-precision one by more than ``budget`` (relative), moves to
high precision the one FP8 forward whose move brings the NE down the most (each FP8 site tried
in turn: NE, not a site's SQNR, is what is held). It stops within the budget or with no FP8
forward left, and returns every step, so a report says which sites the budget cost.

Example::

    def ne(model):  # the NE of `model` on held-out batches the report does not use
        logits, labels = your_eval(model, gate_batches)
        return normalized_entropy(logits, labels)

    steps = hold_ne(served, ne, reference_ne=ne(high), budget=2e-4, config=ServeConfig())
    print(format_gate(steps))
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from loka_train.export.config import ServeConfig
from loka_train.export.serving import serve
from loka_train.kernels.plan import LinearPlan
from loka_train.mods.convert import sites as find_sites

logger = logging.getLogger(__name__)

__all__ = ["GateStep", "format_gate", "hold_ne"]


@dataclass(frozen=True)
class GateStep:
    """One step of :func:`hold_ne`: the model after it."""

    moved: str | None
    """The site whose forward went to high precision at this step (None: the model as served)."""
    ne_delta: float
    """Its NE relative to the high-precision model's (``ne / reference_ne - 1``)."""
    fp8_forwards: int
    """Sites still serving an FP8 forward."""
    tried: dict[str, float]
    """Each FP8 site tried at this step -> the NE delta with it in high precision (empty for the first)."""


def _fp8_sites(model: nn.Module) -> list[str]:
    return [name for name, site in find_sites(model).items() if site.plan.forward.is_fp8]


def hold_ne(
    model: nn.Module, ne: Callable[[nn.Module], float], *, reference_ne: float, budget: float, config: ServeConfig,
) -> list[GateStep]:
    """Serve `model`'s FP8 forwards back in high precision, one at a time, until its NE is within
    `budget` of `reference_ne` (see the module docstring). `model` is changed in place (served
    again with `config`); returns the steps (the sites moved: ``moved`` of each after the first).

    Args:
        model: a served model (:func:`~loka_train.export.serve`), eager.
        ne: the NE of a model on the held-out batches the gate judges on.
        reference_ne: the NE of the same weights in high precision on those batches.
        budget: the relative NE increase allowed (2e-4: 0.02%).
        config: how the model was served (its dtype), to serve it again the same way.

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

    high = LinearPlan()
    now = delta()
    steps = [GateStep(moved=None, ne_delta=now, fp8_forwards=len(_fp8_sites(model)), tried={})]
    while now > budget and (fp8 := _fp8_sites(model)):
        tried: dict[str, float] = {}
        for name in fp8:
            kept = find_sites(model)[name].plan
            serve(model, plans={name: high}, config=config)
            try:
                tried[name] = delta()
            finally:  # the model as it was, whatever the trial raised
                serve(model, plans={name: kept}, config=config)
        moved = min(tried, key=lambda n: tried[n])
        serve(model, plans={moved: high}, config=config)
        now = tried[moved]
        steps.append(GateStep(moved=moved, ne_delta=now, fp8_forwards=len(fp8) - 1, tried=tried))
        logger.info("NE budget %.4f%%: %s served in high precision, NE %+.4f%% of high precision's",
                    100 * budget, moved, 100 * now)
    if now > budget:
        logger.warning("NE budget %.4f%%: no FP8 forward left and the NE still %+.4f%% of high precision's "
                       "(the served model differs from it elsewhere: its tables or dtype)", 100 * budget, 100 * now)
    return steps


def format_gate(steps: list[GateStep]) -> str:
    """`steps` as a Markdown table."""
    lines = ["| step | moved to high precision | NE vs high precision | FP8 forwards left |", "|---|---|---|---|"]
    for i, s in enumerate(steps):
        lines.append(f"| {i} | {s.moved or '(as served)'} | {100 * s.ne_delta:+.4f}% | {s.fp8_forwards} |")
    return "\n".join(lines)
