"""bench.comm --merge: the NE seeds of separate runs joined into one table, each seed's delta
paired with the FP32 continuation of its own run (runs may start from different base
checkpoints), and runs that cannot be joined refused."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench import comm


def _run(folder: Path, base_ne: float, seeds: dict[int, tuple[float, float]]) -> Path:
    """A folder as an ``--ne-from`` run leaves it: per seed, (FP32 NE, FP8 NE)."""
    folder.mkdir(parents=True)
    rows = [{"precision": prec, "samples_per_s": 1000.0 * (i + 1), "gpu": "G", "torch": "T",
             "ne_by_seed": [{"seed": s, "eval_ne": ne[i]} for s, ne in seeds.items()]}
            for i, prec in enumerate(("fp32", "fp8"))]
    (folder / "comm.json").write_text(json.dumps(rows))
    (folder / "ne_base.json").write_text(json.dumps({"eval_ne": base_ne, "steps": 200}))
    return folder


def test_merge_pairs_each_seed_with_its_own_runs_fp32(tmp_path: Path) -> None:
    # The two runs' FP32 continuations differ (different base checkpoints): a seed paired with
    # the other run's FP32 would give other deltas.
    a = _run(tmp_path / "a", 0.60, {0: (0.50, 0.501), 1: (0.52, 0.519)})
    b = _run(tmp_path / "b", 0.61, {2: (0.55, 0.5511), 3: (0.40, 0.40)})
    assert comm.main(["--out", str(tmp_path / "m"), "--merge", str(a), str(b)]) == 0
    rows = json.loads((tmp_path / "m" / "comm.json").read_text())
    fp8 = next(r for r in rows if r["precision"] == "fp8")
    want = [0.501 / 0.50 - 1, 0.519 / 0.52 - 1, 0.5511 / 0.55 - 1, 0.0]
    assert [c["seed"] for c in fp8["ne_by_seed"]] == [0, 1, 2, 3]
    assert [c["ne_delta_vs_fp32"] for c in fp8["ne_by_seed"]] == pytest.approx(want)
    assert fp8["ne_delta_vs_fp32_mean"] == pytest.approx(statistics.fmean(want))
    assert fp8["ne_delta_vs_fp32_stderr"] == pytest.approx(statistics.stdev(want) / math.sqrt(4))
    assert fp8["samples_per_s"] == 2000.0  # the first folder's throughput
    md = (tmp_path / "m" / "comm.md").read_text()
    assert "| fp8 | 2000 |" in md and "seeds [2, 3]" in md


def test_merge_refuses_repeated_seeds_and_runs_without_ne(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", 0.6, {0: (0.5, 0.5)})
    b = _run(tmp_path / "b", 0.6, {0: (0.5, 0.5)})
    with pytest.raises(SystemExit, match="--first-seed"):
        comm.main(["--out", str(tmp_path / "m"), "--merge", str(a), str(b)])
    c = tmp_path / "c"
    c.mkdir()
    (c / "comm.json").write_text(json.dumps([{"precision": "fp32"}]))
    (c / "ne_base.json").write_text("{}")
    with pytest.raises(SystemExit, match="--ne-from"):
        comm.main(["--out", str(tmp_path / "m"), "--merge", str(a), str(c)])


def test_merge_refuses_folders_of_other_precisions(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", 0.6, {0: (0.5, 0.5)})
    b = _run(tmp_path / "b", 0.6, {1: (0.5, 0.5)})
    rows = json.loads((b / "comm.json").read_text())
    rows.append({**rows[1], "precision": "bf16"})  # a precision the first folder did not run
    (b / "comm.json").write_text(json.dumps(rows))
    with pytest.raises(SystemExit, match="different precisions"):
        comm.main(["--out", str(tmp_path / "m"), "--merge", str(a), str(b)])
