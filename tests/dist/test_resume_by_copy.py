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


def _dtensor_leaves(rank: int, world_size: int, root: str) -> dict[str, bool]:
    """A checkpoint of row-wise ShardedTensors (what plain DMP saves) loaded by copy into the
    leaves 2D sparse parallelism has: DTensors over a (replicas, shards) mesh whose local tensor
    is TorchRec's LocalShardsWrapper (every rank holding the whole table, or none of it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard
    from torchrec.distributed.shards_wrapper import LocalShardsWrapper

    rows, dim = 6, 4
    table = torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim)
    momentum = torch.arange(rows, dtype=torch.float32) + 100
    r = rows // world_size
    weight_st = init_from_local_shards(
        [Shard(table[rank * r:(rank + 1) * r].clone(), ShardMetadata([rank * r, 0], [r, dim], f"rank:{rank}/cpu"))],
        rows, dim)
    momentum_st = init_from_local_shards(
        [Shard(momentum[rank * r:(rank + 1) * r].clone(), ShardMetadata([rank * r], [r], f"rank:{rank}/cpu"))], rows)
    saved = {"model": {"t": weight_st, "u": weight_st, "dense": torch.full((3,), 7.0)},
             "optimizer": {"state": {"t": {"momentum1": momentum_st}, "dense": {"step": torch.tensor(5.0)}},
                           "param_groups": [{"params": ["t"], "lr": 0.5}]}}
    dcp.save(saved, checkpoint_id=root)
    torch.distributed.barrier()

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))

    def wrapped(local: list[torch.Tensor], offsets: list[tuple[int, ...]], shape: tuple[int, ...]) -> DTensor:
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        return DTensor.from_local(LocalShardsWrapper(local, offsets), device_mesh=mesh,
                                  placements=(Replicate(), DShard(0)), shape=torch.Size(shape), stride=stride,
                                  run_check=False)

    weight, mom, dense, step = torch.zeros(rows, dim), torch.zeros(rows), torch.zeros(3), torch.tensor(0.0)
    live = {"model": {"t": wrapped([weight], [(0, 0)], (rows, dim)),
                      "u": wrapped([], [], (rows, dim)),  # a table this rank does not hold
                      "dense": dense},
            "optimizer": {"state": {"t": {"momentum1": wrapped([mom], [(0,)], (rows,))}, "dense": {"step": step}},
                          "param_groups": [{"params": ["t"], "lr": 0.1}]}}
    out = checkpoint.load_by_copy(live, Path(root))
    return {
        "weight": torch.equal(weight, table), "momentum": torch.equal(mom, momentum),
        "dense": torch.equal(dense, torch.full((3,), 7.0)), "step": float(step) == 5.0,
        "lr": out["optimizer"]["param_groups"][0]["lr"] == 0.5,
        "live_leaf": out["optimizer"]["state"]["t"]["momentum1"] is live["optimizer"]["state"]["t"]["momentum1"],
    }


def test_load_by_copy_fills_2d_leaves_from_a_row_wise_checkpoint(tmp_path: Path) -> None:
    for result in run_multiprocess(_dtensor_leaves, world_size=2, args=(str(tmp_path),)):
        assert all(result.values()), result
