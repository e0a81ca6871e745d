"""The run report and its plots (``loka_train.plugin.report``, ``loka_train.plugin.plots``).

The plots are checked through the data they hand to matplotlib (the image arrays, tick labels,
markers), not through pixels: the SQNR margin heatmap has one row per site and GEMM role, also
at 100 sites, centred at 0 dB; the timeline has one row per site and a colour key. The Markdown
explains its columns, says FP8 is emulated on CPU, shows the communication as a table and the
run's NE/AUC.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from loka_train.comm import CommConfig, CommState
from loka_train.kernels.roles import ROLES
from loka_train.mods.config import ModsConfig
from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import LokaConfig
from loka_train.plugin.plots import (
    fp8_counts,
    margin_grid,
    plot_sqnr_margin,
    plot_timeline,
    sqnr_margin_figure,
    timeline_figure,
)
from loka_train.plugin.report import markdown, write_report
from loka_train.probe.config import ProbeConfig
from loka_train.runtime.context import RunContext

pytest.importorskip("matplotlib")

CANDIDATES = ("e4m3_tensorwise", "e4m3_rowwise", "e5m2_tensorwise", "e5m2_rowwise")
DISPATCH_CANDIDATES = {
    "forward": ["e4m3_tensorwise", "e4m3_rowwise"],
    "grad_input": ["e5m2_tensorwise", "e5m2_rowwise"],
    "grad_weight": ["e5m2_tensorwise", "e5m2_rowwise"],
}
BUDGETS = {"forward": 18.0, "grad_input": 14.0, "grad_weight": 14.0}


def _synthetic(num_sites: int = 100, num_intervals: int = 8) -> tuple[dict[str, Any], list, list[str]]:
    """A probe report (as JSON writes it: the first interval unmeasured, ``"nan"``) and a plan
    timeline for ``num_sites`` sites: every third GEMM in high precision, the rest row-wise or
    tensor-wise."""
    rng = random.Random(0)
    sites = [f"model.tower.{i // 10}.block.{i % 10}.linear" for i in range(num_sites)]
    steps = [50 * (k + 1) - 1 for k in range(num_intervals)]
    series = {
        f"{site}/{role}/{cand}": [[s, "nan" if k == 0 else rng.uniform(0.0, 40.0)] for k, s in enumerate(steps)]
        for site in sites for role in ROLES for cand in CANDIDATES
    }
    timeline = [
        (s, {
            site: "/".join(
                "hi" if (i + j + k) % 3 == 0 else ("row" if (i + k) % 2 else "ten") for j in range(len(ROLES))
            )
            for i, site in enumerate(sites)
        })
        for k, s in enumerate(steps)
    ]
    probe_report = {
        "config": {"quantile": 0.1},
        "sites": {site: {"sqnr_budget_db": BUDGETS} for site in sites},
        "series": series,
    }
    return probe_report, timeline, sites


# ------------------------------------------------------------------------------ the data
def test_margin_grid_has_one_row_per_site_and_role_with_the_best_dispatch_candidate() -> None:
    probe_report, timeline, sites = _synthetic()
    grid = margin_grid(probe_report, timeline, DISPATCH_CANDIDATES)
    assert len(grid.rows) == 300 == len(grid.margin_db) == len(grid.fp8_scaling)
    assert grid.rows[:3] == [(sites[0], role) for role in ROLES]
    assert grid.steps == [s for s, _ in timeline]
    assert all(len(line) == len(grid.steps) for line in grid.margin_db + grid.fp8_scaling)  # type: ignore[operator]
    # The first interval was not measured; later cells are the best of the role's candidates
    # (e4m3 for the forward GEMM: the e5m2 series are the Probe's, not Dispatch's).
    assert all(math.isnan(line[0]) for line in grid.margin_db)
    site, role = grid.rows[0]
    want = max(float(probe_report["series"][f"{site}/{role}/{c}"][3][1]) for c in DISPATCH_CANDIDATES[role])
    assert grid.margin_db[0][3] == pytest.approx(want - BUDGETS[role])
    # The scaling of the plan chosen at the interval; None in high precision.
    short = timeline[3][1][site].split("/")[0]
    assert grid.fp8_scaling[0][3] == {"hi": None, "row": "rowwise", "ten": "tensorwise"}[short]


def test_margin_grid_takes_every_candidate_without_dispatch_candidates() -> None:
    probe_report, timeline, _ = _synthetic(num_sites=2)
    grid = margin_grid(probe_report, timeline)
    site, role = grid.rows[0]
    want = max(float(probe_report["series"][f"{site}/{role}/{c}"][1][1]) for c in CANDIDATES)
    assert grid.margin_db[0][1] == pytest.approx(want - BUDGETS[role])


def test_fp8_counts_per_site_and_interval() -> None:
    steps, counts = fp8_counts(["a", "b"], [(49, {"a": "row/hi/ten", "b": "hi/hi/hi"}), (99, {"a": "row/row/row"})])
    assert steps == [49, 99]
    assert counts[0] == [2.0, 3.0]
    assert counts[1][0] == 0.0 and math.isnan(counts[1][1])


# --------------------------------------------------------------------------- the figures
def test_margin_heatmap_of_100_sites_draws_300_rows_centred_at_0_db(tmp_path: Path) -> None:
    probe_report, timeline, _ = _synthetic()
    grid = margin_grid(probe_report, timeline, DISPATCH_CANDIDATES)
    fig = sqnr_margin_figure(grid)
    ax = fig.axes[0]
    (image,) = ax.images
    assert image.get_array().shape == (300, len(grid.steps))
    assert image.norm.vcenter == 0.0
    assert image.get_cmap().name.startswith("RdBu")  # diverging: red below the budget
    assert len(ax.get_yticklabels()) == 300
    assert [t.get_text() for t in ax.get_yticklabels()[:3]] == list(ROLES)
    # Each site's name stands beside its first row.
    assert [t.get_text() for t in ax.texts][:2] == ["model.tower.0.block.0.linear", "model.tower.0.block.1.linear"]
    # One marker per FP8 cell, its shape by scaling.
    num_fp8 = sum(s is not None for line in grid.fp8_scaling for s in line)
    assert sum(len(c.get_offsets()) for c in ax.collections) == num_fp8 > 0
    colorbar_ax = fig.axes[1]
    assert "dB" in colorbar_ax.get_xlabel() and "budget" in colorbar_ax.get_xlabel()
    # The figure grows with the rows: a row keeps its height.
    small = sqnr_margin_figure(margin_grid(*_synthetic(num_sites=10)[:2], DISPATCH_CANDIDATES))
    assert fig.get_figheight() - small.get_figheight() == pytest.approx(270 * 0.16 + 0.2)
    png = plot_sqnr_margin(grid, tmp_path / "sqnr_margin.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_of_100_sites_has_a_row_per_site_and_a_colour_key(tmp_path: Path) -> None:
    _, timeline, sites = _synthetic()
    fig = timeline_figure(sites, timeline)
    ax, colorbar_ax = fig.axes[0], fig.axes[1]
    (image,) = ax.images
    assert image.get_array().shape == (100, len(timeline))
    assert [t.get_text() for t in ax.get_yticklabels()] == sites
    assert [t.get_text() for t in colorbar_ax.get_xticklabels()] == ["0: all high", "1", "2", "3: all FP8"]
    assert "FP8" in colorbar_ax.get_xlabel()
    png = plot_timeline(sites, timeline, tmp_path / "plan_timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- the report
def _report(tmp_path: Path) -> tuple[LokaCallback, RunContext, dict[str, Any]]:
    """The report of a small model on CPU after two evaluations, with a comm section."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path)
    cb = LokaCallback(LokaConfig(
        enabled=True, probe=ProbeConfig(every_k_steps=1, interval=50, window=4),
        mods=ModsConfig(enabled=True),
    ))
    cb.on_before_shard(ctx)
    cb.on_train_start(ctx)
    cb.on_eval_end(ctx, 99, {"eval/ne": 0.81234, "eval/auc": 0.75})
    cb.on_eval_end(ctx, 199, {"eval/ne": 0.74021, "eval/auc": 0.83917})
    report = cb.report(ctx)
    comm = CommState(CommConfig(), backend="gloo", device="cpu").report()
    comm["switches"] = [
        {"step": 149, "channel": "a2a_fwd", "old": "FP32", "new": "FP8", "reason": "FP8 at 32.7dB >= 25.0dB"}
    ]
    report["comm"] = comm
    return cb, ctx, report


def test_markdown_says_fp8_is_emulated_on_cpu_and_explains_its_columns(tmp_path: Path) -> None:
    cb, _, report = _report(tmp_path)
    assert report["emulated"] and report["device"] == "cpu"
    md = markdown(report, cb.dispatcher.history)  # type: ignore[union-attr]
    assert "FP8 is emulated on this run" in md
    assert "not measurements" in md
    header = next(line for line in md.splitlines() if line.startswith("| site |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["site", "GEMM", "M x K x N", "plan", "SQNR p-lo (dB)", "budget (dB)", "est. speed-up", "why"]
    for column in columns:
        assert f"- **{column}**:" in md, column
    assert "the low quantile (p10, `loka.probe.quantile` = 0.1) of the SQNR" in md


def test_markdown_shows_the_runs_ne_and_auc(tmp_path: Path) -> None:
    cb, _, report = _report(tmp_path)
    assert [e["step"] for e in report["evals"]] == [99, 199]
    md = markdown(report, cb.dispatcher.history)  # type: ignore[union-attr]
    assert "eval NE 0.7402, AUC 0.8392 at step 199" in md
    assert "| 99 | 0.8123 | 0.7500 |" in md
    # The evaluations are part of the callback's checkpointed state.
    again = LokaCallback(cb.config)
    again.load_state_dict(cb.state_dict())
    assert again.evals == cb.evals


def test_markdown_comm_section_is_a_table(tmp_path: Path) -> None:
    cb, _, report = _report(tmp_path)
    md = markdown(report, cb.dispatcher.history)  # type: ignore[union-attr]
    comm = md.split("## Communication", 1)[1].split("## Fallbacks", 1)[0]
    assert "{" not in comm and "```" not in comm
    rows = [line for line in comm.splitlines() if line.startswith("| a2a_fwd |")]
    assert len(rows) == 1 and "embedding all-to-all, forward" in rows[0]
    assert "| 149 | a2a_fwd | FP32 -> FP8 | FP8 at 32.7dB >= 25.0dB |" in comm
    report["comm"] = {"enabled": False}
    assert "Quantized communication is off" in markdown(report, [])


def test_write_report_writes_json_markdown_and_both_plots(tmp_path: Path) -> None:
    cb, ctx, _ = _report(tmp_path)
    out = cb.write_report(ctx)
    assert out == tmp_path / "loka"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["loka_report.json", "loka_report.md", "plan_timeline.png", "sqnr_margin.png"]
    data = json.loads((out / "loka_report.json").read_text())
    assert data["dispatch_candidates"]["forward"] == ["e4m3_rowwise"]
    assert write_report(data, tmp_path / "again", history=[]) == []
