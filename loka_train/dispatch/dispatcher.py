"""The Dispatcher: the per-GEMM plan of every site, re-planned from verdicts and GEMM times.

For each site and each of its GEMM roles (forward, grad_input, grad_weight) the Dispatcher
keeps a :class:`~loka_train.kernels.plan.GemmPlan`. At every Probe interval
(:meth:`Dispatcher.replan`) it

1. lists each GEMM's FP8 candidates and keeps the safe ones (``planning.candidates``,
   ``planning.eligible``): safe means the Probe's verdict for (site, role, format, scaling)
   holds, i.e. its conservative SQNR bound fits the budget;
2. times them and high precision at the site's real (M, K, N) (``timing.GemmTimer``: measured
   on a GPU, else a cost model of the target GPU), and makes the times identical on every rank
   (``agreement.agree_on_timings``);
3. picks each GEMM's target (``planning.target``: with ``objective="speed"`` FP8 only where it
   beats high precision by ``margin``; ``"coverage"`` takes the fastest safe candidate) and
   applies it through the hysteresis (``planning.hysteresis``).

The decision is a pure function of inputs that are identical on every rank, so every rank
applies the same plan at the same step. Every change is a
:class:`~loka_train.dispatch.config.PlanChange` (logged, counted, kept in the history). The plan
is data: ``state_dict`` / ``load_state_dict`` for checkpoints, ``table()`` to print,
``export()`` for inference.

Example:
    >>> d = Dispatcher(DispatchConfig(objective="coverage"), device="cpu")
    >>> d.register("over_arch.0", plan=LinearPlan.high_precision(),
    ...            shapes={"forward": (256, 64, 32)})
    >>> changes = d.replan(step=99, verdicts=probe.verdicts())
    >>> for c in changes: site_modules[c.site].set_plan(d.plans[c.site])
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from loka_train.dispatch import planning
from loka_train.dispatch.agreement import agree_on_timings
from loka_train.dispatch.config import DispatchConfig, PlanChange
from loka_train.dispatch.ledger import LedgerGemm
from loka_train.dispatch.planning import Shape, SiteSupports, Target
from loka_train.dispatch.timing import GemmTimer, parse_timing_key, timing_key
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import registered_backends
from loka_train.kernels.roles import ROLES

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher"]


class Dispatcher:
    """Holds every site's plan and re-plans it from verdicts and timings.

    Args:
        config: what may be chosen and how.
        device: the device the GEMMs run on (CUDA enables measured timing).
        out_dtype: output dtype of the GEMMs (bf16 on GPU, fp32 on CPU).
        graphed: the step replays the sites as CUDA graphs (``trainer.cuda_graphs``):
            candidates are timed replayed in a CUDA graph too, without the host's launch cost
            that an eager step pays.
        static_scales: the sites quantize tensor-wise ``x`` and ``dY`` with static scales
            (``mods.static_scales``), which the timer then times.

    Raises:
        ValueError: if the config names a backend that is not registered.
    """

    def __init__(
        self,
        config: DispatchConfig,
        *,
        device: torch.device | str,
        out_dtype: torch.dtype = torch.float32,
        graphed: bool = False,
        static_scales: bool = False,
    ) -> None:
        # A misspelled backend would only ever be "unsupported": FP8 quietly never chosen.
        known = set(registered_backends())
        for key in ("backends", "cpu_backends"):
            unknown = [b for b in getattr(config, key) if b not in known]
            if unknown:
                raise ValueError(
                    f"dispatch.{key} names unknown GEMM backends {unknown}; registered: "
                    f"{sorted(known)}"
                )
        self.config = config
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        self.graphed = graphed
        self.timer = GemmTimer(
            timing=config.timing, device=self.device, out_dtype=out_dtype, graphed=graphed,
            bench_iters=config.bench_iters, static_scales=static_scales,
        )
        """Times of the GEMM candidates (cached by timing key, part of the state)."""
        self.plans: dict[str, LinearPlan] = {}
        self.shapes: dict[str, dict[str, Shape]] = {}
        self._site_supports: dict[str, SiteSupports] = {}
        self.history: list[PlanChange] = []
        self.num_changes = 0
        self._pad: dict[str, int] = {}
        self._shares_operands: set[str] = set()
        self._input_relu: set[str] = set()
        self.unsupported: dict[str, str] = {}
        """backend/scaling -> why it cannot run here (reported once)."""
        self._pending: dict[tuple[str, str], tuple[str, int]] = {}
        self._reasons: dict[tuple[str, str], str] = {}

    @property
    def objective(self) -> str:
        """The objective in force on this device (``cpu_objective`` on CPU when set)."""
        if self.device.type == "cpu" and self.config.cpu_objective is not None:
            return self.config.cpu_objective
        return self.config.objective

    @property
    def timing_mode(self) -> str:
        """``"measure"`` or ``"cost_model"`` (see ``timing.GemmTimer.mode``)."""
        return self.timer.mode

    @property
    def timing_source(self) -> str:
        """Where this dispatcher's GEMM times come from: timing mode, device, output dtype, and
        whether candidates are timed graph-replayed and with static tensor-wise scales.
        Cached timings are only reused (e.g. from a checkpoint) by a dispatcher of the same
        source."""
        return self.timer.source

    @property
    def measure_failures(self) -> dict[str, str]:
        """Timing key -> error of a candidate whose micro-benchmark raised (excluded, logged)."""
        return self.timer.failures

    def register(
        self,
        site: str,
        *,
        plan: LinearPlan,
        shapes: Mapping[str, Shape] | None = None,
        supports: SiteSupports | None = None,
        pad_to_multiple: int = 1,
        shares_operands: bool = False,
        input_relu: bool = False,
    ) -> None:
        """Add a site with its initial plan (and GEMM shapes, if already known).

        Args:
            site: the site's name.
            plan: its current plan.
            shapes: (M, K, N) per role, if known.
            supports: the site's own check of a plan (e.g. a batched GEMM that only the
                emulated backend runs); candidates it rejects are never chosen.
            pad_to_multiple: the site zero-pads FP8 GEMM dims to this multiple when a backend
                refuses the unpadded shape (``Fp8Linear.pad_to_multiple``); such a backend is
                then a candidate, timed on the padded shape.
            shares_operands: its GEMMs hand tensor-wise FP8 operands to one another
                (``Site.shares_operands``): under the speed objective they are planned together
                (``planning.joint_targets``).
            input_relu: the ReLU before it is folded into it (``Site.input_relu``,
                ``mods.fold_relu``): a forward candidate whose cast does not apply it pays a
                ReLU pass over ``x`` on top of its GEMM (:meth:`GemmTimer.relu_pass_s`), and
                one whose cast applies it pays the pass the backward runs again where
                grad-weight does not take its ``x`` over (:meth:`_relu_again_s`).
        """
        self.plans[site] = plan
        if input_relu:
            self._input_relu.add(site)
        else:
            self._input_relu.discard(site)
        if shares_operands:
            self._shares_operands.add(site)
        else:
            self._shares_operands.discard(site)
        self.shapes[site] = dict(shapes or {})
        self._pad[site] = max(1, int(pad_to_multiple))
        if supports is not None:
            self._site_supports[site] = supports

    def update_shapes(self, site: str, shapes: Mapping[str, Shape]) -> None:
        """Record the site's latest (M, K, N) per role (M from the last forward)."""
        self.shapes[site].update({r: (s[0], s[1], s[2]) for r, s in shapes.items() if min(s) > 0})

    # ----------------------------------------------------------------------- planning
    def _estimate(self, role: str, shape: Shape, plan: GemmPlan | None) -> float:
        """Seconds of one GEMM (cached; see ``timing.GemmTimer.estimate``)."""
        return self.timer.estimate(role, shape, plan)

    def _unfolded_relu_s(self, site: str, role: str, shape: Shape, plan: GemmPlan | None) -> float:
        """What a candidate of one GEMM pays for the ReLU folded into ``site``
        (:meth:`register`'s ``input_relu``), the site's other plans as they are now: its own
        pass (:meth:`_own_relu_s`) and the backward's second one (:meth:`_relu_again_s`), which
        a folding forward pays where grad-weight does not take its ``x`` over, and a grad-weight
        candidate (high precision too) that does not take ``x`` over from a folding forward."""
        if site not in self._input_relu or role not in ("forward", "grad_weight"):
            return 0.0
        own = self._own_relu_s(site, role, shape, plan)
        if own:
            return own
        now = self.plans[site]
        plans = {"forward": plan or GemmPlan(), "grad_weight": now.grad_weight} if role == "forward" else {
            "forward": now.forward, "grad_weight": plan or GemmPlan()}
        return self._relu_again_s(site, plans)

    def _own_relu_s(self, site: str, role: str, shape: Shape, plan: GemmPlan | None) -> float:
        """A ReLU pass over ``x`` (the forward's ``shape``) for a forward candidate of a site
        with a folded ReLU whose cast does not apply it (high precision included): the pass the
        ReLU module runs."""
        if role != "forward" or site not in self._input_relu or self.timer.folds_relu(plan):
            return 0.0
        return self.timer.relu_pass_s(shape[0], shape[1])

    def _relu_again_s(self, site: str, plans: Mapping[str, GemmPlan]) -> float:
        """The ReLU pass that ``site``'s backward runs again under ``plans`` (role -> plan, the
        forward's and, once its shape has been seen, grad-weight's): the forward's cast applies
        the folded ReLU and the grad-weight GEMM does not take the forward's ``x`` over
        (:func:`planning.runs_relu_again`). A site whose weight takes no gradient runs no
        grad-weight and no second pass; its shapes still name the role (``Site.gemm_shapes``),
        so it is charged one: no model here freezes a folded site's weight."""
        fwd = plans.get("forward")
        gw = plans.get("grad_weight") if "grad_weight" in self.shapes[site] else None
        if site not in self._input_relu or fwd is None or not planning.runs_relu_again(
                fwd, gw, folds=self.timer.folds_relu(fwd)):
            return 0.0
        return self._relu_pass_s(site)

    def _relu_pass_s(self, site: str) -> float:
        """A ReLU pass over the forward's ``x`` (``M x K``; from grad-weight's ``(N, M, K)``
        where the forward's shape is not known)."""
        shapes = self.shapes[site]
        m, k = shapes["forward"][:2] if "forward" in shapes else shapes["grad_weight"][1:]
        return self.timer.relu_pass_s(m, k)

    def _measure_key(self, key: str) -> float:
        """Seconds of the GEMM a timing key names, measured here (for the agreement)."""
        role, shape, plan_s, reuse = parse_timing_key(key)
        return self.timer.measure(shape, planning.parse_plan_key(self.config, role, plan_s), role, reuse)

    def _candidates(self, site: str, role: str, shape: Shape) -> list[GemmPlan]:
        plans, unsupported = planning.candidates(
            self.config, role, shape, device_type=self.device.type, out_dtype=self.out_dtype,
            pad_to_multiple=self._pad.get(site, 1), current=self.plans[site],
            site_supports=self._site_supports.get(site),
        )
        for key, why in unsupported.items():
            self.unsupported.setdefault(key, why)
        return plans

    def _target(self, site: str, role: str, verdicts: Mapping[Any, Any]) -> Target:
        """The plan this GEMM should have now (``planning.target``), timing what it needs."""
        current = getattr(self.plans[site], role)
        shape = self.shapes[site].get(role)
        if shape is None:
            return Target(current, "shape not seen yet", False)
        plans = self._candidates(site, role, shape)
        times = {
            p: self._estimate(role, shape, p) + self._unfolded_relu_s(site, role, shape, p)
            for p in planning.eligible(verdicts, site, role, plans)
        }
        t_high = self._estimate(role, shape, None) + self._unfolded_relu_s(site, role, shape, None)
        failures = {
            p: self.measure_failures.get(timing_key(role, shape, p), "no time")
            for p, t in times.items()
            if not math.isfinite(t)
        }
        return planning.target(
            site=site, role=role, current=current, shape=shape, candidates=plans,
            verdicts=verdicts, times=times, t_high=t_high, objective=self.objective,
            margin=self.config.margin, measured=self.timing_mode == "measure", failures=failures,
        )

    def _site_targets(self, site: str, verdicts: Mapping[Any, Any]) -> dict[str, Target]:
        """Every role's target; under the speed objective the site's GEMMs are then weighed
        together (``planning.joint_targets``), as tensor-wise plans share quantized operands."""
        targets = {role: self._target(site, role, verdicts) for role in ROLES}
        if self.objective != "speed" or site not in self._shares_operands:
            return targets
        shapes = self.shapes[site]
        seen = [r for r in ROLES if r in shapes]
        options: dict[str, list[GemmPlan]] = {}
        for role in seen:
            # The fastest safe candidate of each scaling (with the ReLU passes it pays against
            # the site's other plans as they are now): reuse depends on the scaling, not on the
            # backend, and it keeps the joint search (and what it times) small.
            fastest: dict[object, tuple[float, GemmPlan]] = {}
            for p in planning.eligible(verdicts, site, role, self._candidates(site, role, shapes[role])):
                t = self._estimate(role, shapes[role], p) + self._unfolded_relu_s(site, role, shapes[role], p)
                if math.isfinite(t) and (p.scaling not in fastest or t < fastest[p.scaling][0]):
                    fastest[p.scaling] = (t, p)
            options[role] = [p for _, p in fastest.values()]

        def time(role: str, plan: GemmPlan | None, reuse: tuple[bool, bool]) -> float:
            return self.timer.estimate(role, shapes[role], plan, reuse) + self._own_relu_s(
                site, role, shapes[role], plan)

        joint = planning.joint_targets(
            targets={r: targets[r] for r in seen}, options=options, time=time, margin=self.config.margin,
            extra=lambda plans: self._relu_again_s(site, plans),
        )
        return {**targets, **joint}

    def replan(self, *, step: int, verdicts: Mapping[Any, Any]) -> list[PlanChange]:
        """Re-plan every site; returns the changes applied (identical on every rank).

        Every rank must call it at the same step (the timings are agreed collectively).
        """
        if not self.config.enabled:
            return []
        targets: dict[tuple[str, str], Target] = {}
        for site in sorted(self.plans):
            for role, target in self._site_targets(site, verdicts).items():
                targets[(site, role)] = target
        if self.timer.timings and self.timing_mode != "cost_model":
            # A cost model is a pure function of the shapes: its times already agree.
            agree_on_timings(self.timer.timings, measure=self._measure_key, device=self.device)
        # Re-evaluate with agreed timings (cheap: everything is cached now).
        for site in sorted(self.plans):
            for role, target in self._site_targets(site, verdicts).items():
                targets[(site, role)] = target

        changes: list[PlanChange] = []
        for (site, role), target in targets.items():
            current = getattr(self.plans[site], role)
            self._reasons[(site, role)] = target.reason
            step_ = planning.hysteresis(
                current, target, self._pending.get((site, role)),
                intervals=self.config.hysteresis_intervals,
            )
            if step_.pending is None:
                self._pending.pop((site, role), None)
            else:
                self._pending[(site, role)] = step_.pending
            if not step_.apply:
                continue
            reason = target.reason
            if step_.held is not None:
                reason = f"{reason} [held {step_.held} intervals]"
            self.plans[site] = LinearPlan(**{**planning.roles_of(self.plans[site]), role: target.plan})
            change = PlanChange(step, site, role, str(current), str(target.plan), reason)
            changes.append(change)
            logger.info("dispatch: %s", change)
        self.history.extend(changes)
        self.num_changes += len(changes)
        return changes

    def force_high(
        self, *, step: int, reason: str, sites: list[str] | None = None, roles: tuple[str, ...] = ROLES
    ) -> list[PlanChange]:
        """Move `roles` (default: all) of sites (default: all) to high precision now (the
        quality guard's lever)."""
        changes = []
        for site in sorted(sites if sites is not None else self.plans):
            for role in roles:
                current = getattr(self.plans[site], role)
                if current.is_fp8:
                    self.plans[site] = LinearPlan(**{**planning.roles_of(self.plans[site]), role: GemmPlan()})
                    changes.append(PlanChange(step, site, role, str(current), "high", reason))
                    self._pending.pop((site, role), None)
        for c in changes:
            logger.warning("dispatch: %s", c)
        self.history.extend(changes)
        self.num_changes += len(changes)
        return changes

    # ------------------------------------------------------------------------ reports
    def ledger_gemms(self) -> list[LedgerGemm]:
        """Every GEMM whose shape the run has seen, with its plan and every FP8 candidate the
        config allows for it (safe or not: the ledger shows where FP8 could pay), for
        :func:`~loka_train.dispatch.ledger.measure_ledger`."""
        out = []
        for site in sorted(self.plans):
            plan = self.plans[site]
            for role in ROLES:
                shape = self.shapes[site].get(role)
                if shape is None:
                    continue
                out.append(LedgerGemm(
                    site=site, role=role, shape=shape, plan=getattr(plan, role),
                    candidates=tuple(self._candidates(site, role, shape)),
                    site_plan=self._joint_plan(site),
                    planned_speedup=self.planned_speedup(site, role),
                    input_relu=role == "forward" and site in self._input_relu,
                    grad_weight_plan=plan.grad_weight if "grad_weight" in self.shapes[site] else None,
                ))
        return out

    def _joint_plan(self, site: str) -> LinearPlan | None:
        """The site's plan where its GEMMs are planned together (they share operands), else None."""
        return self.plans[site] if site in self._shares_operands else None

    def planned_speedup(self, site: str, role: str) -> float | None:
        """High-precision time over the planned FP8 GEMM's, as Dispatch timed them (the FP8
        GEMM with the operands its site takes over from its other GEMMs, where Dispatch
        planned the site jointly), from the timings already taken: never benchmarks. A
        forward's times include the ReLU passes Dispatch charges it (:meth:`_unfolded_relu_s`);
        other roles' are their GEMMs' alone. None for a high-precision plan, an unseen shape,
        or a time not taken."""
        plan = getattr(self.plans[site], role)
        shape = self.shapes[site].get(role)
        if shape is None or not plan.is_fp8:
            return None
        timings = self.timer.timings
        reuse = planning.site_reuse(role, plan, self._joint_plan(site))
        t_high = timings.get(timing_key(role, shape, None))
        t_fp8 = timings.get(timing_key(role, shape, plan, reuse))
        if t_high is None or t_fp8 is None or not (t_fp8 > 0 and math.isfinite(t_fp8)):
            return None
        if role != "forward":
            return t_high / t_fp8
        # With the ReLU passes Dispatch charges a forward (a folded ReLU), which the ledger
        # counts on the forward's row too: the grad-weight's share of a second pass stays there.
        return (t_high + self._unfolded_relu_s(site, role, shape, None)) / (
            t_fp8 + self._unfolded_relu_s(site, role, shape, plan))

    def fp8_coverage(self) -> float:
        """Fraction of (site, role) GEMMs currently planned in FP8."""
        total = len(self.plans) * len(ROLES)
        fp8 = sum(getattr(p, r).is_fp8 for p in self.plans.values() for r in ROLES)
        return fp8 / total if total else 0.0

    def table(self) -> str:
        """The current plan as a fixed-width text table."""
        rows = [("site", "role", "M x K x N", "plan", "why")]
        for site in sorted(self.plans):
            for role in ROLES:
                shape = self.shapes[site].get(role)
                rows.append(
                    (
                        site,
                        role,
                        "x".join(map(str, shape)) if shape else "-",
                        str(getattr(self.plans[site], role)),
                        self._reasons.get((site, role), "initial plan"),
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join(
            "  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows
        )

    def export(self) -> dict[str, Any]:
        """The plan for inference: site -> LinearPlan.to_dict() (forward is what inference uses)."""
        return {site: plan.to_dict() for site, plan in sorted(self.plans.items())}

    def state_dict(self) -> dict[str, Any]:
        """Plans, shapes, pending moves, timings, reasons and history, as plain data."""
        return {
            "plans": self.export(),
            "shapes": {s: {r: list(v) for r, v in d.items()} for s, d in self.shapes.items()},
            "pending": {f"{s}|{r}": list(v) for (s, r), v in self._pending.items()},
            "timings": dict(self.timer.timings),
            "timing_source": self.timing_source,
            "reasons": {f"{s}|{r}": v for (s, r), v in self._reasons.items()},
            "history": [asdict(c) for c in self.history],
            "num_changes": self.num_changes,
            "measure_failures": dict(self.measure_failures),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, step: int = 0) -> list[PlanChange]:
        """Restore :meth:`state_dict` into a dispatcher whose sites are registered.

        Restored plans are checked against the current config (a run may resume with another
        ``loka.dispatch``): a GEMM whose plan the config does not allow is reset, to the site's
        initial plan when dispatch is disabled, else to high precision (role not in
        ``fp8_roles``, scaling not in ``scalings``, backend not among this device's backends,
        formats not the configured ones, or a plan the site cannot run). Each reset is a
        :class:`PlanChange` at ``step`` (logged, counted, in the history). The site's initial
        plan and high precision are always allowed: an uninterrupted run starts from the first
        and every fallback goes to the second, so a resume with the same config changes nothing.

        Args:
            state: what :meth:`state_dict` returned.
            step: the step the resets are recorded at (the checkpoint's step).

        Returns:
            The resets (apply them to the sites like :meth:`replan`'s changes).
        """
        missing = set(state["plans"]) ^ set(self.plans)
        if missing:
            raise ValueError(
                f"dispatch state has different sites than the model ({sorted(missing)[:5]}); "
                "the model or mods config changed since the checkpoint"
            )
        initial = dict(self.plans)
        self.plans = {s: LinearPlan.from_dict(p) for s, p in state["plans"].items()}
        self.shapes = {s: {r: tuple(v) for r, v in d.items()} for s, d in state["shapes"].items()}  # type: ignore[misc]
        self._pending = {tuple(k.split("|")): (v[0], int(v[1])) for k, v in state["pending"].items()}  # type: ignore[misc]
        saved_source = state["timing_source"] if "timing_source" in state else None
        if saved_source == self.timing_source:
            self.timer.timings = dict(state["timings"])
        else:
            # Times of another GPU, dtype or of the cost model would pass for this machine's.
            self.timer.timings = {}
            if state["timings"]:
                logger.info(
                    "dispatch: the checkpoint's %d GEMM timings come from %s, this run times on "
                    "%s: they are measured again", len(state["timings"]), saved_source or "an older "
                    "version", self.timing_source,
                )
        self._reasons = {tuple(k.split("|")): v for k, v in state["reasons"].items()}  # type: ignore[misc]
        self.history = [PlanChange(**c) for c in state["history"]]
        self.num_changes = int(state["num_changes"])
        self.timer.failures = dict(state.get("measure_failures", {}))
        resets: list[PlanChange] = []
        for site in sorted(self.plans):
            resets += self._reset_disallowed(site, initial[site], step)
        for c in resets:
            logger.warning("dispatch: %s", c)
        self.history.extend(resets)
        self.num_changes += len(resets)
        return resets

    def _reset_disallowed(self, site: str, initial: LinearPlan, step: int) -> list[PlanChange]:
        """Reset the GEMMs of ``site`` whose restored plan the config does not allow."""
        restored = planning.roles_of(self.plans[site])
        # Start from the plans that are always allowed, then add the others one by one, so the
        # site's whole-plan check of one role never sees another role's disallowed plan.
        kept = {
            r: p if (not p.is_fp8 or p == getattr(initial, r)) else GemmPlan()
            for r, p in restored.items()
        }
        changes = []
        for role in ROLES:
            plan = restored[role]
            if kept[role] == plan:
                continue
            target, why = planning.disallowed(
                self.config, role, plan, others=kept, initial=getattr(initial, role),
                device_type=self.device.type, site_supports=self._site_supports.get(site),
            )
            if not why:
                kept[role] = plan
                continue
            kept[role] = target
            reason = f"restored from a checkpoint but not allowed by the current config: {why}"
            changes.append(PlanChange(step, site, role, str(plan), str(target), reason))
            self._reasons[(site, role)] = reason
            self._pending.pop((site, role), None)
        self.plans[site] = LinearPlan(**kept)
        return changes
