"""A resume that copies the checkpoint's tables into the run's shards by their offsets
(`checkpoint.load_by_copy`, what a 2D sparse run does with a fully sharded run's checkpoint)
continues exactly as the uninterrupted run, on 2 gloo processes: row-wise sharding (the second
rank's rows start at an offset) and table-wise (a rank reads only the tables it holds), with the
fused row-wise optimizer's state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loka_train.runtime import checkpoint
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, tiny_data, tiny_model, tiny_trainer


class _CopyingTrainer(Trainer):
    """Resumes by copy, as a 2D run does (2D itself needs CUDA)."""

    def _resumes_by_copy(self) -> bool:
        return True


def _run(rank: int, world_size: int, out: str, stop_after: int | None, by_copy: bool, sharding: str) -> None:
    calls: list[int] = []
    original = checkpoint.load_by_copy

    def counted(live, path):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(live, path)

    checkpoint.load_by_copy = counted  # the manager calls it through the module
    losses = LossRecorder()
    trainer = (_CopyingTrainer if by_copy else Trainer)(
        model=tiny_model("dlrm"),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), steps=8, sharding=sharding, dense_warmup_steps=3, lr_decay_start=3, lr_decay_steps=6,
            checkpoint_every=4, checkpoint_at_end=False, stop_after_step=stop_after, resume="auto",
        ),
        callbacks=[losses],
    )
    summary = trainer.fit()
    from loka_train.runtime.checkpoint import to_local

    torch.save({"summary": summary, "losses": losses.losses, "by_copy_loads": len(calls),
                "model": to_local(dict(trainer.state_dict()["model"]))}, Path(out) / f"final_{stop_after}_rank{rank}.pt")


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])  # table-wise: each rank reads only its tables
def test_resume_by_copy_matches_the_uninterrupted_run(tmp_path: Path, sharding: str) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_multiprocess(_run, world_size=2, args=(str(straight), None, False, sharding))
    run_multiprocess(_run, world_size=2, args=(str(resumed), 4, False, sharding))  # writes the step-4 checkpoint
    run_multiprocess(_run, world_size=2, args=(str(resumed), None, True, sharding))
    for rank in range(2):
        a = torch.load(straight / f"final_None_rank{rank}.pt", weights_only=False)
        b = torch.load(resumed / f"final_None_rank{rank}.pt", weights_only=False)
        assert b["by_copy_loads"] == 1  # the resume went through load_by_copy
        assert b["summary"]["steps"] == 8 and len(b["losses"]) == 4  # steps 5-8 after the resume
        assert b["losses"] == pytest.approx(a["losses"][4:], rel=1e-6)
        for key, va in a["model"].items():
            vb = b["model"][key]
            if isinstance(va, dict):  # local shards (none of a table another rank holds)
                assert len(va["__local_shards__"]) == len(vb["__local_shards__"]), key
                for sa, sb in zip(va["__local_shards__"], vb["__local_shards__"]):
                    torch.testing.assert_close(sa, sb, atol=1e-6, rtol=0, msg=key)
                continue
            torch.testing.assert_close(va, vb, atol=1e-6, rtol=0, msg=key)
