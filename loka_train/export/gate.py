"""A served model's NE held to a budget: FP8 forwards go row-wise or high, priced by the speed each gives up.

The Probe judges each FP8 forward by its own SQNR; what a user serves for is the model's NE.
:func:`hold_ne` measures the served model's NE against the same weights in high precision on
held-out batches (keep them apart from the batches you report: the gate chooses on these) and,
while the served NE exceeds the high-precision one by more than ``budget`` (relative), makes one
move per step, each FP8 site tried in turn (NE, not a site's SQNR, is what is held). A site's
moves: to high precision, and for a tensor-wise forward also to row-wise scales
(:func:`next_rung`: the same formats and backend, where the backend takes row-wise scales and,
given the Probe's verdicts, one judged that forward safe), which keeps the GEMM in FP8.

Each move has a price, the speed it gives up (:func:`forward_price`: the site's forward GEMM's
size, all of it for high precision, :data:`ROWWISE_PRICE` of it for row-wise scales). Where
moves bring the NE within the budget, the gate takes the cheapest of them; otherwise the move
that lowers the NE most for its price, of those that lower it at least half as much as the best
one. It stops within the budget, with no FP8 forward left, or where no move lowers the NE by
more than ``min_gain`` (logged; the last step then records that round's trials with no move),
and returns every step, so a report says what the budget cost.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from loka_train.dispatch import planning
from loka_train.export.config import ServeConfig
from loka_train.export.serving import serve
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import BACKEND_CONSTRAINTS, GemmPlan, LinearPlan
from loka_train.mods.convert import sites as find_sites
from loka_train.mods.site import Site

logger = logging.getLogger(__name__)

__all__ = ["ROWWISE_PRICE", "GateStep", "format_gate", "forward_price", "hold_ne", "next_rung"]

ROWWISE_PRICE = 0.2
"""What serving a forward with row-wise instead of tensor-wise FP8 scales gives up, as a share
of what serving it in high precision gives up (:func:`forward_price`). An estimate from the
per-GEMM ledger's H100 times in ``docs/performance.md``: a row-wise GEMM runs about a tenth
slower than a tensor-wise one of the same size, and its cast takes its amax per row where a
static tensor-wise scale needs none, while high precision gives up the whole of FP8's
1.6-1.9x."""


@dataclass(frozen=True)
class GateStep:
    """One step of :func:`hold_ne`: the model after it."""

    moved: str | None
    """The site whose forward moved at this step (None: the model as served)."""
    ne_delta: float
    """Its NE relative to the high-precision model's (``ne / reference_ne - 1``)."""
    fp8_forwards: int
    """Sites still serving an FP8 forward."""
    tried: dict[str, dict[str, float]]
    """Each FP8 site tried at this step -> each move tried (the forward it would serve: ``high``
    or a row-wise plan) -> the NE delta with it (empty for the first step)."""
    to: str | None = None
    """The moved site's forward after the step: ``high``, or its row-wise FP8 plan (e.g.
    ``fp8:e4m3/rowwise@torch_scaled_mm``); None where nothing moved."""
    failed: dict[str, str] = field(default_factory=dict)
    """Row-wise moves that failed to serve or to run at this step (site -> the error), left out
    of the choice (and logged)."""
    prices: dict[str, dict[str, float]] = field(default_factory=dict)
    """The price of each move in ``tried`` (the speed it gives up, as ``hold_ne``'s `price`
    counts it: :func:`forward_price` by default), by which the step chose."""


class _NonFiniteNE(ValueError):
    """The model's NE is not a number: raised, never taken for a failed move."""


_TINY = 1e-12
"""The least price a move is divided by (a site that never ran has a forward of size 0)."""

_LEAST_SHARE = 0.5
"""Out of the budget's reach, a move is ranked by NE for its price only where it lowers the NE
at least this share as much as the move that lowers it most."""


def _fp8_sites(model: nn.Module) -> list[str]:
    return [name for name, site in find_sites(model).items() if site.plan.forward.is_fp8]


def next_rung(name: str, forward: GemmPlan, verdicts: Mapping[Any, Any] | None = None) -> GemmPlan | None:
    """Site `name`'s tensor-wise FP8 `forward` with row-wise scales (the same formats, backend and
    accumulation), where the backend is a built-in one that takes row-wise scales and, given the
    Probe's `verdicts` (``Probe.verdicts()``), the row-wise forward's verdict is safe; else None
    (also for a forward that is not tensor-wise FP8)."""
    if not (forward.is_fp8 and forward.scaling is Scaling.TENSORWISE):
        return None
    takes = BACKEND_CONSTRAINTS.get(forward.backend)
    if takes is None or Scaling.ROWWISE not in takes[0]:
        return None
    # The accumulation as it was, where the backend has it for row-wise scales too.
    finer = dataclasses.replace(forward, scaling=Scaling.ROWWISE,
                                fast_accum=forward.fast_accum and Scaling.ROWWISE in takes[2])
    if verdicts is not None and not planning.eligible(verdicts, name, "forward", [finer]):
        return None
    return finer


def forward_price(site: Site, forward: GemmPlan) -> float:
    """What serving `site`'s forward as `forward` gives up against a tensor-wise FP8 forward, in
    multiply-adds of its forward GEMM as last run (``m * k * n``): all of them for high
    precision, :data:`ROWWISE_PRICE` of them for row-wise FP8 scales, none for other FP8
    scalings (tensor-wise, block). A price to compare moves by, not a time; it takes the FP8
    forward for the faster one, as on a GPU's backends (the CPU's emulated FP8 is slower than
    high precision)."""
    m, k, n = site.gemm_shapes()["forward"]
    size = float(max(m, 1) * k * n)
    if not forward.is_fp8:
        return size
    return ROWWISE_PRICE * size if forward.scaling is Scaling.ROWWISE else 0.0


def hold_ne(
    model: nn.Module, ne: Callable[[nn.Module], float], *, reference_ne: float, budget: float, config: ServeConfig,
    verdicts: Mapping[Any, Any] | None = None, allow_rowwise: bool = True, min_gain: float = 1e-6,
    price: Callable[[str, GemmPlan], float] | None = None,
) -> list[GateStep]:
    """Move `model`'s FP8 forwards row-wise or to high precision, one per step, until its NE is
    within `budget` of `reference_ne` (see the module docstring). `model` is changed in place
    (served again with `config`); returns the steps: the model as served, one per move
    (``moved``, ``to``), and, where the gate stopped with no move lowering the NE, a last one
    without a move (``moved`` None) that records that round's trials.

    Args:
        model: a served model (:func:`~loka_train.export.serve`), eager.
        ne: the NE of a model on the held-out batches the gate judges on.
        reference_ne: the NE of the same weights in high precision on those batches.
        budget: the relative NE increase allowed (2e-4: 0.02%).
        config: how the model was served (its dtype), to serve it again the same way.
        verdicts: the Probe's verdicts when training stopped (``TrainedModel.safe_forwards.verdicts``):
            a tensor-wise forward may go row-wise only where its row-wise verdict is safe. None:
            wherever the backend takes it (the gate's NE judges it).
        allow_rowwise: False: every move goes to high precision.
        min_gain: the least a move must lower the NE (relative, as `budget`) to be taken: the
            gate does not chase differences the evaluation's rounding makes.
        price: ``price(name, forward)``, what serving site `name`'s forward as `forward` gives
            up (a measured time, say); a move from ``kept`` to ``forward`` is priced
            ``price(name, forward) - price(name, kept)``. None: :func:`forward_price`.

    Raises:
        ValueError: where `budget` or `min_gain` is negative, `reference_ne` not a positive
            number, or the model's NE not a number (as served or in any trial: a row-wise move
            that gives a NaN NE is a defect to look at, not a move to leave out).
    """
    if not budget >= 0:
        raise ValueError(f"hold_ne: budget={budget} must be >= 0 (a relative NE increase, 2e-4 for 0.02%)")
    if not (math.isfinite(reference_ne) and reference_ne > 0):
        raise ValueError(f"hold_ne: reference_ne={reference_ne} must be a positive number")
    if not min_gain >= 0:
        raise ValueError(f"hold_ne: min_gain={min_gain} must be >= 0")

    # Each evaluation starts from the static scales as served: a served tensor-wise cast updates
    # its site's slot in place (kernels.static_scales), so without this each trial would be judged
    # after the calls of the ones before it.
    def held_slots() -> dict[str, Tensor]:
        return {n: t for n, s in find_sites(model).items() if (t := getattr(s, "static_slots", None)) is not None}

    slots = {n: t.clone() for n, t in held_slots().items()}

    def delta() -> float:
        try:
            got = ne(model)
        finally:
            now_held = held_slots()
            for n, held in slots.items():
                now_held[n].copy_(held)
        if not math.isfinite(got):
            raise _NonFiniteNE(
                f"hold_ne: the served model's NE is {got} with the FP8 forwards "
                f"{ {n: str(s.plan.forward) for n, s in find_sites(model).items() if s.plan.forward.is_fp8} }: "
                "check its logits (compare_sites shows where they go)")
        return got / reference_ne - 1

    def priced(name: str, forward: GemmPlan) -> float:
        got = price(name, forward) if price is not None else forward_price(find_sites(model)[name], forward)
        if not math.isfinite(got):
            raise ValueError(f"hold_ne: the price of serving {name}'s forward as {forward} is {got}: "
                             "a price must be a finite number")
        return got

    def trial(name: str, forward: GemmPlan, kept: LinearPlan, failed: dict[str, str]) -> float | None:
        """The NE with `name` serving `forward`, the model then as it was; None where a row-wise
        forward fails to serve or to run (recorded in `failed`, logged)."""
        try:
            serve(model, plans={name: LinearPlan(forward=forward)}, config=config)
            return delta()
        except (_NonFiniteNE, torch.OutOfMemoryError):
            raise
        except Exception as exc:
            if forward.is_fp8:  # the row-wise move only: the site can still go high
                failed[name] = f"{type(exc).__name__}: {exc}"
                logger.warning("NE gate: %s as %s failed, left out: %s", name, forward, failed[name])
                return None
            raise
        finally:  # the model as it was, whatever the trial raised
            serve(model, plans={name: kept}, config=config)

    now = delta()
    steps = [GateStep(moved=None, ne_delta=now, fp8_forwards=len(_fp8_sites(model)), tried={})]
    while now > budget and (fp8 := _fp8_sites(model)):
        tried: dict[str, dict[str, float]] = {}
        prices: dict[str, dict[str, float]] = {}
        failed: dict[str, str] = {}
        moves: list[tuple[float, float, str, GemmPlan]] = []  # (price of the move, NE delta, site, forward)
        for name in fp8:
            kept = find_sites(model)[name].plan
            finer = next_rung(name, kept.forward, verdicts) if allow_rowwise else None
            tried[name], prices[name] = {}, {}
            for forward in (finer, GemmPlan()):
                if forward is None or (got := trial(name, forward, kept, failed)) is None:
                    continue
                tried[name][str(forward)] = got
                prices[name][str(forward)] = priced(name, forward) - priced(name, kept.forward)
                moves.append((prices[name][str(forward)], got, name, forward))
        gaining = [m for m in moves if m[1] < now - min_gain]
        within = [m for m in gaining if m[1] <= budget]
        if not gaining:
            logger.warning("NE budget %.4f%%: no move of the %d FP8 forwards lowers the NE (%+.4f%% of high "
                           "precision's) by more than %g: the rest of the gap is not theirs; stopped",
                           100 * budget, len(fp8), 100 * now, min_gain)
            steps.append(GateStep(moved=None, ne_delta=now, fp8_forwards=len(fp8), tried=tried, failed=failed,
                                  prices=prices))
            break
        # Within the budget in one move: the cheapest such move (then the lowest NE). Otherwise the
        # move that lowers the NE most for its price, of those that lower it at least _LEAST_SHARE
        # as much as the best one: a cheap move whose gain is the evaluation's noise is no step.
        best = now - min(m[1] for m in gaining)
        substantial = [m for m in gaining if now - m[1] >= _LEAST_SHARE * best]
        pick = (min(within, key=lambda m: (m[0], m[1])) if within
                else max(substantial, key=lambda m: ((now - m[1]) / max(m[0], _TINY), -m[1])))
        _, now, moved, forward = pick
        serve(model, plans={moved: LinearPlan(forward=forward)}, config=config)
        steps.append(GateStep(moved=moved, ne_delta=now, fp8_forwards=len(_fp8_sites(model)), tried=tried,
                              to=str(forward), failed=failed, prices=prices))
        logger.info("NE budget %.4f%%: %s served %s, NE %+.4f%% of high precision's",
                    100 * budget, moved, "in high precision" if not forward.is_fp8 else forward, 100 * now)
    if now > budget and not _fp8_sites(model):
        logger.warning("NE budget %.4f%%: no FP8 forward left and the NE still %+.4f%% of high precision's "
                       "(the served model differs from it elsewhere: its tables or dtype)", 100 * budget, 100 * now)
    return steps


def format_gate(steps: list[GateStep]) -> str:
    """`steps` as a Markdown table."""
    lines = ["| step | site moved | its forward now | the move's price | NE vs high precision | FP8 forwards left |",
             "|---|---|---|---|---|---|"]
    for i, s in enumerate(steps):
        what = s.moved or ("(as served)" if i == 0 else "(none: no move lowers the NE)")
        paid = s.prices.get(s.moved, {}).get(s.to, None) if s.moved and s.to else None
        lines.append(f"| {i} | {what} | {s.to or ''} | {'' if paid is None else f'{paid:.3g}'} | "
                     f"{100 * s.ne_delta:+.4f}% | {s.fp8_forwards} |")
    failures = [(i, site, why) for i, s in enumerate(steps) for site, why in s.failed.items()]
    if failures:
        lines += ["", "Row-wise moves that failed and were left out:", ""]
        lines += [f"- step {i}: {site}: {why}" for i, site, why in failures]
    return "\n".join(lines)
