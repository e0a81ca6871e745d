"""LoKA end to end on 2 gloo ranks: identical plans on every rank at the same steps (even
with different local data), and a resumed run makes the same decisions as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import torch

from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import PlanRecorder, num_fp8, preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_data, tiny_model, tiny_trainer

# Small windows so a 24-step run sees several intervals.
FAST = (
    "loka.probe.every_k_steps=1", "loka.probe.interval=4", "loka.probe.window=4",
    "loka.probe.min_samples=2", "loka.comm_enabled=false",
)


def _run(rank: int, world_size: int, out: str, kind: str, steps: int, stop: int | None) -> None:
    loka = LokaCallback(preset("aggressive", *FAST))
    recorder = PlanRecorder(loka)
    trainer = Trainer(
        model=tiny_model(kind),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), steps=steps, sharding="table_wise", checkpoint_every=8,
            checkpoint_at_end=True, stop_after_step=stop, resume="auto",
        ),
        callbacks=[loka, recorder],
    )
    summary = trainer.fit()
    torch.save(
        {
            "plans": recorder.plans,
            "history": [str(c) for c in loka.dispatcher.history],  # type: ignore[union-attr]
            "summary": summary,
        },
        Path(out) / f"rank{rank}_{'part' if stop else 'full'}.pt",
    )


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_ranks_apply_identical_plans(tmp_path: Path) -> None:
    run_multiprocess(_run, world_size=2, args=(str(tmp_path), "wukong", 16, None))
    r0, r1 = _load(tmp_path / "rank0_full.pt"), _load(tmp_path / "rank1_full.pt")
    assert [s for s, _ in r0["plans"]] == [3, 7, 11, 15]
    assert r0["plans"] == r1["plans"]
    assert r0["history"] == r1["history"]
    # Meaningful only if Dispatch actually moved GEMMs to FP8 on both ranks.
    assert num_fp8(r0["plans"][-1][1]) > 0
    assert (tmp_path / "latest" / "loka" / "loka_report.md").exists()
    assert (tmp_path / "latest" / "loka" / "sqnr_margin.png").exists()


def test_resume_makes_same_decisions(tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    run_multiprocess(_run, world_size=2, args=(str(full), "dlrm", 24, None))
    run_multiprocess(_run, world_size=2, args=(str(part), "dlrm", 24, 8))
    run_multiprocess(_run, world_size=2, args=(str(part), "dlrm", 24, None))
    a, b = _load(full / "rank0_full.pt"), _load(part / "rank0_full.pt")
    # The resumed run saw intervals 11..23; the uninterrupted one 3..23.
    assert b["plans"] == [p for p in a["plans"] if p[0] > 8]
    assert b["history"] == a["history"]
    assert num_fp8(a["plans"][-1][1]) > 0
    assert a["summary"]["train/loss"] == b["summary"]["train/loss"]


def _warm_start(rank: int, world_size: int, out: str, with_loka: bool, fresh_ok: bool) -> None:
    loka = LokaCallback(preset("aggressive", *FAST)) if with_loka else None
    recorder = PlanRecorder(loka) if loka is not None else None
    trainer = Trainer(
        model=tiny_model("dlrm"),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), steps=16 if with_loka else 8, sharding="table_wise", checkpoint_at_end=True,
            resume="must" if with_loka else "never", resume_new_callbacks=fresh_ok,
        ),
        callbacks=[cb for cb in (loka, recorder) if cb is not None],
    )
    try:
        summary = trainer.fit()
    except Exception as exc:  # the refusal, for the test to read
        torch.save({"error": str(exc)}, Path(out) / f"rank{rank}_warm.pt")
        return
    torch.save({"plans": recorder.plans if recorder else [], "summary": summary}, Path(out) / f"rank{rank}_warm.pt")


def test_a_bf16_checkpoint_resumes_with_loka_on_only_when_asked(tmp_path: Path) -> None:
    run_multiprocess(_warm_start, world_size=2, args=(str(tmp_path), False, False))  # bf16, 8 steps
    run_multiprocess(_warm_start, world_size=2, args=(str(tmp_path), True, False))
    refused = _load(tmp_path / "rank0_warm.pt")
    assert "no state for callbacks ['LokaCallback'" in refused["error"]
    assert "trainer.resume_new_callbacks=true" in refused["error"]
    run_multiprocess(_warm_start, world_size=2, args=(str(tmp_path), True, True))
    r0, r1 = _load(tmp_path / "rank0_warm.pt"), _load(tmp_path / "rank1_warm.pt")
    assert r0["summary"]["steps"] == 16
    # LoKA started at step 8 with a fresh Probe: its intervals end at steps 11 and 15.
    assert [s for s, _ in r0["plans"]] == [11, 15] and r0["plans"] == r1["plans"]
    assert num_fp8(r0["plans"][-1][1]) > 0
