"""Multi-GPU integration (2 GPUs, nccl): sharded embeddings (table-wise, row-wise) + LoKA +
quantized comms. Both ranks hold identical plans at every interval; the loss tracks the
single-GPU run with the same global batch; a checkpoint taken on 2 GPUs resumes.

Run on the 2 x H200 machine: `pytest -m multigpu tests/gpu/test_multigpu.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "gpu" / "_multigpu_job.py")
STEPS, GLOBAL_BATCH = 60, 8192
# FP8 (emulated numerics differ from real kernels in rounding), FP8 all-to-all and a
# different summation order make the 2-GPU loss differ from 1 GPU; 2% relative on the mean
# of the last 10 steps is far below the loss's own movement over the run.
LOSS_RTOL = 0.02


def _torchrun(nproc: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", JOB, *args],
        env=env, capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def single_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("one")
    _torchrun(1, str(out), "table_wise", str(STEPS), str(GLOBAL_BATCH))
    return _load(out / "rank0_full.pt")


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_two_gpus_agree_and_track_one_gpu(sharding: str, single_gpu: dict, tmp_path: Path) -> None:
    _torchrun(2, str(tmp_path), sharding, str(STEPS), str(GLOBAL_BATCH))
    r0, r1 = _load(tmp_path / "rank0_full.pt"), _load(tmp_path / "rank1_full.pt")
    assert len(r0["plans"]) == STEPS // 20
    assert r0["plans"] == r1["plans"], "ranks hold different plans"
    two = sum(r0["losses"][-10:]) / 10
    one = sum(single_gpu["losses"][-10:]) / 10
    assert abs(two - one) / one < LOSS_RTOL, (two, one)
    print(f"{sharding}: 2-GPU loss {two:.5f} vs 1-GPU {one:.5f}; comm {r0['comm']}")


def test_checkpoint_on_two_gpus_resumes(tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    _torchrun(2, str(full), "row_wise", "40", str(GLOBAL_BATCH))
    _torchrun(2, str(part), "row_wise", "40", str(GLOBAL_BATCH), "20")
    _torchrun(2, str(part), "row_wise", "40", str(GLOBAL_BATCH))
    a, b = _load(full / "rank0_full.pt"), _load(part / "rank0_full.pt")
    assert b["plans"] == [p for p in a["plans"] if p[0] > 20]
    assert b["summary"]["steps"] == 40
    assert abs(a["summary"]["train/loss"] - b["summary"]["train/loss"]) < 1e-3 * a["summary"]["train/loss"]
