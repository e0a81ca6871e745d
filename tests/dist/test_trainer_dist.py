"""The sharded DLRM on 2 gloo ranks trains like the unsharded model in 1 process, and a
killed run resumed from its checkpoint ends where an uninterrupted one does. Every fresh run
writes into a new run directory; a run that cannot go as configured (a checkpoint past
trainer.steps, too little data) is refused before it trains or changes anything on disk, on
every rank."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loka_train.data import DataConfig
from loka_train.runtime import Callback
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager
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
            dense_warmup_steps=3,  # the resumed run must continue the same lr schedule:
            lr_decay_start=3,  # warm-up, then a decay on both rates through the kill at step 4
            lr_decay_steps=6,
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


# ------------------------------------------------------------ runs refused before training
def _decayed_run(rank: int, world_size: int, out: str, steps: int) -> None:
    trainer = Trainer(
        model=tiny_model("dcn"),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), steps=steps, sharding="table_wise", lr_decay_start=2, lr_decay_steps=3
        ),  # table-wise: the tables train in the fused optimizer
    )
    trainer.fit()
    from loka_train.runtime.checkpoint import to_local

    torch.save(to_local(dict(trainer.state_dict()["model"])), Path(out) / f"model_rank{rank}.pt")


def _compare(a: dict, b: dict) -> dict[str, bool]:
    """Per weight: whether runs a and b hold identical values (local shards only)."""
    same = {}
    for key in a:
        va, vb = a[key], b[key]
        pairs = list(zip(va["__local_shards__"], vb["__local_shards__"])) if isinstance(va, dict) else [(va, vb)]
        if pairs:  # a table-wise table has no shard on the other rank
            same[key] = all(torch.equal(sa, sb) for sa, sb in pairs)
    return same


def test_lr_decay_reaches_zero_on_both_optimizers_on_its_step(tmp_path: Path) -> None:
    # lr_decay_start=2, lr_decay_steps=3: factors 1, 4/9, 1/9 at steps 2..4, and 0 from step 5.
    # So steps 5..7 move no weight, tables included, while step 4 still moves every kind. A
    # sparse rate applied one step late (step 5 at 1/9) or not at all would move the tables
    # in 5..7; a decay reaching 0 a step early would leave step 4 still.
    for steps in (4, 5, 8):
        run_multiprocess(_decayed_run, world_size=2, args=(str(tmp_path / f"s{steps}"), steps))
    for rank in range(2):
        four, five, eight = (
            torch.load(tmp_path / f"s{n}" / f"model_rank{rank}.pt", weights_only=False) for n in (4, 5, 8)
        )
        after_zero, at_step_4 = _compare(five, eight), _compare(four, five)
        tables = [k for k in after_zero if "embedding" in k]
        dense = [k for k in after_zero if k not in tables]
        assert tables and dense, f"rank {rank}: tables and dense weights both compared"
        assert all(after_zero.values()), [k for k, same in after_zero.items() if not same]
        assert not any(at_step_4[k] for k in tables), "step 4 (factor 1/9) must move every table"
        assert not all(at_step_4[k] for k in dense), "step 4 must move the dense weights"


def _finish_run(rank: int, world_size: int, out: str) -> None:
    # With the callback _refused uses, so its checkpoint restores cleanly but for the guards.
    Trainer(
        model=tiny_model(), data=tiny_data(), trainer=tiny_trainer(Path(out), checkpoint_at_end=True),
        callbacks=[LossRecorder()],
    ).fit()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs root (trainer.out_dir) of a finished 6-step run with its checkpoint (step 6)."""
    out = tmp_path_factory.mktemp("finished")
    run_multiprocess(_finish_run, world_size=1, args=(str(out),))
    return out


def _refused(out: Path, model: str = "dlrm", **overrides: Any) -> str:
    """fit() of a tiny run must raise CheckpointError before any step; returns the message."""
    recorder = LossRecorder()
    trainer = Trainer(
        model=tiny_model(model), data=tiny_data(), trainer=tiny_trainer(out, **overrides),
        callbacks=[recorder],
    )
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    assert recorder.losses == [], "the run trained before it was refused"
    return str(info.value)


def _rerun_fresh(rank: int, world_size: int, out: str) -> list[float]:
    recorder = LossRecorder()
    Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), resume="never", checkpoint_at_end=True),
        callbacks=[recorder],
    ).fit()
    return recorder.losses


def test_a_fresh_run_writes_a_new_run_directory(finished_run: Path, tmp_path: Path) -> None:
    """A fresh run (resume=never) beside a finished one trains from step 0 in a new directory
    that `latest` then names; the earlier run is left as it was (neither mixed, pruned nor
    moved)."""
    out = tmp_path / "runs"
    shutil.copytree(finished_run, out, symlinks=True)
    [earlier] = [p for p in out.iterdir() if p.name != "latest"]
    before = sorted(str(p.relative_to(earlier)) for p in earlier.rglob("*"))
    [losses] = run_multiprocess(_rerun_fresh, world_size=1, args=(str(out),), timeout=120)
    assert len(losses) == 6  # all 6 steps trained, none resumed
    assert sorted(str(p.relative_to(earlier)) for p in earlier.rglob("*")) == before
    new = (out / "latest").resolve()
    assert new.parent == out.resolve() and new.name != earlier.name
    assert (new / "checkpoints" / "latest").read_text() == "step_00000006"  # this run's own
    assert not list(out.glob("*.before-*")) and not list(earlier.glob("*.before-*"))


def _resume_past_steps(rank: int, world_size: int, out: str) -> str:
    return _refused(Path(out), steps=3, resume="auto")


def test_checkpoint_past_trainer_steps_is_refused(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    [message] = run_multiprocess(_resume_past_steps, world_size=1, args=(str(out),), timeout=60)
    [run] = [p for p in out.iterdir() if p.name != "latest"]
    assert f"checkpoint {run / 'checkpoints' / 'step_00000006'} is at step 6" in message, message
    assert "past trainer.steps=3" in message and "trainer.resume=never" in message


def _resume_cases(rank: int, world_size: int, out: str) -> dict[str, Any]:
    runs = Path(out)
    found: dict[str, Any] = {
        "sharding": _refused(runs, resume="auto", steps=8, sharding="table_wise"),
        "model": _refused(runs, "dcn", resume="auto", steps=8),
    }
    wider = tiny_model()
    wider.over_arch_layer_sizes = [32, 1]  # a shape the checkpoint's meta does not record
    recorder = LossRecorder()
    trainer = Trainer(model=wider, data=tiny_data(), trainer=tiny_trainer(runs, resume="auto", steps=8),
                      callbacks=[recorder])
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    found["shape"] = str(info.value)
    found["untouched"] = sorted(p.name for p in runs.iterdir())
    [source] = [p for p in runs.iterdir() if p.name != "latest"]
    recorder = LossRecorder()
    trainer = Trainer(model=tiny_model(), data=tiny_data(),
                      trainer=tiny_trainer(runs, resume=str(source), steps=8), callbacks=[recorder])
    trainer.fit()
    found["from_path"] = (len(recorder.losses), trainer.out_dir != source, (runs / "latest").resolve() == trainer.out_dir.resolve())
    return found


def test_a_resume_mismatch_names_the_checkpoint_and_the_fix(finished_run: Path, tmp_path: Path) -> None:
    """The checkpoint's meta is checked before anything changes on disk; a state that does not
    fit the model names the checkpoint too; resume=<path> starts a new run from it."""
    out = tmp_path / "runs"
    shutil.copytree(finished_run, out, symlinks=True)
    [run] = [p for p in out.iterdir() if p.name != "latest"]
    checkpoint = run / "checkpoints" / "step_00000006"
    [found] = run_multiprocess(_resume_cases, world_size=1, args=(str(out),), timeout=120)
    for case in ("sharding", "model", "shape"):
        assert str(checkpoint) in found[case] and "trainer.resume=never" in found[case], found[case]
    assert "written with trainer.sharding=auto, this run has trainer.sharding=table_wise" in found["sharding"]
    assert "resume it with trainer.sharding=auto" in found["sharding"]
    assert "written with model=dlrm, this run has model=dcn: resume it with model=dlrm" in found["model"]
    assert f"cannot resume from {checkpoint}" in found["shape"] and "shape" in found["shape"]
    assert found["untouched"] == sorted([run.name, "latest"]), "a refused resume changed the runs"
    assert found["from_path"] == (2, True, True)  # steps 7 and 8, in a new run that latest names


def _write_criteo(path: Path, num_lines: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = [
        "\t".join(
            [str(rng.randint(0, 1))]
            + [str(rng.randint(0, 9)) for _ in range(13)]
            + [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        )
        for _ in range(num_lines)
    ]
    path.write_text("\n".join(rows) + "\n")


_SHORT_DATA_CASES = {
    # name: (train lines, eval lines, trainer.steps, trainer.eval_batches), global batch 16
    "train_short": (16 * 5, 16 * 2, 10, 1),
    "eval_empty": (16 * 5, 8, 3, 1),
    "eval_short": (16 * 5, 16 * 2, 3, 3),
    "exactly_enough": (16 * 5 + 7, 16 * 2, 5, 2),
}


def _short_data(rank: int, world_size: int, out: str) -> dict[str, str]:
    messages = {}
    for name, (train_lines, eval_lines, steps, eval_batches) in _SHORT_DATA_CASES.items():
        root = Path(out) / name
        root.mkdir()
        _write_criteo(root / "train.tsv", train_lines, seed=0)
        _write_criteo(root / "eval.tsv", eval_lines, seed=1)
        data = DataConfig(
            kind="criteo_tsv", path=str(root / "train.tsv"), eval_path=str(root / "eval.tsv"),
            num_embeddings=100,
        )
        recorder = LossRecorder()
        # An earlier run in the out_dir, the latest: a refused run must leave the runs as they are.
        earlier = root / "run" / "20260101-000000" / "checkpoints" / "step_00000001"
        earlier.mkdir(parents=True)
        (root / "run" / "latest").symlink_to("20260101-000000")
        trainer = Trainer(
            model=tiny_model(), data=data,
            trainer=tiny_trainer(root / "run", batch_size=16, steps=steps, eval_batches=eval_batches),
            callbacks=[recorder],
        )
        if name == "exactly_enough":
            trainer.fit()  # exactly trainer.steps batches: no premature end (pipeline prefetch)
            assert len(recorder.losses) == steps
            messages[name] = "accepted"
            continue
        with pytest.raises(ValueError) as info:
            trainer.fit()
        if name == "train_short":
            # Not read ahead (a full pass would read all the data first): the run trains what
            # there is and stops with the error at the end of the data.
            assert len(recorder.losses) == 5, recorder.losses
        else:  # eval data is small: checked before any step, and before anything is moved
            assert recorder.losses == [], f"{name}: the run trained before it was refused"
            assert earlier.is_dir(), name
            assert sorted(p.name for p in (root / "run").iterdir()) == ["20260101-000000", "latest"], name
            assert (root / "run" / "latest").resolve().name == "20260101-000000", name
        messages[name] = str(info.value)
    return messages


def test_too_little_data_is_refused_naming_the_setting(tmp_path: Path) -> None:
    [messages] = run_multiprocess(_short_data, world_size=1, args=(str(tmp_path),), timeout=90)
    train = messages["train_short"]
    assert "trainer.steps=10" in train and "holds only 5" in train, train
    assert f"data.path='{tmp_path / 'train_short' / 'train.tsv'}'" in train, train
    empty = messages["eval_empty"]
    assert "trainer.eval_batches=1" in empty and "holds only 0" in empty, empty
    assert "data.eval_path=" in empty, empty
    short = messages["eval_short"]
    assert "trainer.eval_batches=3" in short and "holds only 2" in short, short
    assert messages["exactly_enough"] == "accepted"


# ----------------------------------------------------------------------- the run summary
_PAUSE_S = 0.5
"""Sleep added to each evaluation and checkpoint from step 3 on (inside the timed window)."""


class _SlowEvalLateFallback(Callback):
    def on_eval_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        if step >= 3:
            time.sleep(_PAUSE_S)

    def on_train_end(self, trainer, summary):  # type: ignore[no-untyped-def]
        trainer.fallbacks.append("late fallback recorded in on_train_end")


def _timed_run(rank: int, world_size: int, out: str) -> tuple[dict[str, Any], list[dict]]:
    trainer = Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), steps=6, eval_every=1, checkpoint_every=1),
        callbacks=[_SlowEvalLateFallback()],
    )
    save = CheckpointManager.save

    def slow_save(self: CheckpointManager, step: int, *args: Any) -> Path:
        path = save(self, step, *args)
        if step >= 3:
            time.sleep(_PAUSE_S)
        return path

    CheckpointManager.save = slow_save  # type: ignore[method-assign]  # this forked process only
    summary = trainer.fit()
    logged = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, logged


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict], Path]:
    out = tmp_path_factory.mktemp("timed")
    [(summary, logged)] = run_multiprocess(_timed_run, world_size=1, args=(str(out),))
    return summary, logged, out


def test_steps_per_s_excludes_eval_and_checkpoint_time(timed_run: tuple) -> None:
    # The 3 timed steps (4..6) share the window with 4 evaluations and 4 checkpoints of
    # >= 0.5 s each: counting them would give <= 3 / 4 s = 0.75 steps/s. A tiny CPU step
    # takes well under 0.5 s, so training alone runs at > 2 steps/s.
    summary, logged, _ = timed_run
    last = [m["train/steps_per_s"] for m in logged if "train/steps_per_s" in m][-1]
    assert summary["train/steps_per_s"] > 2.0, summary
    assert last > 2.0, logged


def test_fallbacks_from_on_train_end_reach_the_summary(timed_run: tuple) -> None:
    summary, _, out = timed_run
    assert "late fallback recorded in on_train_end" in summary["fallbacks"]
    written = json.loads((out / "latest" / "summary.json").read_text())
    assert "late fallback recorded in on_train_end" in written["fallbacks"]


# ----------------------------------------------- a resume that fails on one rank only
class _FailsToLoad(Callback):
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("disk gremlin on rank 1")


def _resume_fails_on_rank_1(rank: int, world_size: int, out: str) -> str:
    Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), steps=2, checkpoint_at_end=True),
        callbacks=[_FailsToLoad(False)],
    ).fit()
    resumed = Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), steps=4, resume="auto"),
        callbacks=[_FailsToLoad(rank == 1)],
    )
    with pytest.raises(CheckpointError) as info:
        resumed.fit()
    return str(info.value)


def test_a_resume_failure_of_any_type_stops_every_rank(tmp_path: Path) -> None:
    # A RuntimeError on rank 1 alone used to escape before the ranks agreed, leaving rank 0
    # in the all-reduce; now every rank raises CheckpointError with rank 1's message.
    messages = run_multiprocess(
        _resume_fails_on_rank_1, world_size=2, args=(str(tmp_path),), timeout=90
    )
    for message in messages:
        assert "RuntimeError: disk gremlin on rank 1" in message, messages
    assert messages[0].startswith("rank 1 failed: cannot restore"), messages


class _EvalOrder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        self.events.append(f"step_end {step}")

    def on_eval_start(self, trainer, step):  # type: ignore[no-untyped-def]
        self.events.append(f"eval_start {step} grad={torch.is_grad_enabled()}")

    def on_eval_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        self.events.append(f"eval_end {step}")


def _eval_order(rank: int, world_size: int, out: str) -> list[str]:
    recorder = _EvalOrder()
    Trainer(
        model=tiny_model(), data=tiny_data(), trainer=tiny_trainer(Path(out), steps=4, eval_every=2),
        callbacks=[recorder],
    ).fit()
    return recorder.events


def test_every_evaluation_is_bracketed_by_eval_start_and_eval_end(tmp_path: Path) -> None:
    """Callbacks (LoKA counts eval collectives apart) see on_eval_start before each eval."""
    [events] = run_multiprocess(_eval_order, world_size=1, args=(str(tmp_path),), timeout=120)
    evals = [e for e in events if e.startswith("eval")]
    # After steps 1 and 3, numbered as on_step_end numbers them (0-based).
    assert evals == ["eval_start 1 grad=True", "eval_end 1", "eval_start 3 grad=True", "eval_end 3"]
