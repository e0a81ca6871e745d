"""Plots of the LoKA run report, written as PNG files.

Two figures, both one row per GEMM (or site) and one column per Probe interval, sized so that
every row keeps a readable label however many sites the model has:

* the SQNR margin heatmap (:func:`plot_sqnr_margin`): per site and GEMM role, the low quantile
  of the window's SQNR minus the site's budget, in dB, on a diverging colour map centred at
  0 dB (red: below the budget, blue: above it); a marker where the plan chosen at that interval
  runs the GEMM in FP8, its shape naming the scaling.
* the plan timeline (:func:`plot_timeline`): per site, how many of its three GEMMs run in FP8
  (0-3) at each interval, with a colour key.

The data each figure draws is computed first, by pure functions (:func:`margin_grid`,
:func:`fp8_counts`), and the figures are built without being saved (:func:`sqnr_margin_figure`,
:func:`timeline_figure`), so both can be checked without looking at pixels. matplotlib is
imported lazily (an ``ImportError`` names the missing package) and drawn on an Agg canvas, with
no global backend switch.

Example:
    >>> grid = margin_grid(report["probe"], report["timeline"], report["dispatch_candidates"])
    >>> plot_sqnr_margin(grid, "runs/latest/loka/sqnr_margin.png")  # doctest: +SKIP
    >>> plot_timeline(sorted(report["sites"]), report["timeline"], "runs/latest/loka/plan_timeline.png")  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loka_train.kernels.formats import Scaling
from loka_train.kernels.roles import ROLES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "MarginGrid",
    "Timeline",
    "fp8_counts",
    "margin_grid",
    "plot_sqnr_margin",
    "plot_timeline",
    "sqnr_margin_figure",
    "timeline_figure",
]

Timeline = Sequence[tuple[int, Mapping[str, str]]]
"""(step, site -> short plan) at every Probe interval: the plan chosen at that step, one entry
per role in ``ROLES`` order joined by ``/``, each ``hi`` (high precision) or the first three
letters of its FP8 scaling, e.g. ``"row/ten/hi"``."""

_SCALING_OF_SHORT = {s.value[:3]: s.value for s in Scaling}
_MARKERS = {"tensorwise": "s", "rowwise": "o", "block": "^", "mx": "D"}

# Layout, in inches and points: a row keeps its height whatever the number of rows.
_ROW_IN = 0.16
_FONT_PT = 6.5
_FOOTER_IN = 0.5
_TOP_TICKS_ROWS = 40
"""A plot of more rows has its step labels on top too (and a header taller by 0.2 in)."""
_COL_IN = 0.32
_MIN_PLOT_W_IN = 4.0
_MIN_FIG_W_IN = 7.5
_MAX_PLOT_W_IN = 12.0
_CHAR_IN = 0.55 * _FONT_PT / 72
"""Approximate width of one label character."""
_HALFRANGE_DB = (3.0, 40.0)
"""The colour scale spans +- the largest finite |margin|, clipped to this range."""


@dataclass(frozen=True)
class MarginGrid:
    """What the SQNR margin heatmap draws: one row per (site, role), one column per interval.

    Attributes:
        rows: ``(site, role)`` of each row, sites in order, each with its roles in ``ROLES``
            order.
        steps: the step (0-based) of each column: a Probe interval.
        margin_db: ``[row][column]``: the SQNR low quantile of the best candidate minus the
            site's budget for the role, in dB; NaN where nothing was measured.
        fp8_scaling: ``[row][column]``: the scaling of the FP8 plan chosen at that interval, or
            None where the GEMM runs in high precision (or no plan was recorded).
        quantile: the Probe's quantile (``loka.probe.quantile``).
    """

    rows: list[tuple[str, str]]
    steps: list[int]
    margin_db: list[list[float]]
    fp8_scaling: list[list[str | None]]
    quantile: float


def _as_float(v: Any) -> float:
    """A report value as a float (non-finite values are written as strings)."""
    return float(v)


def margin_grid(
    probe_report: Mapping[str, Any],
    timeline: Timeline,
    candidates: Mapping[str, Sequence[str]] | None = None,
) -> MarginGrid:
    """The data of the SQNR margin heatmap.

    Args:
        probe_report: :meth:`loka_train.probe.Probe.report` (its ``series``, ``sites`` and
            ``config``; non-finite values may be strings, as the report writes them).
        timeline: the plans chosen at each interval (:data:`Timeline`).
        candidates: role -> the Probe candidates (``e4m3_rowwise``, ...) Dispatch may plan for
            it; a row's margin is the best of these. None: every candidate the Probe measured.

    Returns:
        The :class:`MarginGrid`; its columns are the steps of the series and of the timeline.

    Example:
        >>> probe_report = {"config": {"quantile": 0.1},
        ...     "sites": {"mlp": {"sqnr_budget_db": {"forward": 18, "grad_input": 14, "grad_weight": 14}}},
        ...     "series": {"mlp/forward/e4m3_rowwise": [[49, 30.0]]}}
        >>> grid = margin_grid(probe_report, [(49, {"mlp": "row/hi/hi"})])
        >>> grid.margin_db[0], grid.fp8_scaling[0]
        ([12.0], ['rowwise'])
    """
    sites: Mapping[str, Mapping[str, Any]] = probe_report["sites"]
    series: Mapping[str, Sequence[Sequence[Any]]] = probe_report["series"]
    plans_at = {int(step): plans for step, plans in timeline}
    best: dict[tuple[str, str], dict[int, float]] = {}
    steps = set(plans_at)
    for key, pts in series.items():
        site, role, cand = key.rsplit("/", 2)
        if site not in sites or (candidates is not None and cand not in candidates.get(role, ())):
            continue
        budget = _as_float(sites[site]["sqnr_budget_db"][role])
        cells = best.setdefault((site, role), {})
        for step, value in pts:
            steps.add(int(step))
            margin = _as_float(value) - budget
            if math.isnan(margin):
                continue
            cells[int(step)] = max(cells.get(int(step), -math.inf), margin)
    columns = sorted(steps)
    rows = [(site, role) for site in sorted(sites) for role in ROLES]
    margins = [[best.get(row, {}).get(step, math.nan) for step in columns] for row in rows]
    scalings: list[list[str | None]] = []
    for site, role in rows:
        i = ROLES.index(role)
        line: list[str | None] = []
        for step in columns:
            short = plans_at.get(step, {}).get(site)
            part = short.split("/")[i] if short is not None else "hi"
            line.append(None if part == "hi" else _SCALING_OF_SHORT.get(part, part))
        scalings.append(line)
    return MarginGrid(
        rows=rows, steps=columns, margin_db=margins, fp8_scaling=scalings,
        quantile=float(probe_report["config"]["quantile"]),
    )


def fp8_counts(site_names: Sequence[str], timeline: Timeline) -> tuple[list[int], list[list[float]]]:
    """The data of the plan timeline: the steps, and per site and step the number of its GEMMs
    planned in FP8 (0-3; NaN where the site had no plan recorded).

    Example:
        >>> fp8_counts(["a"], [(49, {"a": "row/hi/ten"})])
        ([49], [[2.0]])
    """
    steps = [int(step) for step, _ in timeline]
    counts = [
        [
            float(sum(part != "hi" for part in plans[name].split("/"))) if name in plans else math.nan
            for _, plans in timeline
        ]
        for name in site_names
    ]
    return steps, counts


# ---------------------------------------------------------------------------------- drawing
def _figure(
    num_rows: int, num_cols: int, label_in: float, header_in: float
) -> tuple[Figure, Axes, Axes]:
    """A figure with a heatmap axes (``num_rows`` rows of fixed height, labels of ``label_in``
    inches on its left) under a header of ``header_in`` inches holding the title and a
    horizontal colour-bar axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plot_w = min(max(_COL_IN * num_cols, _MIN_PLOT_W_IN), _MAX_PLOT_W_IN)
    left = label_in + 0.15
    width = max(left + plot_w + 0.3, _MIN_FIG_W_IN)
    plot_h = _ROW_IN * max(num_rows, 1)
    header_in += 0.2 if num_rows > _TOP_TICKS_ROWS else 0.0
    height = header_in + plot_h + _FOOTER_IN
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((left / width, _FOOTER_IN / height, plot_w / width, plot_h / height))
    cax = fig.add_axes((0.15 / width, (height - 0.55) / height, 3.5 / width, 0.11 / height))
    return fig, ax, cax


def _title(fig: Figure, text: str) -> None:
    """The figure's title, at its top left."""
    fig.suptitle(
        text, x=0.1 / fig.get_figwidth(), y=1 - 0.06 / fig.get_figheight(), ha="left", va="top",
        fontsize=_FONT_PT + 2.5,
    )


def _cells(values: Sequence[Sequence[float]], num_rows: int, num_cols: int) -> Any:
    """``values`` as a masked (rows x columns) array; one empty column before any interval."""
    import numpy as np

    data = np.array(values, dtype=float).reshape(num_rows, num_cols)
    if num_cols == 0:
        data = np.full((num_rows, 1), np.nan)
    return np.ma.masked_invalid(data)


def _step_ticks(ax: Axes, steps: Sequence[int], num_rows: int) -> None:
    """Columns labelled by their step (at most about 20 labels), on top as well for tall plots."""
    stride = max(1, math.ceil(len(steps) / 20))
    idx = list(range(0, len(steps), stride))
    if steps:
        ax.set_xticks(idx, [str(steps[i]) for i in idx], fontsize=_FONT_PT)
    else:
        ax.set_xticks([0], ["no interval has ended yet"], fontsize=_FONT_PT)
    ax.set_xlabel("step (0-based) at the end of the Probe interval", fontsize=_FONT_PT + 0.5)
    if num_rows > _TOP_TICKS_ROWS:
        ax.tick_params(axis="x", labeltop=True, top=True)


def sqnr_margin_figure(grid: MarginGrid) -> Figure:
    """The SQNR margin heatmap of `grid`, as a matplotlib Figure on an Agg canvas.

    The image's array is ``grid.margin_db`` (rows x columns); each row's label names its role,
    each site's name stands beside its first row; markers are the FP8 plans.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib
    import numpy as np
    from matplotlib.colors import CenteredNorm
    from matplotlib.lines import Line2D

    num_rows, num_cols = len(grid.rows), len(grid.steps)
    sites = list(dict.fromkeys(site for site, _ in grid.rows))
    role_w = max(len(r) for r in ROLES) * _CHAR_IN
    site_w = max((len(s) for s in sites), default=0) * _CHAR_IN
    fig, ax, cax = _figure(num_rows, num_cols, role_w + site_w + 0.2, header_in=1.25)

    data = _cells(grid.margin_db, num_rows, num_cols)
    finite = np.abs(data.compressed())
    lo, hi = _HALFRANGE_DB
    halfrange = float(min(max(finite.max() if finite.size else lo, lo), hi))
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="#d0d0d0")
    image = ax.imshow(
        data, aspect="auto", interpolation="nearest", cmap=cmap,
        norm=CenteredNorm(vcenter=0.0, halfrange=halfrange),
    )
    cbar = fig.colorbar(image, cax=cax, orientation="horizontal", extend="both")
    cbar.set_label(
        f"SQNR margin over the budget (dB): p{100 * grid.quantile:g} of the window's SQNR of the "
        "best FP8 scaling\nminus the site's budget for the GEMM; red: below the budget (unsafe), "
        "blue: above it",
        fontsize=_FONT_PT + 0.5, loc="left",
    )
    cbar.ax.tick_params(labelsize=_FONT_PT)

    # FP8 plans: one marker per cell, its shape naming the scaling, sized to the cell.
    cell_pt = min(_ROW_IN, ax.get_position().width * fig.get_figwidth() / max(num_cols, 1)) * 72
    size = (0.55 * cell_pt) ** 2
    used: list[str] = []
    for scaling in sorted({s for line in grid.fp8_scaling for s in line if s is not None}):
        cells = [
            (c, r) for r, line in enumerate(grid.fp8_scaling) for c, s in enumerate(line) if s == scaling
        ]
        ax.scatter(
            [c for c, _ in cells], [r for _, r in cells], s=size, marker=_MARKERS.get(scaling, "X"),
            facecolors="white", edgecolors="black", linewidths=0.5,
        )
        used.append(scaling)
    handles = [
        Line2D([], [], linestyle="", marker=_MARKERS.get(s, "X"), markerfacecolor="white",
               markeredgecolor="black", markeredgewidth=0.5, markersize=5, label=f"FP8 {s}")
        for s in used
    ]
    handles.append(Line2D([], [], linestyle="", marker="s", markerfacecolor="#d0d0d0",
                          markeredgecolor="none", markersize=6, label="not measured"))
    fig.legend(
        handles=handles, loc="upper left", frameon=False, fontsize=_FONT_PT, ncol=len(handles),
        bbox_to_anchor=(4.0 / fig.get_figwidth(), 1 - 0.3 / fig.get_figheight()),
        title="plan chosen at the interval\n(no marker: high precision)", title_fontsize=_FONT_PT,
        alignment="left",
    )
    _title(fig, "FP8 error per site and GEMM: SQNR margin over the budget, and where FP8 runs")

    ax.set_yticks(range(num_rows), [role for _, role in grid.rows], fontsize=_FONT_PT)
    for i, site in enumerate(sites):
        ax.annotate(
            site, xy=(0, i * len(ROLES)), xycoords=("axes fraction", "data"),
            xytext=(-(role_w * 72 + 8), 0), textcoords="offset points", ha="right", va="center",
            fontsize=_FONT_PT, fontweight="bold",
        )
        if i:
            ax.axhline(i * len(ROLES) - 0.5, color="black", linewidth=0.6)
    ax.set_xlim(-0.5, max(num_cols, 1) - 0.5)
    ax.set_ylim(num_rows - 0.5, -0.5)
    _step_ticks(ax, grid.steps, num_rows)
    return fig


def plot_sqnr_margin(grid: MarginGrid, path: str | Path) -> Path:
    """Write :func:`sqnr_margin_figure` of `grid` as a PNG at `path` (parents created).

    Raises:
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    fig = sqnr_margin_figure(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path


def timeline_figure(site_names: Sequence[str], timeline: Timeline) -> Figure:
    """The plan timeline as a matplotlib Figure on an Agg canvas: per site (rows, in the order
    given) the number of its GEMMs in FP8 at each interval, with a colour key naming 0-3.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    names = list(site_names)
    steps, counts = fp8_counts(names, timeline)
    label_w = max((len(n) for n in names), default=0) * _CHAR_IN
    fig, ax, cax = _figure(len(names), len(steps), label_w, header_in=1.05)
    cmap = ListedColormap(["#e8e8e8", "#fdd0a2", "#fd8d3c", "#a63603"]).with_extremes(bad="white")
    image = ax.imshow(
        _cells(counts, len(names), len(steps)), aspect="auto", interpolation="nearest", cmap=cmap,
        norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5, 3.5], cmap.N),
    )
    cbar = fig.colorbar(image, cax=cax, orientation="horizontal", ticks=[0, 1, 2, 3])
    cbar.ax.set_xticklabels(["0: all high", "1", "2", "3: all FP8"], fontsize=_FONT_PT)
    cbar.set_label(
        "GEMMs of the site in FP8 (of its forward, grad_input, grad_weight)",
        fontsize=_FONT_PT + 0.5, loc="left",
    )
    _title(fig, "Plan timeline: GEMMs in FP8 per site, as planned at each interval")
    ax.set_yticks(range(len(names)), names, fontsize=_FONT_PT)
    ax.set_xticks(np.arange(-0.5, max(len(steps), 1)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(names)), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    _step_ticks(ax, steps, len(names))
    return fig


def plot_timeline(site_names: Sequence[str], timeline: Timeline, path: str | Path) -> Path:
    """Write :func:`timeline_figure` as a PNG at `path` (parents created).

    Raises:
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    fig = timeline_figure(site_names, timeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path
