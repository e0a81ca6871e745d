"""Plots of the LoKA run report, written as PNG files.

matplotlib is imported lazily (an ``ImportError`` names the missing package) and drawn on an
Agg canvas, with no global backend switch.

Example:
    >>> from loka_train.probe import Probe, ProbeConfig
    >>> probe = Probe(ProbeConfig())
    >>> plot_probe_sqnr(probe.report(), "/tmp/sqnr.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loka_train.kernels.roles import ROLES

__all__ = ["Timeline", "plot_probe_sqnr", "plot_timeline"]

Timeline = Sequence[tuple[int, Mapping[str, str]]]
"""(step, site -> short plan such as ``"row/row/hi"``) at every Probe interval."""


def plot_probe_sqnr(probe_report: Mapping[str, Any], path: str | Path) -> Path:
    """Write a PNG of the SQNR low quantile per site and candidate over steps, one panel per
    GEMM role, with each site's budget dashed.

    Args:
        probe_report: :meth:`loka_train.probe.Probe.report` (its ``series``, ``sites`` and
            ``config``; non-finite values may be strings, as the report writes them).
        path: the PNG to write; its parent directories are created.

    Returns:
        ``path``, as a :class:`~pathlib.Path`.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    series: Mapping[str, list[list[Any]]] = probe_report["series"]
    sites: Mapping[str, Mapping[str, Any]] = probe_report["sites"]
    quantile = float(probe_report["config"]["quantile"])
    fig = Figure(figsize=(10, 3.2 * len(ROLES)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ROLES), 1, sharex=True, squeeze=False)[:, 0]
    for ax, role in zip(axes, ROLES, strict=True):
        for key, pts in series.items():
            site, key_role, cand = key.rsplit("/", 2)
            if key_role != role or not pts:
                continue
            steps = [int(p[0]) for p in pts]
            vals = [float(p[1]) for p in pts]
            ax.plot(steps, vals, marker=".", label=f"{site} {cand}")
        budgets = sorted({float(s["sqnr_budget_db"][role]) for s in sites.values()})
        for b in budgets:
            ax.axhline(b, linestyle="--", color="gray", linewidth=0.8)
        ax.set_title(f"{role}: SQNR p{100 * quantile:g} over the window")
        ax.set_ylabel("dB")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_timeline(site_names: Sequence[str], timeline: Timeline, path: Path) -> None:
    """GEMMs in FP8 per site (0-3) at each interval, as a PNG at `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(site_names)
    fig, ax = plt.subplots(figsize=(10, 0.35 * max(len(names), 4) + 1.5))
    for i, name in enumerate(names):
        xs = [step for step, _ in timeline]
        fp8 = [plans[name].count("hi") for _, plans in timeline]
        ax.scatter(xs, [i] * len(xs), c=[3 - f for f in fp8], cmap="viridis", vmin=0, vmax=3, s=25)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("GEMMs in FP8 per site (0-3) at each interval")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
