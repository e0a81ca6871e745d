"""A checkpoint resumes on another number of processes (2 -> 1 -> 2 on gloo) with the LoKA
plugin on: the model and optimizer reshard through torch.distributed.checkpoint, LoKA's plans
carry over, the Probe window is merged so that its next reduction is the saved run's, and with
the same global batch and no FP8 plan the losses are the uninterrupted run's.

With FP8 plans the losses after a move follow the uninterrupted run's only approximately: a
tensorwise FP8 scale comes from the amax of each rank's own activations, so one process (one
amax over the global batch) rounds differently from two (one per half)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from loka_train.plugin.callback import LokaCallback
from loka_train.runtime import Callback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import num_fp8, preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, tiny_data, tiny_model, tiny_trainer

FAST = (
    "loka.probe.every_k_steps=1", "loka.probe.interval=4", "loka.probe.window=4",
    "loka.probe.min_samples=2", "loka.comm_enabled=false",
)
GLOBAL_BATCH = 64
STEPS = 12


class Restored(Callback):
    """What the LoKA callback holds right after a resume (its on_train_start ran first)."""

    def __init__(self, loka: LokaCallback) -> None:
        self.loka = loka
        self.plans: dict[str, Any] = {}
        self.probe: dict[str, Any] = {}

    def on_train_start(self, trainer: Any) -> None:
        assert self.loka.dispatcher is not None and self.loka.probe is not None
        self.plans = self.loka.dispatcher.export()
        self.probe = self.loka.probe.state_dict()


def _run(rank: int, world_size: int, out: str, stop: int | None, *overrides: str) -> None:
    loka = LokaCallback(preset("aggressive", *FAST, *overrides))
    restored, losses = Restored(loka), LossRecorder()
    trainer = Trainer(
        model=tiny_model("dlrm"),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), steps=STEPS, batch_size=GLOBAL_BATCH // world_size, sharding="row_wise",
            checkpoint_every=4, keep_checkpoints=4, stop_after_step=stop, resume="auto",
        ),
        callbacks=[loka, restored, losses],
    )
    trainer.fit()
    result = {"losses": losses.losses, "plans": restored.plans, "probe": restored.probe}
    torch.save(result, Path(out) / f"stop_{stop}_rank{rank}.pt")


def _moved(out: Path, *overrides: str) -> list[list[dict[str, Any]]]:
    """Run to step 4 on 2 processes, to 8 on 1, to 12 on 2; each segment's per-rank results."""
    segments = [(2, 4), (1, 8), (2, None)]
    for world_size, stop in segments:
        run_multiprocess(_run, world_size=world_size, args=(str(out), stop, *overrides), timeout=120)
    return [[_load(out / f"stop_{stop}_rank{r}.pt") for r in range(w)] for w, stop in segments]


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _saved_loka(out: Path, step: int) -> list[dict[str, Any]]:
    """The LoKA state each rank wrote into the checkpoint of `step`."""
    ckpt = out / "latest" / "checkpoints" / f"step_{step:08d}"
    files = sorted(ckpt.glob("rank_*.pt"))
    return [_load(f)["callbacks"]["LokaCallback"] for f in files]


def _check_restored(out: Path, parts: list[list[dict[str, Any]]]) -> None:
    """Plans as saved on every rank; the Probe window merged (2 -> 1) and split (1 -> 2)."""
    two, one = _saved_loka(out, 4), _saved_loka(out, 8)
    assert len(two) == 2 and len(one) == 1
    for saved, resumed in ((two, parts[1]), (one, parts[2])):
        for state in resumed:
            assert state["plans"] == saved[0]["dispatch"]["plans"]
            assert state["probe"]["verdicts"] == saved[0]["probe"]["verdicts"]
            torch.testing.assert_close(state["probe"]["global_sum"], saved[0]["probe"]["global_sum"])
    merged = parts[1][0]["probe"]
    torch.testing.assert_close(merged["local_sum"], two[0]["probe"]["local_sum"] + two[1]["probe"]["local_sum"])
    torch.testing.assert_close(merged["local_max"], torch.maximum(two[0]["probe"]["local_max"],
                                                                 two[1]["probe"]["local_max"]))
    first, second = parts[2][0]["probe"], parts[2][1]["probe"]
    torch.testing.assert_close(first["local_sum"], one[0]["probe"]["local_sum"])
    assert not second["local_sum"].any() and bool((second["local_max"] == -math.inf).all())


def test_resume_across_world_sizes_continues_the_run(tmp_path: Path) -> None:
    """Probe on, Dispatch off (no FP8 plan): the math of a step does not depend on how the
    global batch is split, so the losses are the uninterrupted run's (to rounding)."""
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    run_multiprocess(_run, world_size=2, args=(str(straight), None, "loka.dispatch.enabled=false"), timeout=120)
    parts = _moved(moved, "loka.dispatch.enabled=false")
    full = _load(straight / "stop_None_rank0.pt")["losses"]
    losses = [x for part in parts for x in part[0]["losses"]]
    assert len(losses) == STEPS
    assert losses[:4] == full[:4]
    assert losses == pytest.approx(full, rel=1e-6)
    _check_restored(moved, parts)


def test_fp8_plans_and_probe_windows_carry_across_world_sizes(tmp_path: Path) -> None:
    parts = _moved(tmp_path)
    _check_restored(tmp_path, parts)
    assert num_fp8(parts[1][0]["plans"]) > 0, "no FP8 plan was carried: the test shows nothing"
    assert all(math.isfinite(x) for part in parts for x in part[0]["losses"])
