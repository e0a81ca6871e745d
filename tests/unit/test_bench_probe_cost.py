"""bench.probe_cost on the CPU: the plumbing (every role, eager and as captured, into the JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.probe_cost import main


def test_probe_cost_writes_every_role_eager_and_graphed(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert main(["--device", "cpu", "--shape", "64,32,16", "--iters", "1", "--warmup", "1", "--graphed",
                 "--preset", "safe", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == [64, 32, 16] and result["candidates"] and result["max_cols"] == 1024
    roles = ("forward", "grad_input", "grad_weight")
    assert sorted(result["roles"]) == sorted([*roles, *(f"{r} (graphed)" for r in roles)])
    # Dozens of operators per sample at least (statistics, two candidates' quantization, GEMMs).
    assert all(r["aten_ops"] > 50 for r in result["roles"].values())


def test_probe_cost_takes_max_cols(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert main(["--device", "cpu", "--shape", "64,32,16", "--iters", "1", "--warmup", "1", "--max-cols", "none",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["max_cols"] is None


def test_probe_cost_times_a_sites_roles_with_and_without_shared_full_reads(tmp_path: Path) -> None:
    """The site's three roles in a row: with the grad-weight taking over the forward's and the
    grad-input's full reads it dispatches fewer operators than with every role reading its own."""
    out = tmp_path / "cost.json"
    assert main(["--device", "cpu", "--shape", "64,32,16", "--iters", "1", "--warmup", "1", "--preset", "safe",
                 "--out", str(out)]) == 0
    site = json.loads(out.read_text())["site"]
    shared, own = site["site, full reads shared"], site["site, full reads not shared"]
    assert 0 < shared["aten_ops_not_views"] < own["aten_ops_not_views"]
