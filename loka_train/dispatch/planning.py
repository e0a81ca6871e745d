"""Dispatch's decisions as pure functions of the config, the Probe's verdicts and GEMM times.

For one GEMM (a site's role at its ``(M, K, N)``):

1. :func:`candidates`: every FP8 (scaling, backend) pair of the config whose backend
   ``supports`` the problem on this device (zero-padded where the site pads) and that the site
   can run; the others with why they cannot.
2. :func:`eligible`: the candidates whose verdict for exactly their operand formats is safe;
   only these are timed.
3. :func:`target`: from the times of the eligible candidates and of high precision, the plan
   this GEMM should have now. With ``objective="speed"`` FP8 must beat high precision by
   ``margin`` (a speed-up of at least ``1 + margin``); ``"coverage"`` takes the fastest safe
   candidate whatever its speed. A current FP8 plan whose verdict is unsafe (or missing) makes
   the target *urgent*.
4. :func:`hysteresis`: an urgent target is applied at once; any other needs the same target
   for ``hysteresis_intervals`` consecutive intervals, so plans do not flap.

:func:`disallowed` says which restored (checkpointed) plan the current config does not allow.
Nothing here measures, touches a device or talks to other ranks: equal inputs give equal
plans on every rank.

Example:
    >>> cfg = DispatchConfig(objective="speed", margin=0.05)
    >>> plan = plan_for(cfg, "forward", "rowwise", "emulated")
    >>> t = target(site="s", role="forward", current=GemmPlan(), shape=(256, 64, 32),
    ...            candidates=[plan], verdicts=verdicts, times={plan: 1e-5}, t_high=1.2e-5,
    ...            objective="speed", margin=cfg.margin, measured=True)
    >>> t.plan == plan  # a 1.2x speed-up clears the 5% margin
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loka_train.dispatch.config import DispatchConfig
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.linear import grad_weight_takes_x
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.kernels.registry import get_backend
from loka_train.kernels.roles import ROLES

__all__ = [
    "GRAD_WEIGHT_OUT_DTYPE",
    "HysteresisStep",
    "Shape",
    "SiteExtra",
    "SiteSupports",
    "Target",
    "candidates",
    "disallowed",
    "eligible",
    "gemm_problem",
    "hysteresis",
    "joint_targets",
    "runs_relu_again",
    "padded",
    "parse_plan_key",
    "plan_for",
    "reused_operands",
    "roles_of",
    "site_total",
    "takes_forward_x",
    "target",
    "verdict_of",
]

Shape = tuple[int, int, int]
"""(M, K, N) of one GEMM: ``(M, K) x (N, K)^T``."""

SiteSupports = Callable[[LinearPlan], tuple[bool, str]]
"""A site's own check of a whole plan: (ok, why not)."""

GRAD_WEIGHT_OUT_DTYPE = torch.float32
"""FP8 weight gradients are written in the weight's dtype (``kernels.linear.grad_weight_dtype``):
fp32 for the fp32 master weights of bf16-autocast training, which is what is planned and timed."""


@dataclass(frozen=True)
class Target:
    """The plan one GEMM should have now, why, and whether it must move at once."""

    plan: GemmPlan
    reason: str
    urgent: bool
    """The current plan's verdict is unsafe (or missing): no hysteresis."""


@dataclass(frozen=True)
class HysteresisStep:
    """What :func:`hysteresis` decided for one GEMM at one interval."""

    apply: bool
    """Change the plan to the target now."""
    pending: tuple[str, int] | None
    """The pending entry to keep for the next interval: (target, consecutive intervals), or
    None to drop it."""
    held: int | None
    """Intervals the target was held before it was applied (None: applied at once or not yet)."""


def roles_of(plan: LinearPlan) -> dict[str, GemmPlan]:
    """``{role: plan of that GEMM}`` of a whole-layer plan."""
    return {r: getattr(plan, r) for r in ROLES}


def padded(shape: Shape, multiple: int) -> Shape:
    """``shape`` with every dim rounded up to ``multiple`` (what a padding site runs)."""
    m, k, n = (d + (-d) % multiple for d in shape)
    return (m, k, n)


def plan_for(cfg: DispatchConfig, role: str, scaling: str, backend: str) -> GemmPlan:
    """The FP8 plan Dispatch gives ``role`` with ``scaling`` on ``backend``: ``fmt_forward`` for
    both forward operands; ``fmt_backward`` for the output gradient and ``fmt_forward`` for the
    other operand of a backward GEMM.

    Raises:
        ValueError: if the formats and scaling do not make a valid plan.
    """
    if role == "forward":
        return GemmPlan(
            precision=Precision.FP8, fmt=Fp8Format(cfg.fmt_forward), scaling=Scaling(scaling),
            backend=backend,
        )
    return GemmPlan(
        precision=Precision.FP8,
        fmt=Fp8Format(cfg.fmt_backward),
        fmt_b=Fp8Format(cfg.fmt_forward),
        scaling=Scaling(scaling),
        backend=backend,
    )


def parse_plan_key(cfg: DispatchConfig, role: str, plan_s: str) -> GemmPlan | None:
    """The plan whose ``str`` is ``plan_s`` among the config's (scaling, backend) pairs; None for
    ``"high"``.

    Raises:
        ValueError: if no plan of the config prints as ``plan_s``.
    """
    if plan_s == "high":
        return None
    for scaling in cfg.scalings:
        for backend in cfg.backends:
            try:
                plan = plan_for(cfg, role, scaling, backend)
            except ValueError:
                continue
            if str(plan) == plan_s:
                return plan
    raise ValueError(f"unknown plan key {plan_s!r}")


def gemm_problem(
    role: str, shape: Shape, plan: GemmPlan, *, device_type: str, out_dtype: torch.dtype
) -> GemmProblem:
    """The GEMM a site runs for ``role`` under ``plan`` (grad-weight writes fp32, see
    ``kernels.linear``), as backends' ``supports`` see it."""
    return GemmProblem(
        m=shape[0], k=shape[1], n=shape[2], fmt=plan.fmt, fmt_b=plan.fmt_b, scaling=plan.scaling,
        device_type=device_type, role=role, fast_accum=plan.fast_accum,
        out_dtype=GRAD_WEIGHT_OUT_DTYPE if role == "grad_weight" else out_dtype,
    )


def candidates(
    cfg: DispatchConfig,
    role: str,
    shape: Shape,
    *,
    device_type: str,
    out_dtype: torch.dtype,
    pad_to_multiple: int = 1,
    current: LinearPlan,
    site_supports: SiteSupports | None = None,
) -> tuple[list[GemmPlan], dict[str, str]]:
    """The FP8 plans ``role`` may take at ``shape``, in config order (scalings, then backends).

    A backend that refuses ``shape`` is a candidate when the site pads (``pad_to_multiple > 1``)
    and it takes the padded shape. A plan the site cannot run (``site_supports`` of ``current``
    with this role replaced) is left out without a reason: it is a property of the site, not a
    fallback.

    Returns:
        ``(plans, unsupported)``: ``unsupported`` maps ``"backend/scaling"`` to why it cannot
        run here (first reason per pair).
    """
    out: list[GemmPlan] = []
    unsupported: dict[str, str] = {}
    if role not in cfg.fp8_roles:
        return out, unsupported
    backends = cfg.cpu_backends if device_type == "cpu" else cfg.backends
    for scaling in cfg.scalings:
        for backend_name in backends:
            try:
                plan = plan_for(cfg, role, scaling, backend_name)
                backend = get_backend(backend_name)
            except (KeyError, ValueError) as exc:
                unsupported.setdefault(f"{backend_name}/{scaling}", str(exc))
                continue
            problem = gemm_problem(role, shape, plan, device_type=device_type, out_dtype=out_dtype)
            ok, why = backend.supports(problem)
            if not ok and pad_to_multiple > 1:
                m, k, n = padded(shape, pad_to_multiple)
                ok = backend.supports(dataclasses.replace(problem, m=m, k=k, n=n))[0]
            if ok and site_supports is not None:
                ok, why = site_supports(LinearPlan(**{**roles_of(current), role: plan}))
                if not ok:
                    continue
            if ok:
                out.append(plan)
            else:
                unsupported.setdefault(f"{backend_name}/{scaling}", why)
    return out, unsupported


def verdict_of(verdicts: Mapping[Any, Any], site: str, role: str, plan: GemmPlan) -> tuple[Any, str]:
    """(the Probe's verdict for exactly this plan's operand formats, or None; why not).

    A verdict measured with another operand-b format says nothing of this plan (align
    ``probe.backward_fmt_b`` with ``dispatch.fmt_forward``).
    """
    v = verdicts.get((site, role, plan.fmt, plan.scaling))
    if v is None:
        return None, "no verdict"
    fmt_b = v.fmt_b
    if fmt_b is not plan.operand_b_fmt:
        return None, (
            f"no verdict for operand b in {plan.operand_b_fmt.value} (the Probe measured "
            f"{fmt_b.value}: align loka.probe.backward_fmt_b and loka.dispatch.fmt_forward)"
        )
    return v, ""


def eligible(
    verdicts: Mapping[Any, Any], site: str, role: str, plans: Sequence[GemmPlan]
) -> list[GemmPlan]:
    """The plans of ``plans`` whose verdict is safe, in order: the ones worth timing."""
    out = []
    for plan in plans:
        v, _ = verdict_of(verdicts, site, role, plan)
        if v is not None and v.safe:
            out.append(plan)
    return out


def target(
    *,
    site: str,
    role: str,
    current: GemmPlan,
    shape: Shape,
    candidates: Sequence[GemmPlan],
    verdicts: Mapping[Any, Any],
    times: Mapping[GemmPlan, float],
    t_high: float,
    objective: str,
    margin: float,
    measured: bool,
    failures: Mapping[GemmPlan, str] | None = None,
) -> Target:
    """The plan one GEMM should have now.

    Args:
        site: the site's name.
        role: the GEMM.
        current: its plan now.
        shape: its (M, K, N).
        candidates: its FP8 candidates (:func:`candidates`), in order of preference on equal
            time.
        verdicts: the Probe's verdicts by ``(site, role, fmt, scaling)``.
        times: seconds of each eligible candidate (:func:`eligible`); ``inf`` when its
            benchmark failed.
        t_high: seconds of the high-precision GEMM.
        objective: ``"speed"`` or ``"coverage"``.
        margin: relative speed-up FP8 must show under ``"speed"``.
        measured: the times were measured (else a cost model's), for the reason.
        failures: why a candidate's benchmark failed, for the reason.

    Returns:
        The :class:`Target`: the fastest safe candidate (the earlier one on equal time), or high
        precision when none is safe, or when under ``"speed"`` its speed-up over high precision
        is below ``1 + margin``.
    """
    current_unsafe = False
    unsafe_reason = ""
    if current.is_fp8:
        v, why_none = verdict_of(verdicts, site, role, current)
        if v is None or not v.safe:
            current_unsafe = True
            # The Probe's verdict reason already opens with "unsafe"; a missing one says why.
            unsafe_reason = v.reason if v is not None else f"unsafe: {why_none} for the current plan"

    safe: list[tuple[float, int, GemmPlan, Any]] = []
    rejected = []
    for i, plan in enumerate(candidates):
        v, why_none = verdict_of(verdicts, site, role, plan)
        if v is None or not v.safe:
            rejected.append(f"{plan.scaling.value}: {v.reason if v is not None else why_none}")
            continue
        t = times[plan]
        if not math.isfinite(t):
            failure = (failures or {}).get(plan, "no time")
            rejected.append(f"{plan}: its benchmark failed ({failure})")
            continue
        safe.append((t, i, plan, v))
    src = "measured" if measured else "cost model"
    if not safe:
        why = "; ".join(dict.fromkeys(rejected)) or f"no FP8 candidate for {role}"
        reason = unsafe_reason if current_unsafe else f"no safe FP8: {why}"
        return Target(GemmPlan(), reason, current_unsafe)
    t_best, _, best, v = min(safe, key=lambda x: (x[0], x[1]))
    speedup = t_high / t_best if t_best > 0 else math.inf
    shape_s = "x".join(map(str, shape))
    if objective == "speed" and speedup < 1.0 + margin:
        return Target(
            GemmPlan(),
            f"FP8 speed-up {speedup:.2f}x over high at {shape_s} ({src}) < 1+margin "
            f"{1 + margin:.2f}",
            current_unsafe,
        )
    reason = f"safe (SQNR p-lo {v.sqnr_lo_db:.1f} dB >= {v.budget_db:.1f}); speed-up {speedup:.2f}x over high at {shape_s} ({src})"
    if objective == "coverage" and speedup < 1.0:
        reason += "; taken for coverage although slower"
    if current_unsafe:
        reason = f"{unsafe_reason}; moved to {best} which is {reason}"
    return Target(best, reason, current_unsafe)


def hysteresis(
    current: GemmPlan,
    target: Target,
    pending: tuple[str, int] | None,
    *,
    intervals: int,
) -> HysteresisStep:
    """Whether one GEMM moves to ``target`` at this interval.

    The current plan as target clears any pending move. An urgent target moves at once. Any
    other target is counted while it stays the same from interval to interval (another target
    restarts the count at 1) and moves when the count reaches ``intervals``.

    Args:
        current: the GEMM's plan now.
        target: this interval's :class:`Target`.
        pending: the entry the previous interval left: (target, consecutive intervals).
        intervals: ``dispatch.hysteresis_intervals``.
    """
    if target.plan == current:
        return HysteresisStep(apply=False, pending=None, held=None)
    if target.urgent:
        return HysteresisStep(apply=True, pending=None, held=None)
    key = str(target.plan)
    key_s, count = pending if pending is not None else (key, 0)
    count = count + 1 if key_s == key else 1
    if count < intervals:
        return HysteresisStep(apply=False, pending=(key, count), held=None)
    return HysteresisStep(apply=True, pending=None, held=count)


def disallowed(
    cfg: DispatchConfig,
    role: str,
    plan: GemmPlan,
    *,
    others: Mapping[str, GemmPlan],
    initial: GemmPlan,
    device_type: str,
    site_supports: SiteSupports | None = None,
) -> tuple[GemmPlan, str]:
    """(reset target, why) for a restored FP8 ``plan`` that is not the site's initial one;
    ``why`` is empty when the config allows it.

    Args:
        cfg: the current config.
        role: the GEMM.
        plan: its restored plan.
        others: the site's plans of the other roles (already checked).
        initial: the site's initial plan of this role (the reset target when dispatch is off).
        device_type: where the run is (which backends the config allows).
        site_supports: the site's own check of a whole plan.
    """
    if not cfg.enabled:
        return initial, "dispatch.enabled=false keeps every site on its initial plan"
    if role not in cfg.fp8_roles:
        return GemmPlan(), f"{role} is not in dispatch.fp8_roles={list(cfg.fp8_roles)}"
    if plan.scaling.value not in cfg.scalings:
        return GemmPlan(), (
            f"{plan.scaling.value} scaling is not in dispatch.scalings={list(cfg.scalings)}"
        )
    on_cpu = device_type == "cpu"
    backends = cfg.cpu_backends if on_cpu else cfg.backends
    if plan.backend not in backends:
        name = "cpu_backends" if on_cpu else "backends"
        return GemmPlan(), (
            f"backend {plan.backend!r} is not in dispatch.{name}={list(backends)} "
            f"(device {device_type})"
        )
    fmts = f"dispatch.fmt_forward={cfg.fmt_forward}, fmt_backward={cfg.fmt_backward}"
    try:
        expected = plan_for(cfg, role, plan.scaling.value, plan.backend)
    except ValueError as exc:
        return GemmPlan(), f"the configured formats ({fmts}) do not fit it: {exc}"
    if plan != expected:
        return GemmPlan(), f"dispatch chooses {expected} there ({fmts}), not {plan}"
    if site_supports is not None:
        ok, why = site_supports(LinearPlan(**{**others, role: plan}))
        if not ok:
            return GemmPlan(), f"the site cannot run it: {why}"
    return GemmPlan(), ""


def reused_operands(role: str, plan: GemmPlan, site_plan: LinearPlan) -> tuple[bool, bool]:
    """Which operands ``(a, b)`` of ``role`` the site takes over already quantized from another
    of its GEMMs under ``site_plan`` instead of quantizing them (``kernels.linear``: tensor-wise
    payloads are reused transposed where the formats agree): grad-input's ``W^T`` from the
    forward's ``W``; grad-weight's ``dY^T`` from grad-input's ``dY`` and its ``X^T`` from the
    forward's ``x``."""
    if not (plan.is_fp8 and plan.scaling is Scaling.TENSORWISE):
        return False, False

    def tensorwise(p: GemmPlan) -> bool:
        return p.is_fp8 and p.scaling is Scaling.TENSORWISE

    fwd, gi = site_plan.forward, site_plan.grad_input
    if role == "grad_input":
        return False, tensorwise(fwd) and fwd.operand_b_fmt is plan.operand_b_fmt
    if role == "grad_weight":
        return (
            tensorwise(gi) and gi.fmt is plan.fmt,
            tensorwise(fwd) and fwd.fmt is plan.operand_b_fmt,
        )
    return False, False


def takes_forward_x(grad_weight: GemmPlan, forward: GemmPlan) -> bool:
    """Whether a grad-weight GEMM under ``grad_weight`` takes the forward's ``x`` over
    (transposed) under ``forward`` (:func:`reused_operands`): where the forward's cast applies a
    folded ReLU and grad-weight does not take its ``x`` over, the backward runs the ReLU on
    ``x`` again (``kernels.linear``), the pass the fold saved in the forward."""
    return grad_weight_takes_x(LinearPlan(forward=forward, grad_weight=grad_weight))


def runs_relu_again(forward: GemmPlan, grad_weight: GemmPlan | None, *, folds: bool) -> bool:
    """Whether the backward runs a folded ReLU again: ``forward``'s cast applies it (``folds``)
    and a grad-weight GEMM (``grad_weight``; None where none runs) does not take the forward's
    ``x`` over (:func:`takes_forward_x`). Dispatch and the ledger charge that pass."""
    return folds and grad_weight is not None and not takes_forward_x(grad_weight, forward)


def site_reuse(role: str, plan: GemmPlan, site_plan: LinearPlan | None) -> tuple[bool, bool]:
    """:func:`reused_operands` for a site planned jointly (``site_plan`` given), nothing
    reused otherwise (a site whose GEMMs do not share operands, ``site_plan=None``)."""
    return (False, False) if site_plan is None else reused_operands(role, plan, site_plan)


SiteTime = Callable[[str, GemmPlan | None, tuple[bool, bool]], float]
"""``time(role, plan or None for high precision, reused operands) -> seconds`` of one GEMM."""

SiteExtra = Callable[[Mapping[str, GemmPlan]], float]
"""``extra(plans) -> seconds`` a site pays under ``plans`` (role -> plan) beyond its GEMMs'
own times, for what depends on several of its plans at once (a folded ReLU run again in the
backward: :func:`takes_forward_x`)."""


def site_total(plans: Mapping[str, GemmPlan], time: SiteTime, extra: SiteExtra | None = None) -> float:
    """Seconds of a site's GEMMs under ``plans`` (role -> plan), with the quantization each
    pays given what it reuses from the others, plus ``extra(plans)`` where given."""
    site_plan = LinearPlan(**{**roles_of(LinearPlan()), **plans})
    return sum(
        time(role, plan, reused_operands(role, plan, site_plan)) if plan.is_fp8 else time(role, None, (False, False))
        for role, plan in plans.items()
    ) + (extra(plans) if extra is not None else 0.0)


def joint_targets(
    *,
    targets: Mapping[str, Target],
    options: Mapping[str, Sequence[GemmPlan]],
    time: SiteTime,
    margin: float,
    extra: SiteExtra | None = None,
) -> dict[str, Target]:
    """A site's plans chosen together, where one GEMM's plan changes what another pays.

    :func:`target` picks each GEMM on its own time. A tensor-wise forward, though, lets
    grad-input reuse ``W`` and grad-weight reuse ``x`` (and a tensor-wise grad-input lets
    grad-weight reuse ``dY``), so a slightly slower tensor-wise forward can make the site
    faster; and a reused operand is not always cheaper (its layout is the other GEMM's: a
    transposed payload can cost a backend more than quantizing afresh). Where reuse happens in
    the per-GEMM choice (``targets``) or in the fastest assignment of high precision or a safe
    candidate (``options``) to each role, the fastest assignment, timed with the reuse it
    gets, replaces the per-GEMM choice when it is faster and, unless it is all high
    precision, at least ``1 + margin`` faster than the site in high precision (the speed rule
    of :func:`target`, applied to the site).

    Args:
        targets: each role's :func:`target` (the roles of the site whose shape is known).
        options: each role's safe candidates with a finite time (:func:`eligible`).
        time: the GEMM times (see :data:`SiteTime`).
        margin: the relative speed-up FP8 must show.
        extra: what the site pays beyond its GEMMs under an assignment (:data:`SiteExtra`).

    Returns:
        ``targets`` with the roles the joint choice changes replaced (same urgency; the reason
        says what the site gains), or ``targets`` unchanged.

    Example:
        >>> joint_targets(targets=ts, options={"forward": [tw_fwd], ...}, time=t, margin=0.05)
    """
    roles = list(targets)
    if not any(p.scaling is Scaling.TENSORWISE for r in roles for p in options.get(r, ())) and not _reuses(
        {r: targets[r].plan for r in roles}
    ):
        return dict(targets)
    per_gemm = {r: targets[r].plan for r in roles}
    t_per_gemm = site_total(per_gemm, time, extra)
    t_high = site_total({r: GemmPlan() for r in roles}, time, extra)
    best: tuple[float, dict[str, GemmPlan]] | None = None
    for combo in itertools.product(*([GemmPlan(), *options.get(r, ())] for r in roles)):
        plans = dict(zip(roles, combo))
        t = site_total(plans, time, extra)
        if best is None or t < best[0]:
            best = (t, plans)
    assert best is not None  # the all-high assignment is always there
    t_best, plans = best
    if not (_reuses(per_gemm) or _reuses(plans)):
        return dict(targets)  # no reuse either way: the per-GEMM choice judged these
    all_high = not any(p.is_fp8 for p in plans.values())
    if not t_best < t_per_gemm or (not all_high and t_high < (1.0 + margin) * t_best):
        return dict(targets)
    why = (
        f"chosen with the site's other GEMMs (tensor-wise payloads reused across them): site "
        f"{t_best * 1e3:.3f} ms against {t_per_gemm * 1e3:.3f} ms chosen GEMM by GEMM, "
        f"{t_high / t_best:.2f}x over high"
    )
    return {
        r: targets[r] if plans[r] == targets[r].plan else Target(plans[r], why, targets[r].urgent)
        for r in roles
    }


def _reuses(plans: Mapping[str, GemmPlan]) -> bool:
    """Whether some GEMM of a site under ``plans`` takes an operand over from another."""
    site_plan = LinearPlan(**{**roles_of(LinearPlan()), **plans})
    return any(any(reused_operands(r, p, site_plan)) for r, p in plans.items())
