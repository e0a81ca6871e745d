"""bench.inference's dry run on the CPU: a short LoKA run trained, its checkpoint served as each
variant, timed per batch size and evaluated on the same held-out batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.inference import main, parse_args


def test_the_dry_run_serves_each_variant_of_one_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "inf"
    assert main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16,32", "--train-steps", "8",
                 "--warmup", "1", "--iters", "3", "--eval-batches", "2", "--variants", "bf16,loka,torchao+compile",
                 "--out", str(out)]) == 0
    result = json.loads((out / "inference.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    for name in ("bf16", "loka"):
        r = rows[name]
        assert r["status"] == "ok" and 0 < r["ne"] < 2 and 0 <= r["auc"] <= 1
        assert all(r[f"b{b}"]["samples_per_s"] > 0 and r[f"b{b}"]["p99_ms"] >= r[f"b{b}"]["p50_ms"] for b in (16, 32))
    # Both read the same checkpoint and the same held-out batches.
    assert rows["loka"]["ne"] == pytest.approx(rows["bf16"]["ne"], rel=0.05)
    assert rows["torchao+compile"]["status"] == "ok" or rows["torchao+compile"]["status"].startswith("not run")
    md = (out / "inference.md").read_text()
    assert "| dlrm | loka |" in md and "samples/s" in md


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(SystemExit, match="unknown"):
        parse_args(["--out", "x", "--variants", "fp4"])
    with pytest.raises(SystemExit, match="--configs: unknown"):
        parse_args(["--out", "x", "--configs", "resnet"])
