"""The LoKA run report: plain data, its files (JSON, Markdown, PNG plots), and summary rows.

:class:`~loka_train.plugin.callback.LokaCallback` builds the report from its Probe, Dispatcher
and comm state (:func:`run_report`) and writes it under ``<out_dir>/loka`` on rank 0
(:func:`write_report`): ``loka_report.json`` (everything, plots re-drawable from it),
``loka_report.md`` (:func:`markdown`: the run's NE/AUC, what every column means, whether FP8
was emulated, the plan per GEMM, plan changes, communication, fallbacks), ``sqnr_margin.png``
and ``plan_timeline.png`` (:mod:`loka_train.plugin.plots`). :func:`summary_rows` adds its
figures to the run summary's table.

Example:
    >>> report = run_report(sites=cb.sites, probe=cb.probe, dispatcher=cb.dispatcher,
    ...                     evals=cb.evals, timeline=cb.timeline)
    >>> write_report(report, Path("runs/x/loka"), history=cb.dispatcher.history)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loka_train.dispatch import Dispatcher, PlanChange
from loka_train.dispatch.planning import plan_for
from loka_train.kernels import static_scales
from loka_train.kernels.formats import Scaling
from loka_train.kernels.roles import ROLES
from loka_train.plugin.plots import Timeline, margin_grid, plot_sqnr_margin, plot_timeline
from loka_train.probe import Probe

logger = logging.getLogger(__name__)

__all__ = ["COMM_CHANNELS", "markdown", "run_report", "summary_rows", "write_report"]

COMM_CHANNELS: dict[str, str] = {
    "a2a_fwd": "embedding all-to-all, forward (pooled embeddings)",
    "a2a_bwd": "embedding all-to-all, backward (their gradients)",
    "rs_fwd": "reduce-scatter of row-wise sharded tables, forward",
    "rs_bwd": "its gradients (an all-gather), backward",
    "dense_grad": "dense gradients, DDP all-reduce (comm hook)",
    "replica_sync": "2D sparse parallelism: embedding replicas' change since the last sync",
}
"""What each communication channel carries (``loka_train.comm.CommChannel``)."""


def _dispatch_candidates(dispatcher: Dispatcher) -> dict[str, list[str]]:
    """role -> names of the Probe candidates (``e4m3_rowwise``, ...) Dispatch may plan for it."""
    cfg = dispatcher.config
    return {
        role: [f"{plan_for(cfg, role, s, 'emulated').fmt.value}_{s}" for s in cfg.scalings]
        if role in cfg.fp8_roles else []
        for role in ROLES
    }


def run_report(
    *,
    sites: Mapping[str, Any],
    probe: Probe,
    dispatcher: Dispatcher,
    comm_state: Any = None,
    compressors: Sequence[Any] = (),
    guard_trips: Sequence[dict[str, Any]] = (),
    fallbacks: Sequence[str] = (),
    evals: Sequence[Mapping[str, float]] = (),
    timeline: Timeline = (),
) -> dict[str, Any]:
    """The run report as plain data (rank-independent content, JSON-able).

    Args:
        sites: name -> FP8-capable site.
        probe: the Probe (verdicts, its own report).
        dispatcher: the Dispatcher (plans, shapes, reasons, history, timings).
        comm_state: the comm state when quantized comms are on.
        compressors: the dense-gradient hooks' compressors.
        guard_trips: the quality guard's trips.
        fallbacks: the loop's own fallbacks, listed after the plugin's.
        evals: the run's evaluations so far, each ``{"step", "ne", "auc"}`` and, with
            ``guard.forward_ne``, ``"ne_forwards_high"``.
        timeline: the plans chosen at each Probe interval (:data:`~loka_train.plugin.plots.Timeline`).
    """
    d = dispatcher
    verdicts = probe.verdicts()
    probe_report = probe.report()
    site_rows = {}
    fp8_backends: set[str] = set()
    for name in sorted(sites):
        roles = {}
        for role in ROLES:
            plan = getattr(d.plans[name], role)
            shape = d.shapes[name].get(role)
            entry: dict[str, Any] = {"plan": str(plan), "shape": list(shape) if shape else None}
            entry["budget_db"] = probe_report["sites"][name]["sqnr_budget_db"][role]
            if plan.is_fp8:
                fp8_backends.add(plan.backend)
                v = verdicts.get((name, role, plan.fmt, plan.scaling))
                if v is not None:
                    entry["sqnr_lo_db"] = v.sqnr_lo_db
                    entry["verdict"] = v.reason
                speedup = d.planned_speedup(name, role)
                if speedup is not None:
                    entry["est_speedup"] = speedup
            entry["why"] = d._reasons.get((name, role), "initial plan")
            entry["history"] = [str(c) for c in d.history if c.site == name and c.role == role]
            roles[role] = entry
        site_rows[name] = roles
    comm = comm_state.report() if comm_state is not None else {"enabled": False}
    listed = [f"backend unavailable: {k}: {v}" for k, v in sorted(d.unsupported.items())]
    listed += [
        f"candidate excluded, its benchmark failed: {k}: {v}" for k, v in sorted(d.measure_failures.items())
    ]
    listed += [
        f"site {name}: {site.num_fallbacks} GEMMs ran in high precision instead of their plan"
        for name, site in sorted(sites.items())
        if getattr(site, "num_fallbacks", 0)
    ]
    listed += [
        f"dense grad hook {i}: {comp.num_dropped_residuals} restored error-feedback "
        "residual(s) dropped"
        for i, comp in enumerate(compressors) if comp.num_dropped_residuals
    ]
    if probe_report.get("shadow_gemm_fallback"):
        listed.append(
            "probe: shadow GEMMs in fp32 instead of bf16 GEMMs with an fp32 result "
            f"({probe_report['shadow_gemm_fallback']}): slower sampled steps, statistics equal up to fp32 rounding"
        )
    listed += list(fallbacks)
    static = []
    for name in sorted(sites):
        slots = getattr(sites[name], "static_slots", None)
        if slots is None:
            continue
        plan = d.plans[name]
        for operand, gemm, row in zip(("x", "dY"), (plan.forward, plan.grad_input), slots.detach().cpu().tolist()):
            static.append({
                "site": name, "operand": operand, "scale": row[static_scales.SCALE],
                "recasts": int(row[static_scales.FALLBACKS]),
                # Whether the operand runs tensor-wise FP8 now (the slot is kept either way).
                "tensorwise": gemm.is_fp8 and gemm.scaling is Scaling.TENSORWISE,
            })
    listed += [
        f"kernels: {r['site']} {r['operand']}: the static scale did not fit {r['recasts']} tensor(s), which "
        "were recast with their dynamic scale (the scale re-seeded from each finite one)"
        for r in static if r["recasts"]
    ]
    return {
        "device": d.device.type,
        "emulated": d.device.type != "cuda",
        "fp8_backends": sorted(fp8_backends),
        "objective": d.objective,
        "fp8_coverage": d.fp8_coverage(),
        "timing": d.timing_mode,
        "timing_source": d.timing_source,
        "plan_changes": d.num_changes,
        "guard_trips": list(guard_trips),
        "evals": [dict(e) for e in evals],
        "sites": site_rows,
        "dispatch_candidates": _dispatch_candidates(d),
        "timeline": [[int(step), dict(plans)] for step, plans in timeline],
        "probe": probe_report,
        "comm": comm,
        "fallbacks": listed,
        "static_scales": static,
        "plan_export": d.export(),
    }


def write_report(report: dict[str, Any], out: Path, *, history: Sequence[PlanChange]) -> list[str]:
    """Write ``loka_report.{json,md}``, ``sqnr_margin.png`` and ``plan_timeline.png`` under `out`.

    Args:
        report: :func:`run_report`.
        out: the directory (created).
        history: the plan changes, for the Markdown.

    Returns:
        The fallbacks taken (plots skipped without matplotlib: logged).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "loka_report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "loka_report.md").write_text(markdown(report, history))
    try:
        grid = margin_grid(report["probe"], report["timeline"], report["dispatch_candidates"])
        plot_sqnr_margin(grid, out / "sqnr_margin.png")
        plot_timeline(sorted(report["sites"]), report["timeline"], out / "plan_timeline.png")
    except ImportError as exc:
        msg = f"report plots skipped: {exc} (pip install matplotlib)"
        logger.warning(msg)
        return [msg]
    return []


# ---------------------------------------------------------------------------------- Markdown
def _bytes(n: float) -> str:
    """A byte count for a reader: ``81.9 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _quality(report: Mapping[str, Any]) -> list[str]:
    evals = report["evals"]
    if not evals:
        return ["**Quality**: no evaluation ran.", ""]
    last = evals[-1]
    lines = [
        f"**Quality**: eval NE {last['ne']:.4f}, AUC {last['auc']:.4f} at step {last['step']} "
        f"(the last of {len(evals)} evaluation(s)). NE is the normalized entropy: the log loss "
        "divided by the entropy of the label rate (1.0 predicts the base rate; lower is better); "
        "AUC is the area under the ROC curve (higher is better).",
        "",
    ]
    high = [e for e in evals if "ne_forwards_high" in e]
    if high:
        cost = last["ne"] / last["ne_forwards_high"] - 1 if "ne_forwards_high" in last else None
        lines += [
            "With `guard.forward_ne`, each evaluation where a site's forward ran in FP8 ran again with "
            "those forwards in high precision: "
            + (f"at step {last['step']} the FP8 forwards cost {100 * cost:+.4f}% of NE "
               f"(NE {last['ne_forwards_high']:.5f} with them in high precision). " if cost is not None else "")
            + "A gap to a bf16 run beyond it is what FP8 changed in training, the embedding exchange's "
            "codecs and the runs' own spread.",
            "",
        ]
    if len(evals) > 1 or high:
        cols = " | NE with FP8 forwards high | FP8 forwards' NE cost" if high else ""
        lines += [f"| step | eval NE | eval AUC{cols} |", "|---|---|---|" + ("---|---|" if high else "")]
        for e in evals:
            row = f"| {e['step']} | {e['ne']:.4f} | {e['auc']:.4f} |"
            if high:
                row += (f" {e['ne_forwards_high']:.5f} | {100 * (e['ne'] / e['ne_forwards_high'] - 1):+.4f}% |"
                        if "ne_forwards_high" in e else " - | - |")
            lines.append(row)
        lines.append("")
    return lines


def _emulation(report: Mapping[str, Any]) -> list[str]:
    """Says where FP8 is emulated and what that makes of the speed-ups and the objective."""
    if report["emulated"]:
        return [
            f"> **FP8 is emulated on this run** (device {report['device']}): an FP8 GEMM here "
            "quantizes both operands, dequantizes them and multiplies in fp32. It reproduces "
            "the numerics of FP8 (the SQNR figures are real) but not its speed: the speed-ups "
            f"below are the GPU cost model's estimates (`dispatch.timing` = {report['timing']}) "
            "for the planned backend at these shapes, not measurements. The objective here is "
            f"`{report['objective']}`"
            + (
                " (`dispatch.cpu_objective`): every GEMM whose error fits its budget takes FP8 "
                "whatever its estimated speed, so that a CPU run exercises the numerics a GPU "
                "run would risk; a GPU run with the `speed` objective keeps slower GEMMs in "
                "high precision."
                if report["objective"] == "coverage"
                else "."
            ),
            "",
        ]
    if "emulated" in report["fp8_backends"]:
        return [
            "> Some FP8 GEMMs run on the `emulated` backend (quantize, dequantize, fp32 matmul): "
            "their numerics are FP8's, their speed is not.",
            "",
        ]
    return []


def _columns(report: Mapping[str, Any]) -> list[str]:
    cfg = report["probe"]["config"]
    q = float(cfg["quantile"])
    speed = (
        "measured on this device"
        if report["timing"] == "measure"
        else "the GPU cost model's estimate (not measured)"
    )
    return [
        "Columns:",
        "",
        "- **site**: the FP8-capable module, by its name in the model.",
        "- **GEMM**: `forward` (Y = X W^T), `grad_input` (dX = dY W), `grad_weight` (dW = dY^T X).",
        "- **M x K x N**: the GEMM's shape at the last interval, (M, K) x (N, K)^T.",
        "- **plan**: `high` (the training dtype) or `fp8:<format>[x<format of operand b>]/"
        "<scaling>@<backend>`.",
        f"- **SQNR p-lo (dB)**: the low quantile (p{100 * q:g}, `loka.probe.quantile` = {q:g}) "
        "of the SQNR of this GEMM's FP8 result against high precision over the Probe's window "
        f"(the last {cfg['window']} samples): 10 dB more is 10x less error power. Shown for "
        "FP8 GEMMs, for the plan's format and scaling.",
        f"- **budget (dB)**: the site's SQNR floor for this GEMM: FP8 is safe while SQNR p-lo "
        f"stays above it (and clears it by `loka.probe.margin_db` = {cfg['margin_db']:g} dB to "
        "become safe).",
        f"- **est. speed-up**: high-precision time / FP8 time of this GEMM, {speed}; below 1x "
        "FP8 is slower.",
        "- **why**: the reason of Dispatch's last decision for this GEMM.",
        "",
    ]


def _comm(comm: Mapping[str, Any]) -> list[str]:
    if "channels" not in comm:
        return ["Quantized communication is off (`loka.comm`).", ""]
    lines = [
        f"Collective backend: {comm['backend']}. Bytes are the payloads this rank (rank 0) handed "
        "to each collective; training and evaluation forwards are counted apart. The ladder is "
        "the precisions the policy may move the channel through (fixed: it keeps its precision).",
        "",
        "| channel | carries | precision now | ladder | training bytes | eval bytes | training bytes "
        "by precision | training calls by precision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in comm["channels"].items():
        by_bytes = ", ".join(f"{p} {_bytes(n)}" for p, n in c["bytes_by_precision"].items()) or "-"
        by_calls = ", ".join(f"{p} {n}" for p, n in c["calls_by_precision"].items()) or "-"
        ladder = " > ".join(c["policy_ladder"]) or "fixed"
        lines.append(
            f"| {name} | {COMM_CHANNELS.get(name, '')} | {c['precision']} | {ladder} | "
            f"{_bytes(c['total_bytes'])} | {_bytes(c['eval_bytes'])} | {by_bytes} | {by_calls} |"
        )
    lines += _table_or_none(
        "Precision switches (the policy moves a channel down or up its ladder):",
        ("step", "channel", "change", "reason"),
        [(s["step"], s["channel"], f"{s['old']} -> {s['new']}", s["reason"]) for s in comm["switches"]],
    )
    lines += _table_or_none(
        "Fallbacks (a precision requested but not available):",
        ("step", "channel", "requested", "used", "reason"),
        [(f["step"], f["channel"], f["requested"], f["used"], f["reason"]) for f in comm["fallbacks"]],
    )
    return [*lines, ""]


def _table_or_none(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """``title``, then a Markdown table of ``rows``, or "- none"."""
    out = ["", title, ""]
    if not rows:
        return [*out, "- none"]
    out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def markdown(report: dict[str, Any], history: Sequence[PlanChange]) -> str:
    """The report (from :func:`run_report`) and the plan history as Markdown."""
    num_gemms = sum(len(roles) for roles in report["sites"].values())
    num_fp8 = sum(e["plan"] != "high" for roles in report["sites"].values() for e in roles.values())
    lines = [
        "# LoKA run report",
        "",
        *_quality(report),
        f"**FP8**: {report['fp8_coverage']:.0%} of GEMMs ({num_fp8} of {num_gemms}, "
        f"{len(report['sites'])} sites); plan changes: {report['plan_changes']}; quality-guard "
        f"trips: {len(report['guard_trips'])}; objective `{report['objective']}`; GEMM times: "
        f"{report['timing_source']}.",
        "",
        *_emulation(report),
        "Plots: `sqnr_margin.png` (per site and GEMM, the SQNR margin over the budget at each "
        "interval, with a marker where the GEMM runs in FP8) and `plan_timeline.png` (GEMMs in "
        "FP8 per site at each interval).",
        "",
        "## GEMMs",
        "",
        *_columns(report),
        "| site | GEMM | M x K x N | plan | SQNR p-lo (dB) | budget (dB) | est. speed-up | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for site, roles in report["sites"].items():
        for role, e in roles.items():
            shape = "x".join(map(str, e["shape"])) if e["shape"] else "-"
            sq = f"{float(e['sqnr_lo_db']):.1f}" if "sqnr_lo_db" in e else "-"
            budget = f"{float(e['budget_db']):.1f}" if "budget_db" in e else "-"
            sp = f"{e['est_speedup']:.2f}x" if "est_speedup" in e else "-"
            lines.append(
                f"| {site} | {role} | {shape} | {e['plan']} | {sq} | {budget} | {sp} | {e['why']} |"
            )
    if report.get("static_scales"):
        lines += [
            "", "## Static scales", "",
            "`mods.static_scales`: the scale each operand's slot holds now (0: none yet), whether the "
            "operand runs tensor-wise FP8 under its current plan (only then is the slot used), and how "
            "many tensors the scale did not fit (recast with their dynamic scale).", "",
            "| site | operand | tensor-wise FP8 | scale | recasts |", "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['site']} | {r['operand']} | {'yes' if r['tensorwise'] else 'no'} | {r['scale']:.6g} | {r['recasts']} |"
            for r in report["static_scales"]
        ]
    lines += ["", "## Plan changes", ""]
    lines += [f"- {c}" for c in history] or ["- none"]
    lines += ["", "## Communication", "", *_comm(report["comm"])]
    lines += ["## Fallbacks", ""]
    lines += [f"- {f}" for f in report["fallbacks"]] or ["- none"]
    return "\n".join(lines) + "\n"


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Rows of the run summary's table for the LoKA figures in `summary` (none without them).

    Example:
        >>> summary_rows({"loka/fp8_coverage": 0.5, "loka/plan_changes": 3})
        [('LoKA FP8', '50% of GEMMs, 3 plan changes')]
    """
    rows = []
    if "loka/fp8_coverage" in summary:
        rows.append(("LoKA FP8", f"{summary['loka/fp8_coverage']:.0%} of GEMMs, "
                                 f"{summary['loka/plan_changes']} plan changes"))
    if "loka/report" in summary:
        rows.append(("LoKA report", str(summary["loka/report"])))
    return rows
