"""Checkpoint writes are atomic, corrupt or mismatched checkpoints fail with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loka_train.runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    _failures,
    copy_into,
    to_local,
)


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, rank=0, world_size=1, keep=2)


def test_save_load_round_trip(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    state = {"w": torch.arange(6.0).view(2, 3), "nested": {"step": 3, "t": torch.ones(2)}}
    mgr.save(3, state, {"seed": 0})
    path = mgr.latest()
    assert path is not None and path.name == "step_00000003"
    saved, meta = mgr.load(path)
    assert meta["step"] == 3 and meta["world_size"] == 1
    live = {"w": torch.zeros(2, 3), "nested": {"step": 0, "t": torch.zeros(2)}}
    copy_into(live, saved, "state")
    assert torch.equal(live["w"], state["w"]) and torch.equal(live["nested"]["t"], torch.ones(2))


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = _manager(tmp_path)
    mgr.save(1, {"w": torch.ones(3)}, {})

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="previous checkpoint .* is untouched"):
        mgr.save(2, {"w": torch.full((3,), 2.0)}, {})
    monkeypatch.undo()
    path = mgr.latest()
    assert path is not None and path.name == "step_00000001"
    saved, _ = mgr.load(path)
    assert torch.equal(saved["w"], torch.ones(3))
    assert not list(tmp_path.glob(".tmp_*")), "the failed save's temporary directory is left over"


def test_corrupt_checkpoint_names_the_problem(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    mgr.save(5, {"w": torch.ones(3)}, {})
    path = mgr.latest()
    assert path is not None
    (path / "rank_0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        mgr.load(path)


def test_dangling_latest_pointer(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "latest").write_text("step_00000009")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        mgr.latest()


def test_sharded_state_goes_through_dcp_and_loads_in_place(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    mgr.save(2, {"model": {"w": torch.arange(4.0)}, "optimizer": {"state": {}}, "step": 2}, {})
    path = mgr.latest()
    assert path is not None and (path / ".metadata").is_file()
    live = {"model": {"w": torch.zeros(4)}, "optimizer": {"state": {}}}
    saved, meta = mgr.load(path, into=live)
    assert meta["format"] == "dcp" and saved["step"] == 2
    assert torch.equal(live["model"]["w"], torch.arange(4.0)) and saved["model"] is live["model"]


def test_a_per_rank_checkpoint_of_another_world_size_names_the_way_on(tmp_path: Path) -> None:
    path = tmp_path / "step_00000001"
    path.mkdir()
    torch.save({"w": torch.ones(1)}, path / "rank_0.pt")
    (path / "meta.json").write_text('{"step": 1, "world_size": 2}')  # no "format": per-rank
    (tmp_path / "latest").write_text(path.name)
    mgr = _manager(tmp_path)
    with pytest.raises(CheckpointError, match="per-rank format .* resume it once with 2 processes"):
        mgr.load(path)


def test_shape_mismatch_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="shape"):
        copy_into({"w": torch.zeros(4)}, to_local({"w": torch.zeros(3)}), "model")
    with pytest.raises(CheckpointError, match="keys differ"):
        copy_into({"w": torch.zeros(4)}, to_local({"v": torch.zeros(4)}), "model")


def test_keeps_only_recent(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    for step in range(1, 5):
        mgr.save(step, {"w": torch.ones(1) * step}, {})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]


def test_rerun_stopping_at_a_lower_step_keeps_what_it_saved(tmp_path: Path) -> None:
    # An earlier run left steps 100..300; a later run in the same directory saves 50, 100, 150.
    # Pruning by "highest step numbers" deleted each new checkpoint right after writing it and
    # left `latest` dangling; only steps below the one just saved may go.
    for step in (100, 200, 300):
        _manager(tmp_path).save(step, {"w": torch.zeros(1)}, {})
    rerun = _manager(tmp_path)
    for step in (50, 100, 150):
        saved = rerun.save(step, {"w": torch.full((1,), float(step))}, {})
        assert saved.is_dir(), f"the checkpoint of step {step} was pruned right after its save"
        assert rerun.latest() == saved
    state, _ = rerun.load(saved)
    assert torch.equal(state["w"], torch.full((1,), 150.0))
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    # keep=2 of this run's steps below 150: step 100 stays, step 50 goes; higher steps are
    # not pruned (the Trainer starts every fresh run in a new directory, so none mixes runs).
    assert names == ["step_00000100", "step_00000150", "step_00000200", "step_00000300"]


def test_existing_lists_step_dirs_and_latest(tmp_path: Path) -> None:
    mgr = _manager(tmp_path / "none")
    assert mgr.existing() == []
    mgr = _manager(tmp_path)
    mgr.save(7, {"w": torch.ones(1)}, {})
    (tmp_path / ".tmp_step_00000008_abcd").mkdir()  # a crashed save is no checkpoint
    assert [p.name for p in mgr.existing()] == ["latest", "step_00000007"]


def test_a_fresh_metrics_log_starts_empty(tmp_path) -> None:
    import json

    from loka_train.runtime.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 0.5}) + "\n")
    fresh = MetricsLogger(tmp_path, tensorboard=False)
    fresh.start_at(0)  # a run from step 0
    fresh.log(1, {"train/loss": 0.7})
    fresh.close()
    assert [json.loads(line)["train/loss"] for line in (tmp_path / "metrics.jsonl").open()] == [0.7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # nothing set aside
    other_rank = MetricsLogger(None, tensorboard=True)
    other_rank.start_at(0)
    other_rank.log(1, {"train/loss": 0.1})
    other_rank.close()


def test_a_resumed_run_purges_tensorboard_events_past_its_checkpoint(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loka_train.runtime.metrics import MetricsLogger

    first = MetricsLogger(tmp_path, tensorboard=True)
    first.start_at(0)
    for step in range(1, 6):
        first.log(step, {"train/loss": 1.0})
    first.close()
    resumed = MetricsLogger(tmp_path, tensorboard=True)
    resumed.start_at(3)
    for step in range(4, 7):
        resumed.log(step, {"train/loss": 0.5})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5), (6, 0.5)]


def test_a_resumed_metrics_log_survives_a_half_written_last_line(tmp_path) -> None:
    """A killed run can leave its last metrics line cut short: resuming drops it (logged)
    instead of failing, and keeps the complete lines up to the checkpoint."""
    import json

    from loka_train.runtime.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (1, 2, 3))
                    + '{"step": 4, "train/lo')
    resumed = MetricsLogger(tmp_path, tensorboard=False)
    resumed.start_at(3)
    resumed.log(4, {"train/loss": 0.5})
    resumed.close()
    steps = [json.loads(line)["step"] for line in path.open()]
    assert steps == [1, 2, 3, 4]


def test_a_resumed_metrics_log_keeps_each_step_once(tmp_path) -> None:
    """Interrupted at step 5 with a checkpoint at step 3: the resumed run redoes steps 4-5, so
    their old lines go; from scratch (step 0) the file starts empty."""
    import json

    from loka_train.runtime.metrics import MetricsLogger

    first = MetricsLogger(tmp_path, tensorboard=False)
    first.start_at(0)
    for step in range(1, 6):
        first.log(step, {"train/loss": 1.0})
    first.close()
    resumed = MetricsLogger(tmp_path, tensorboard=False)
    resumed.start_at(3)
    for step in range(4, 7):
        resumed.log(step, {"train/loss": 0.5})
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 6]
    again = MetricsLogger(tmp_path, tensorboard=False)
    again.start_at(0)
    again.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_preflight_refuses_a_per_rank_checkpoint_on_another_world_size(tmp_path: Path) -> None:
    from loka_train.runtime.config import TrainerConfig
    from loka_train.runtime.preflight import check_resumable

    cfg = TrainerConfig(steps=10, batch_size=32, device="cpu")
    per_rank = {"step": 4, "world_size": 2, "batch_size": 32}
    with pytest.raises(CheckpointError, match="per-rank format .* resume it once with 2 processes"):
        check_resumable(tmp_path, cfg, saved=per_rank, now={"world_size": 1, "batch_size": 32})
    check_resumable(tmp_path, cfg, saved=per_rank, now={"world_size": 2, "batch_size": 32})
    # The distributed format resumes on another world size, with or without the global batch.
    check_resumable(tmp_path, cfg, saved={**per_rank, "format": "dcp"}, now={"world_size": 1, "batch_size": 64})
    check_resumable(tmp_path, cfg, saved={**per_rank, "format": "dcp"}, now={"world_size": 1, "batch_size": 32})
    with pytest.raises(CheckpointError, match="trainer.batch_size=32"):
        check_resumable(tmp_path, cfg, saved={**per_rank, "format": "dcp"}, now={"world_size": 2, "batch_size": 16})


def test_an_empty_error_message_is_a_failure_in_a_process_group(tmp_path: Path) -> None:
    """The all-reduce that decides whether any rank failed and the gather of the messages agree
    on what a failure is (an error that is not None), so an empty message is reported, not lost."""
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _failures(None) == []
        assert _failures("") == [(0, "")]
        assert _failures("OSError: disk full") == [(0, "OSError: disk full")]
    finally:
        dist.destroy_process_group()
