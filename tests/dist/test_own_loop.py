"""The documented own-loop example runs with TrainPipelineSparseDist on 2 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.dist._multiprocess import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _main(rank: int, world_size: int, out: str) -> None:
    import own_loop

    summary = own_loop.main(steps=40, out_dir=out)
    torch.save(summary, Path(out) / f"summary{rank}.pt")


def test_own_loop_example(tmp_path: Path) -> None:
    run_multiprocess(_main, world_size=2, args=(str(tmp_path),))
    s0 = torch.load(tmp_path / "summary0.pt", weights_only=False)
    s1 = torch.load(tmp_path / "summary1.pt", weights_only=False)
    assert s0["loka/fp8_coverage"] == s1["loka/fp8_coverage"] > 0
    assert s0["loss_last"] < s0["loss_first"]
    assert (tmp_path / "loka" / "loka_report.json").exists()
