"""The LoKA run report: plain data, its files (JSON, Markdown, PNG plots), and summary rows.

:class:`~loka_train.plugin.callback.LokaCallback` builds the report from its Probe, Dispatcher
and comm state (:func:`run_report`) and writes it under ``<out_dir>/loka`` on rank 0
(:func:`write_report`); :func:`summary_rows` adds its figures to the run summary's table.

Example:
    >>> report = run_report(sites=cb.sites, probe=cb.probe, dispatcher=cb.dispatcher)
    >>> write_report(report, Path("runs/x/loka"), probe=cb.probe, history=cb.dispatcher.history,
    ...              timeline=cb.timeline, site_names=sorted(cb.sites))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loka_train.dispatch import Dispatcher, PlanChange
from loka_train.kernels.roles import ROLES
from loka_train.plugin.plots import Timeline, plot_probe_sqnr, plot_timeline
from loka_train.probe import Probe

logger = logging.getLogger(__name__)

__all__ = ["markdown", "plot_timeline", "run_report", "summary_rows", "write_report"]



def run_report(
    *,
    sites: Mapping[str, Any],
    probe: Probe,
    dispatcher: Dispatcher,
    comm_state: Any = None,
    compressors: Sequence[Any] = (),
    guard_trips: Sequence[dict[str, Any]] = (),
    fallbacks: Sequence[str] = (),
) -> dict[str, Any]:
    """The run report as plain data (rank-independent content).

    Args:
        sites: name -> FP8-capable site.
        probe: the Probe (verdicts, its own report).
        dispatcher: the Dispatcher (plans, shapes, reasons, history, timings).
        comm_state: the comm state when quantized comms are on.
        compressors: the dense-gradient hooks' compressors.
        guard_trips: the quality guard's trips.
        fallbacks: the loop's own fallbacks, listed after the plugin's.
    """
    d = dispatcher
    verdicts = probe.verdicts()
    site_rows = {}
    for name in sorted(sites):
        roles = {}
        for role in ROLES:
            plan = getattr(d.plans[name], role)
            shape = d.shapes[name].get(role)
            entry: dict[str, Any] = {"plan": str(plan), "shape": list(shape) if shape else None}
            if plan.is_fp8:
                v = verdicts.get((name, role, plan.fmt, plan.scaling))
                if v is not None:
                    entry["sqnr_lo_db"] = v.sqnr_lo_db
                    entry["verdict"] = v.reason
                if shape:
                    t_hi = d._estimate(role, shape, None)
                    entry["est_speedup"] = t_hi / d._estimate(role, shape, plan)
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
    listed += list(fallbacks)
    return {
        "fp8_coverage": d.fp8_coverage(),
        "timing": d.timing_mode,
        "plan_changes": d.num_changes,
        "guard_trips": list(guard_trips),
        "sites": site_rows,
        "probe": probe.report(),
        "comm": comm,
        "fallbacks": listed,
        "plan_export": d.export(),
    }


def write_report(
    report: dict[str, Any],
    out: Path,
    *,
    history: Sequence[PlanChange],
    timeline: Timeline,
    site_names: Sequence[str],
) -> list[str]:
    """Write ``loka_report.{json,md}``, ``sqnr.png`` and ``plan_timeline.png`` under `out`.

    Returns the fallbacks taken (plots skipped without matplotlib: logged).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "loka_report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "loka_report.md").write_text(markdown(report, history))
    try:
        plot_probe_sqnr(report["probe"], out / "sqnr.png")
        plot_timeline(site_names, timeline, out / "plan_timeline.png")
    except ImportError as exc:
        msg = f"report plots skipped: {exc} (pip install matplotlib)"
        logger.warning(msg)
        return [msg]
    return []


def markdown(report: dict[str, Any], history: Sequence[PlanChange]) -> str:
    """The report (from :func:`run_report`) and the plan history as Markdown."""
    lines = [
        "# LoKA run report",
        "",
        f"FP8 coverage: {report['fp8_coverage']:.0%} of GEMMs; plan changes: "
        f"{report['plan_changes']}; timing: {report['timing']}; quality-guard trips: "
        f"{len(report['guard_trips'])}",
        "",
        "| site | GEMM | M x K x N | plan | SQNR lo (dB) | est. speed-up | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for site, roles in report["sites"].items():
        for role, e in roles.items():
            shape = "x".join(map(str, e["shape"])) if e["shape"] else "-"
            sq = f"{e['sqnr_lo_db']:.1f}" if "sqnr_lo_db" in e else "-"
            sp = f"{e['est_speedup']:.2f}x" if "est_speedup" in e else "-"
            lines.append(f"| {site} | {role} | {shape} | {e['plan']} | {sq} | {sp} | {e['why']} |")
    lines += ["", "## Plan changes", ""]
    lines += [f"- {c}" for c in history] or ["- none"]
    lines += ["", "## Communication", "", "```", json.dumps(report["comm"], indent=2, default=str), "```"]
    lines += ["", "## Fallbacks", ""]
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
