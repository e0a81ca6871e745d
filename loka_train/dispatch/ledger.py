"""The per-GEMM ledger: where FP8 can pay in a model, and what eats the gain.

For every site and GEMM role (forward, grad-input, grad-weight) at the shapes the run saw, the
ledger measures, the way the site runs them:

* the high-precision GEMM (the compute dtype: bf16 under autocast on a GPU);
* for each FP8 candidate Dispatch may choose, the FP8 GEMM alone on pre-quantized operands, and
  the quantization of each operand (from the role's real layouts: ``x``, ``W``; ``dY``,
  ``W^T``; ``dY^T``, ``X^T``); an operand that the site takes over from another of its GEMMs
  (tensor-wise payloads reused transposed, :func:`loka_train.kernels.linear.transposed_reuse`)
  costs nothing, as in the site;
* for a forward whose site has the ReLU before it folded in (``mods.fold_relu``), the ReLU
  pass that high precision runs first, and a candidate whose cast applies the ReLU runs not:
  such a cast's quantization costs the step only what it takes beyond that pass, unless the
  site's grad-weight does not take its ``x`` over, where the backward runs the ReLU again and
  the forward is charged that pass.

From these it predicts what FP8 does to a step (Amdahl, from measured times): the saving of the
plan the run chose, the saving if every GEMM took its fastest FP8 candidate where that beats
high precision with quantization paid ("best as paid"), and the ceiling if quantization were
free ("quantization free": the FP8 GEMM alone). ``quant / saved`` per GEMM says how much of
what the FP8 GEMM saves its quantization eats (1.0 or more: FP8 cannot pay there);
:meth:`Ledger.sites` sums it per site under the chosen plans.

The times come from ``GemmTimer.time``: CUDA-graph replays on a GPU (what a graphed step runs),
the host clock elsewhere (the emulated backend on a CPU: the numbers say nothing of a GPU).

Example:
    >>> gemms = [LedgerGemm("mlp.0", "forward", (4096, 512, 512), GemmPlan(), (fp8_plan,))]
    >>> ledger = measure_ledger(gemms, device=torch.device("cuda"))
    >>> print(ledger.markdown(step_ms=10.0))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from loka_train.dispatch.planning import gemm_problem, padded, runs_relu_again, site_reuse
from loka_train.dispatch.timing import GemmTimer, reused_payload, role_operands, transposed_write_s
from loka_train.kernels.formats import QTensor
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.linear import quantize_operand, run_backend
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend
from loka_train.kernels.roles import ROLES, Role

__all__ = [
    "FP8_GEMM_CEILING",
    "Ledger",
    "LedgerGemm",
    "LedgerRow",
    "Fp8Times",
    "OPERANDS",
    "measure_ledger",
    "site_table",
]

Shape = tuple[int, int, int]

FP8_GEMM_CEILING = 2.0
"""The FP8 tensor-core rate over bf16's on Hopper: no FP8 GEMM runs more than this faster."""

OPERANDS: dict[str, tuple[str, str]] = {
    Role.FORWARD: ("x", "W"),
    Role.GRAD_INPUT: ("dY", "W^T"),
    Role.GRAD_WEIGHT: ("dY^T", "x^T"),
}
"""Each role's operands ``(a, b)`` as the ledger names them (:class:`Fp8Times`'s
``quant_a_ms`` and ``quant_b_ms``; ``timing.role_operands`` lays them out)."""


@dataclass(frozen=True)
class LedgerGemm:
    """One GEMM to put in the ledger: where it is, its shape, the plan the run chose and the
    FP8 candidates Dispatch may choose from."""

    site: str
    role: str
    shape: Shape
    """(M, K, N) as Dispatch records it for the role."""
    plan: GemmPlan
    """The plan the run holds for this GEMM now."""
    candidates: tuple[GemmPlan, ...]
    """FP8 plans to time (Dispatch's candidates; the chosen one is added if missing)."""
    site_plan: LinearPlan | None = None
    """The site's whole plan, to tell which operands the site reuses across its GEMMs."""
    planned_speedup: float | None = None
    """The speed-up over high precision Dispatch decided the FP8 plan on, from the times it took
    then (``Dispatcher.planned_speedup``); None for a high-precision plan."""
    input_relu: bool = False
    """A forward whose site has the ReLU before it folded in (``Site.input_relu``,
    ``mods.fold_relu``): high precision, and an FP8 candidate whose cast does not apply it, run
    a ReLU pass over ``x`` first; a cast that applies it runs none, unless the site's
    grad-weight does not take its ``x`` over (``grad_weight_plan``): the backward then runs
    the ReLU again (``planning.runs_relu_again``), charged here to the forward. As Dispatch
    charges them; with the default ``compiled_quantizer`` (under ``inductor`` a site computes
    the ReLU first, which neither sees)."""
    grad_weight_plan: GemmPlan | None = None
    """The site's grad-weight plan for ``input_relu`` (None: the site has no grad-weight GEMM).
    Every forward candidate is charged as if grad-weight kept this plan: a row's "best" and
    "quantization free" figures do not weigh a grad-weight plan chosen with them."""


@dataclass(frozen=True)
class Fp8Times:
    """Milliseconds of one FP8 candidate of a GEMM, as the site runs it."""

    plan: str
    gemm_ms: float
    """The backend alone, operands already quantized."""
    quant_a_ms: float
    """Quantizing operand ``a``; for an operand the site reuses from another GEMM, the
    transposed write that GEMM's quantizer adds for it (``timing.transposed_write_s``; 0 where
    it is reused as a view)."""
    quant_b_ms: float
    """Quantizing operand ``b`` (the weight in forward and grad-input: every step); a
    reused one as in ``quant_a_ms``."""
    relu_ms: float = 0.0
    """The ReLU pass this candidate runs (``LedgerGemm.input_relu``): before its GEMM where
    its cast does not apply the ReLU, in the backward where its cast applies it and grad-weight
    does not take ``x`` over; 0 where neither, or where there is none."""

    @property
    def total_ms(self) -> float:
        """GEMM plus the quantization the site pays, plus the ReLU pass it runs (``relu_ms``)."""
        return self.gemm_ms + self.quant_a_ms + self.quant_b_ms + self.relu_ms

    @property
    def quant_ms(self) -> float:
        return self.quant_a_ms + self.quant_b_ms


@dataclass(frozen=True)
class LedgerRow:
    """One GEMM's line of the ledger."""

    site: str
    role: str
    shape: Shape
    plan: str
    """The chosen plan (``high`` or an FP8 plan's key)."""
    high_ms: float
    fp8: tuple[Fp8Times, ...]
    """Every timed FP8 candidate (a failed one is left out and named in ``failures``)."""
    failures: tuple[str, ...] = ()
    planned_speedup: float | None = None
    """Dispatch's speed-up for the chosen FP8 plan when it chose it (``LedgerGemm``): next to
    this ledger's own measurement, a plan taken on a timing the ledger does not confirm shows."""
    relu_ms: float = 0.0
    """The ReLU pass that high precision runs before this GEMM (``LedgerGemm.input_relu``)."""

    @property
    def high_total_ms(self) -> float:
        """The high-precision GEMM plus the ReLU pass it runs before it (``relu_ms``)."""
        return self.high_ms + self.relu_ms

    def speedup_as_paid(self, t: Fp8Times) -> float:
        """High precision's time (with its ReLU pass) over candidate ``t``'s, its quantization
        paid (inf for a time of 0)."""
        return self.high_total_ms / t.total_ms if t.total_ms > 0 else math.inf

    def quant_paid_ms(self, t: Fp8Times) -> float:
        """What quantizing costs the step under candidate ``t``: its casts, plus the ReLU pass
        it runs, less the one high precision runs (a cast that applies a folded ReLU takes
        that pass over: only what it costs beyond the pass is the quantization's)."""
        return t.quant_ms + t.relu_ms - self.relu_ms

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LedgerRow:
        """A row read back from :meth:`to_dict` (a report rendered from a ledger's JSON): its
        derived keys are left out, and a field a ledger written before it existed takes its
        default."""
        own, times = {f.name for f in fields(cls)}, {f.name for f in fields(Fp8Times)}
        kw = {k: v for k, v in d.items() if k in own}
        kw.update(shape=tuple(d["shape"]), failures=tuple(d.get("failures", ())),
                  fp8=tuple(Fp8Times(**{k: v for k, v in t.items() if k in times}) for t in d["fp8"]))
        return cls(**kw)

    def _times(self, plan: str) -> Fp8Times | None:
        return next((t for t in self.fp8 if t.plan == plan), None)

    @property
    def chosen(self) -> Fp8Times | None:
        """The chosen FP8 candidate's times (None when the GEMM runs in high precision)."""
        return self._times(self.plan)

    @property
    def shown(self) -> Fp8Times | None:
        """The candidate a table shows: the chosen FP8 plan's times where the GEMM runs in FP8
        (None where their timing failed: another candidate's would sit next to Dispatch's
        speed-up for the chosen plan), the best as paid where it runs in high precision."""
        return self.chosen if self.plan != "high" else self.best

    @property
    def best(self) -> Fp8Times | None:
        """The FP8 candidate fastest with its quantization paid."""
        return min(self.fp8, key=lambda t: t.total_ms, default=None)

    @property
    def fastest_gemm(self) -> Fp8Times | None:
        """The FP8 candidate with the fastest GEMM alone."""
        return min(self.fp8, key=lambda t: t.gemm_ms, default=None)

    @property
    def saved_as_planned_ms(self) -> float:
        """High-precision time minus the chosen plan's (0 in high precision; negative when the
        chosen FP8 plan is slower than high precision)."""
        c = self.chosen
        return 0.0 if c is None else self.high_total_ms - c.total_ms

    @property
    def saved_best_ms(self) -> float:
        """What the fastest FP8 candidate saves with its quantization paid (never negative:
        a GEMM where FP8 loses stays in high precision)."""
        b = self.best
        return 0.0 if b is None else max(0.0, self.high_total_ms - b.total_ms)

    @property
    def saved_ceiling_ms(self) -> float:
        """What FP8 would save with quantization free: the GEMM alone and the ReLU pass it
        runs, the least of those over the candidates."""
        if not self.fp8:
            return 0.0
        return max(0.0, self.high_total_ms - min(t.gemm_ms + t.relu_ms for t in self.fp8))

    @property
    def quant_over_saved(self) -> float:
        """For the candidate with the fastest GEMM: the quantization it pays
        (:meth:`quant_paid_ms`) over what its GEMM saves (inf when the FP8 GEMM alone saves
        nothing)."""
        g = self.fastest_gemm
        if g is None:
            return math.nan
        saved = self.high_ms - g.gemm_ms
        return self.quant_paid_ms(g) / saved if saved > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d.update(
            saved_as_planned_ms=self.saved_as_planned_ms,
            saved_best_ms=self.saved_best_ms,
            saved_ceiling_ms=self.saved_ceiling_ms,
            quant_over_saved=self.quant_over_saved,
        )
        return d


@dataclass
class Ledger:
    """The ledger of a model's GEMMs and the step speed-ups it predicts."""

    rows: list[LedgerRow]
    device: str
    timing: str
    """``cuda_graph`` (replays on a GPU) or ``host_clock`` (elsewhere)."""
    notes: list[str] = field(default_factory=list)

    @property
    def high_ms(self) -> float:
        """High-precision GEMM time of one step, summed over the ledger's GEMMs."""
        return sum(r.high_ms for r in self.rows)

    def totals(self) -> dict[str, float]:
        """Per-step sums (ms): high-precision GEMMs, and the savings as planned, at best with
        quantization paid, and with quantization free."""
        return {
            "high_ms": self.high_ms,
            "saved_as_planned_ms": sum(r.saved_as_planned_ms for r in self.rows),
            "saved_best_ms": sum(r.saved_best_ms for r in self.rows),
            "saved_ceiling_ms": sum(r.saved_ceiling_ms for r in self.rows),
        }

    def sites(self) -> list[dict[str, Any]]:
        """Per site with a GEMM in FP8, under the chosen plans: what its FP8 GEMMs save against
        high precision (the GEMMs alone), the quantization the site pays for them
        (:meth:`LedgerRow.quant_paid_ms`: casts and transposed writes, less a ReLU pass a cast
        takes over) and its share of that saving; largest saving first. ``paid_by_operand``
        splits what it pays (``OPERANDS``: the forward's ``x`` and ``W``, grad-input's ``dY``
        and ``W^T``, grad-weight's ``dY^T`` and ``x^T``, a transposed write where the operand
        is taken over; ``relu``: the ReLU pass the plans run less the one high precision
        runs), in the roles' order, what sums to ``quant_paid_ms``. A GEMM whose chosen plan
        has no times (its timing failed) is left out and named in ``untimed``."""
        by_site: dict[str, dict[str, Any]] = {}
        for r in self.rows:
            if r.plan == "high":
                continue
            s = by_site.setdefault(r.site, {"site": r.site, "roles": [], "untimed": [], "gemm_saved_ms": 0.0,
                                             "quant_paid_ms": 0.0, "paid_by_operand": {}})
            c = r.chosen
            if c is None:
                s["untimed"].append(r.role)
                continue
            s["roles"].append(r.role)
            s["gemm_saved_ms"] += r.high_ms - c.gemm_ms
            s["quant_paid_ms"] += r.quant_paid_ms(c)
            paid = s["paid_by_operand"]
            for name, ms in zip(OPERANDS[r.role], (c.quant_a_ms, c.quant_b_ms), strict=True):
                paid[name] = paid.get(name, 0.0) + ms
            if c.relu_ms != r.relu_ms:
                paid["relu"] = paid.get("relu", 0.0) + c.relu_ms - r.relu_ms
        order = [n for role in ROLES for n in OPERANDS[role]] + ["relu"]
        for s in by_site.values():
            s["paid_by_operand"] = {n: s["paid_by_operand"][n] for n in order if n in s["paid_by_operand"]}
            saved = s["gemm_saved_ms"]
            s["quant_over_saved"] = s["quant_paid_ms"] / saved if saved > 0 else math.inf
        return sorted(by_site.values(), key=lambda s: -s["gemm_saved_ms"])

    def predict(self, step_ms: float, *, planned_step: bool = True) -> dict[str, float]:
        """Step speed-ups over an all-high-precision step (Amdahl, from measured GEMM times).

        Args:
            step_ms: a measured step time.
            planned_step: True when ``step_ms`` is a step that ran this ledger's chosen plans
                (the all-high step is then ``step_ms`` plus what the plan saved); False when it
                is a step with every GEMM in high precision (a bf16 run with the same settings).

        Returns:
            ``high_step_ms`` and the speed-ups ``as_planned``, ``best_as_paid`` and
            ``quant_free`` (``high_step_ms`` over the step with that saving), plus
            ``gemm_ceiling``: the step with every GEMM ``FP8_GEMM_CEILING`` times faster (and
            the ReLU passes that folding casts save).
        """
        if not step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {step_ms}")
        t = self.totals()
        high_step = step_ms + t["saved_as_planned_ms"] if planned_step else step_ms

        def speedup(saved: float) -> float:
            rest = high_step - saved
            return high_step / rest if rest > 0 else math.inf

        # With the ReLU passes that a folding cast saves (none where a candidate runs one).
        relu_saved = sum(r.relu_ms - min(t.relu_ms for t in r.fp8) for r in self.rows if r.fp8)
        ceiling_saved = t["high_ms"] * (1.0 - 1.0 / FP8_GEMM_CEILING) + relu_saved
        return {
            "high_step_ms": high_step,
            "as_planned": speedup(t["saved_as_planned_ms"]),
            "best_as_paid": speedup(t["saved_best_ms"]),
            "quant_free": speedup(t["saved_ceiling_ms"]),
            "gemm_ceiling": speedup(ceiling_saved),
        }

    def to_dict(self, step_ms: float | None = None, *, planned_step: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.device,
            "timing": self.timing,
            "rows": [r.to_dict() for r in self.rows],
            "totals": self.totals(),
            "sites": self.sites(),
            "notes": list(self.notes),
        }
        if step_ms is not None:
            out["step_ms"] = step_ms
            out["prediction"] = self.predict(step_ms, planned_step=planned_step)
        return out

    def markdown(self, step_ms: float | None = None, *, planned_step: bool = True, top: int | None = None) -> str:
        """The ledger as a Markdown table, largest high-precision GEMMs first, then the
        predicted step speed-ups when ``step_ms`` is given."""
        rows = sorted(self.rows, key=lambda r: -r.high_ms)
        if top is not None:
            rows = rows[:top]
        lines = [
            "| site | GEMM | M x K x N | plan | high ms | FP8 GEMM ms | quant a ms | quant b ms "
            "| FP8 total ms | speed-up as paid | Dispatch's speed-up | quant / saved | ReLU pass ms (high, FP8) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            f = r.shown
            planned = "-" if r.planned_speedup is None else _x(r.planned_speedup)
            if f is None:
                cells = ["-"] * 5 + [planned, "-"]
            else:
                cells = [
                    f"{f.gemm_ms:.3f}", f"{f.quant_a_ms:.3f}", f"{f.quant_b_ms:.3f}",
                    f"{f.total_ms:.3f}", _x(r.speedup_as_paid(f)),
                    planned, _ratio(r.quant_over_saved),
                ]
            relu = "-" if r.relu_ms == 0 and (f is None or f.relu_ms == 0) else (
                f"{r.relu_ms:.3f}, {'-' if f is None else f'{f.relu_ms:.3f}'}")
            cells.append(relu)
            lines.append(
                f"| {r.site} | {r.role} | {'x'.join(map(str, r.shape))} | {r.plan} | "
                f"{r.high_ms:.3f} | " + " | ".join(cells) + " |"
            )
        if top is not None and len(self.rows) > top:
            lines.append(f"\n{len(self.rows) - top} smaller GEMMs not shown (all in the JSON).")
        lines += ["", *site_table(self.sites())]
        t = self.totals()
        lines += [
            "",
            f"Per step: high-precision GEMMs {t['high_ms']:.3f} ms; FP8 saves "
            f"{t['saved_as_planned_ms']:.3f} ms as planned, {t['saved_best_ms']:.3f} ms at best "
            f"with quantization paid, {t['saved_ceiling_ms']:.3f} ms with quantization free.",
        ]
        if step_ms is not None:
            p = self.predict(step_ms, planned_step=planned_step)
            lines.append(
                f"Predicted step speed-up over high precision (step {p['high_step_ms']:.2f} ms): "
                f"as planned {_x(p['as_planned'])}, best as paid {_x(p['best_as_paid'])}, "
                f"quantization free {_x(p['quant_free'])}, every GEMM at the {FP8_GEMM_CEILING:g}x "
                f"FP8 rate {_x(p['gemm_ceiling'])}."
            )
        lines.append(
            f"Timing: {self.timing} on {self.device}. The chosen plan's times are shown where the "
            "GEMM runs in FP8, the fastest candidate's otherwise; 'quant / saved': what quantizing "
            "costs over what the FP8 GEMM saves (>= 1: FP8 cannot pay there), a ReLU pass that a cast "
            "takes over from high precision counted off (last column); 'Dispatch's "
            "speed-up': the chosen FP8 plan's speed-up in the times Dispatch took when it chose it "
            "(far from 'speed-up as paid': the plan rests on a timing this measurement does not confirm)."
        )
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def site_table(sites: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown of :meth:`Ledger.sites` (also from a ledger's JSON); empty without FP8 sites."""
    if not sites:
        return []
    lines = [
        "Per site, the chosen plans: what its FP8 GEMMs save (the GEMMs alone) and what its "
        "quantization costs the step (casts and transposed writes, less a ReLU pass a cast takes over):",
        "",
        "| site | FP8 GEMMs | GEMMs saved ms | quantization paid ms | quantization / saved | paid by operand ms |",
        "|---|---|---|---|---|---|",
    ]
    for s in sites:
        roles = ", ".join(s["roles"]) + (f" (untimed: {', '.join(s['untimed'])})" if s["untimed"] else "")
        # A ledger written before the split has none: its column stays empty.
        by_operand = ", ".join(f"{name} {ms:.3f}" for name, ms in s.get("paid_by_operand", {}).items())
        lines.append(f"| {s['site']} | {roles} | {s['gemm_saved_ms']:.3f} | {s['quant_paid_ms']:.3f} | "
                     f"{_ratio(s['quant_over_saved'])} | {by_operand} |")
    return lines


def _x(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}x"


def _ratio(v: float) -> str:
    if math.isnan(v):
        return "-"
    return "inf" if math.isinf(v) else f"{v:.2f}"


# ------------------------------------------------------------------------------ measurement
Timer = Callable[[Callable[[], object]], float]
"""``timer(run) -> milliseconds`` of one ``run()``."""


def _fp8_times(
    gemm: LedgerGemm, plan: GemmPlan, device: torch.device, timer: Timer, *, zero_half: bool = False,
    static: Tensor | None = None, relu: tuple[bool, bool, float] | None = None,
    reused_static: Callable[[bool], Tensor | None] = lambda is_weight: None,
) -> Fp8Times:
    """As the site runs it (``GemmTimer.measure_once``): a shape the backend refuses zero-padded
    to multiples of 16 (the padding copies are not in these columns), a reused operand what the
    other GEMM's quantizer hands over (:func:`~loka_train.dispatch.timing.reused_payload`),
    charged the transposed write that quantizer makes for it; ``a`` with the static-scale slot
    ``static`` where given. ``relu`` (a forward of a site with a folded ReLU): whether this
    candidate's cast applies it (then ``a`` is cast with ``relu=True``), whether the backward
    runs it again (grad-weight does not take ``x`` over), and the ReLU pass's milliseconds,
    which a candidate whose cast does not apply it pays (it casts ``relu(a)``), and one whose
    backward runs it again. ``reused_static(is_weight)``: the static-scale slot of the pass that
    writes a reused operand (``GemmTimer.reused_static_slot``), its transposed write timed in
    that form."""
    shape = gemm.shape
    problem = gemm_problem(gemm.role, shape, plan, device_type=device.type, out_dtype=torch.bfloat16)
    if not get_backend(plan.backend).supports(problem)[0]:
        shape = padded(shape, 16)
    a, b, b_is_weight, out_dtype = role_operands(gemm.role, shape, device=device, zero_half=zero_half)
    reuse_a, reuse_b = site_reuse(gemm.role, plan, gemm.site_plan)
    folds, again, relu_ms = relu if relu is not None else (False, False, 0.0)
    if relu is not None and not folds:
        a = torch.relu(a)  # what the ReLU pass hands a cast that does not apply it

    def quant_a() -> QTensor:
        return quantize_operand(a, plan.fmt, plan, is_weight=False, static=static, relu=folds)

    def quant_b() -> QTensor:
        return quantize_operand(b, plan.operand_b_fmt, plan, is_weight=b_is_weight)

    a_q = reused_payload(a, plan.fmt, plan, is_weight=False) if reuse_a else quant_a()
    b_q = reused_payload(b, plan.operand_b_fmt, plan, is_weight=b_is_weight) if reuse_b else quant_b()
    ok, why = get_backend(plan.backend).supports(
        GemmProblem.from_operands(a_q, b_q, out_dtype=out_dtype, role=gemm.role, fast_accum=plan.fast_accum)
    )
    if not ok:
        raise RuntimeError(f"{plan.backend} cannot run {'x'.join(map(str, shape))}: {why}")
    return Fp8Times(
        plan=str(plan),
        gemm_ms=timer(lambda: run_backend(plan, a_q, b_q, out_dtype=out_dtype, role=gemm.role)),
        quant_a_ms=transposed_write_s(a, plan.fmt, plan, timer, reused_static(False)) if reuse_a else timer(quant_a),
        quant_b_ms=(
            transposed_write_s(b, plan.operand_b_fmt, plan, timer, reused_static(b_is_weight))
            if reuse_b else timer(quant_b)
        ),
        relu_ms=relu_ms if (again or not folds) else 0.0,
    )


def measure_ledger(
    gemms: Sequence[LedgerGemm],
    *,
    device: torch.device,
    timer: Timer | None = None,
    high_dtype: torch.dtype = torch.bfloat16,
    zero_half: bool = False,
    static_scales: bool = False,
) -> Ledger:
    """Time every GEMM of ``gemms`` in high precision and with each FP8 candidate.

    Shapes repeat across sites (a tower's layers); each distinct measurement runs once.
    A candidate whose measurement raises is left out of its row and named in its
    ``failures`` (it would never be chosen: Dispatch excludes it the same way).

    Args:
        gemms: the GEMMs, e.g. from ``LokaCallback.ledger_gemms()``.
        device: where to measure.
        timer: ``timer(run) -> ms``; default ``GemmTimer.time``, graph-replayed on a GPU (what
            a graphed step runs), the host clock elsewhere.
        high_dtype: the high-precision compute dtype (bf16 under autocast on a GPU).
        zero_half: activations and gradients half zeros, as behind a ReLU
            (``timing.role_operands``).
        static_scales: tensor-wise ``x`` and ``dY`` quantized with static scales, as the sites
            run them under ``mods.static_scales``.
    """
    slots = GemmTimer(timing="auto", device=device, out_dtype=high_dtype, static_scales=static_scales)
    time_ms: Timer
    if timer is None:
        gemm_timer = GemmTimer(timing="auto", device=device, out_dtype=high_dtype, graphed=True)
        time_ms = _milliseconds(gemm_timer)
    else:
        time_ms = timer
    cache: dict[tuple[Any, ...], Any] = {}
    rows = []
    for g in gemms:
        key_high = ("high", g.role, g.shape)
        if key_high not in cache:
            a, b, _, _ = role_operands(g.role, g.shape, device=device, dtype=high_dtype, zero_half=zero_half)
            cache[key_high] = time_ms(_matmul(a, b))
        relu_ms = 0.0
        relu_pass = g.input_relu and g.role == "forward"
        if relu_pass:
            key_relu = ("relu", g.shape[0], g.shape[1])
            if key_relu not in cache:
                x, _, _, _ = role_operands("forward", g.shape, device=device, dtype=high_dtype, zero_half=zero_half)
                cache[key_relu] = time_ms(_relu(x))
            relu_ms = cache[key_relu]
        candidates = list(dict.fromkeys([*g.candidates, *([g.plan] if g.plan.is_fp8 else [])]))
        times: list[Fp8Times] = []
        failures: list[str] = []
        for plan in candidates:
            relu = None
            if relu_pass:
                folds = slots.folds_relu(plan)
                gw = g.grad_weight_plan
                relu = (folds, runs_relu_again(plan, gw, folds=folds), relu_ms)
            key = (str(plan), g.role, g.shape, site_reuse(g.role, plan, g.site_plan), relu)
            if key not in cache:
                try:
                    cache[key] = _fp8_times(
                        g, plan, device, time_ms, zero_half=zero_half, static=slots.static_slot(g.role, plan),
                        relu=relu, reused_static=functools.partial(slots.reused_static_slot, plan),
                    )
                except Exception as exc:  # one backend's failure must not lose the ledger
                    cache[key] = f"{plan}: {type(exc).__name__}: {exc}"
            value = cache[key]
            if isinstance(value, Fp8Times):
                times.append(value)
            else:
                failures.append(value)
        rows.append(
            LedgerRow(
                site=g.site, role=g.role, shape=g.shape, plan=str(g.plan) if g.plan.is_fp8 else "high",
                high_ms=cache[key_high], fp8=tuple(times), failures=tuple(failures),
                planned_speedup=g.planned_speedup, relu_ms=relu_ms,
            )
        )
    timing = "cuda_graph" if device.type == "cuda" and timer is None else "host_clock"
    notes = []
    if static_scales:
        notes.append("tensor-wise x and dY quantized with static scales (mods.static_scales)")
    if device.type != "cuda":
        notes.append("measured on the CPU: FP8 is emulated there; the times say nothing of a GPU")
    return Ledger(rows=rows, device=_device_name(device), timing=timing if timer is None else "custom", notes=notes)


def _milliseconds(gemm_timer: GemmTimer) -> Timer:
    return lambda run: gemm_timer.time(run) * 1e3


def _relu(x: Tensor) -> Callable[[], Tensor]:
    return lambda: torch.relu(x)


def _matmul(a: Tensor, b: Tensor) -> Callable[[], Tensor]:
    return lambda: a @ b.t()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
