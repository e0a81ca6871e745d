"""The sharded DLRM on 2 gloo ranks trains like the unsharded model in 1 process, and a
killed run resumed from its checkpoint ends where an uninterrupted one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, dense_params, tiny_data, tiny_model, tiny_trainer

# Why not bit-exact: with 2 ranks each embedding gradient is the SUM of two per-rank means
# (TorchRec does not average sparse gradients) while one process takes one mean over the
# global batch, so sparse gradients differ by exactly 2x. Row-wise Adagrad normalises the
# step by the accumulated gradient norm, so the update matches up to eps and summation order.
# Column-wise sharding gives each column shard its own row-wise accumulator, a different
# optimizer than one accumulator per whole row, so that case (and its reference) uses
# element-wise Adagrad, which any column split leaves unchanged.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


def _sparse_optimizer(sharding: str) -> str:
    return "adagrad" if sharding == "column_wise" else "rowwise_adagrad"


def _train(
    rank: int,
    world_size: int,
    out: str,
    sharding: str,
    batch_size: int,
    sparse_opt: str,
    dense_dtype: str = "fp32",
) -> None:
    recorder = LossRecorder()
    trainer = Trainer(
        model=tiny_model(),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out) / "run",
            sharding=sharding,
            batch_size=batch_size,
            sparse_optimizer=sparse_opt,
            dense_dtype=dense_dtype,
        ),
        callbacks=[recorder],
    )
    summary = trainer.fit()
    if rank == 0:
        torch.save(
            {"losses": recorder.losses, "dense": dense_params(trainer), "summary": summary},
            Path(out) / "result.pt",
        )


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    results = {}
    for opt in ("rowwise_adagrad", "adagrad"):
        out = tmp_path_factory.mktemp(f"unsharded_{opt}")
        run_multiprocess(_train, world_size=1, args=(str(out), "table_wise", 64, opt))
        results[opt] = torch.load(out / "result.pt", weights_only=False)
    return results


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise"])
def test_sharded_matches_unsharded(
    sharding: str, unsharded: dict[str, dict], tmp_path: Path
) -> None:
    opt = _sparse_optimizer(sharding)
    run_multiprocess(_train, world_size=2, args=(str(tmp_path), sharding, 32, opt))
    unsharded = unsharded[opt]
    sharded = torch.load(tmp_path / "result.pt", weights_only=False)
    assert len(sharded["losses"]) == len(unsharded["losses"]) == 6
    torch.testing.assert_close(
        torch.tensor(sharded["losses"]), torch.tensor(unsharded["losses"]), rtol=LOSS_RTOL, atol=0
    )
    # The model learned something: the trajectory is not flat.
    assert sharded["losses"][-1] < sharded["losses"][0]
    assert sharded["dense"].keys() == unsharded["dense"].keys()
    for name, value in sharded["dense"].items():
        torch.testing.assert_close(value, unsharded["dense"][name], atol=PARAM_ATOL, rtol=0, msg=name)


def test_bf16_dense_tracks_fp32(unsharded: dict[str, dict], tmp_path: Path) -> None:
    # bf16 autocast of the dense towers: the losses move off the fp32 ones (so autocast is
    # really on) but stay within bf16's ~3 significant digits of them.
    run_multiprocess(_train, world_size=1, args=(str(tmp_path), "table_wise", 64, "rowwise_adagrad", "bf16"))
    bf16 = torch.load(tmp_path / "result.pt", weights_only=False)
    fp32 = unsharded["rowwise_adagrad"]
    assert bf16["summary"]["dense_dtype"] == "bf16"
    assert bf16["losses"] != fp32["losses"]
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0)
    assert bf16["losses"][-1] < bf16["losses"][0]


class _FailAt(LossRecorder):
    def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        if step == 2:
            raise RuntimeError("callback failed at step 2")


def _fail_mid_run(rank: int, world_size: int, out: str) -> None:
    import threading

    trainer = Trainer(
        model=tiny_model(), data=tiny_data(), trainer=tiny_trainer(Path(out), prefetch=2),
        callbacks=[_FailAt()],
    )
    with pytest.raises(RuntimeError, match="callback failed at step 2"):
        trainer.fit()
    alive = [t.name for t in threading.enumerate() if t.name == "loka-prefetch" and t.is_alive()]
    assert not alive, f"input thread leaked after a failed step: {alive}"
    Path(out, "checked").write_text("ok")


def test_a_failing_step_stops_the_input_thread(tmp_path: Path) -> None:
    run_multiprocess(_fail_mid_run, world_size=1, args=(str(tmp_path),))
    assert (tmp_path / "checked").read_text() == "ok"


def _run_for_resume(rank: int, world_size: int, out: str, stop_after: int | None) -> None:
    trainer = Trainer(
        model=tiny_model("dcn"),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out),
            steps=8,
            sharding="row_wise",
            dense_warmup_steps=6,  # the resumed run must continue the same lr schedule
            checkpoint_every=4,
            checkpoint_at_end=True,
            stop_after_step=stop_after,
            resume="auto",
        ),
    )
    summary = trainer.fit()
    state = {k: v for k, v in trainer.state_dict()["model"].items()}
    from loka_train.runtime.checkpoint import to_local

    torch.save({"summary": summary, "model": to_local(state)}, Path(out) / f"final_rank{rank}.pt")


def test_kill_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_multiprocess(_run_for_resume, world_size=2, args=(str(straight), None))
    run_multiprocess(_run_for_resume, world_size=2, args=(str(killed), 4))
    first = torch.load(killed / "final_rank0.pt", weights_only=False)
    assert first["summary"]["stopped_early"] and first["summary"]["steps"] == 4
    run_multiprocess(_run_for_resume, world_size=2, args=(str(killed), None))
    for rank in range(2):
        a = torch.load(straight / f"final_rank{rank}.pt", weights_only=False)
        b = torch.load(killed / f"final_rank{rank}.pt", weights_only=False)
        assert b["summary"]["steps"] == 8
        assert a["summary"]["train/loss"] == pytest.approx(b["summary"]["train/loss"], rel=1e-6)
        assert a["model"].keys() == b["model"].keys()
        for key in a["model"]:
            va, vb = a["model"][key], b["model"][key]
            if isinstance(va, dict):
                va, vb = torch.cat(va["__local_shards__"]), torch.cat(vb["__local_shards__"])
            torch.testing.assert_close(va, vb, atol=1e-6, rtol=0, msg=key)
