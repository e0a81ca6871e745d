"""The sharded DLRM trains with each embedding/dense comm precision on 2 gloo ranks, its loss
tracks the FP32-comm run, switching precision mid-run works, and the ranks agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loka_train.comm import CommChannel, CommConfig, CommPrecision, PrecisionSource
from loka_train.dispatch import DispatchConfig
from loka_train.mods.config import ModsConfig
from loka_train.probe import ProbeConfig
from loka_train.plugin.config import LokaConfig
from loka_train.runtime import Callback
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, tiny_data, tiny_model, tiny_trainer

STEPS = 24
# Mean |loss - loss_fp32| / loss_fp32 over the run. Lossy comms perturb every step's
# pooled embeddings and gradients; the bound is per precision from its round-trip SQNR.
TOLERANCE = {"fp16": 2e-3, "bf16": 5e-3, "int8": 1e-2, "fp8": 3e-2}


class SwitchAt(Callback):
    """Switches every all-to-all and the dense gradients to `precision` after `step`."""

    def __init__(self, loka: LokaCallback, step: int, precision: CommPrecision) -> None:
        self.loka, self.step, self.precision = loka, step, precision
        self.seen: list[str] = []

    def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        state = self.loka.comm_state
        if step == self.step:
            for ch in (CommChannel.A2A_FWD, CommChannel.A2A_BWD, CommChannel.DENSE_GRAD):
                state.set_precision(ch, self.precision, source=PrecisionSource.EXPLICIT)
        self.seen.append(state.precision(CommChannel.A2A_FWD).value)


def _run(rank: int, world_size: int, out: str, precision: str, switch_to: str | None) -> None:
    p = CommPrecision(precision)
    loka = LokaCallback(
        LokaConfig(
            enabled=True,
            mods=ModsConfig(enabled=False),
            probe=ProbeConfig(enabled=False),
            dispatch=DispatchConfig(enabled=False),
            comm_enabled=True,
            comm=CommConfig(a2a_forward=p, a2a_backward=p, dense_grads=p, row_dim=8),
        )
    )
    recorder = LossRecorder()
    callbacks: list[Callback] = [loka, recorder]
    switch = None
    if switch_to is not None:
        switch = SwitchAt(loka, STEPS // 2, CommPrecision(switch_to))
        callbacks.append(switch)
    trainer = Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), steps=STEPS, sharding="table_wise"), callbacks=callbacks,
    )
    trainer.fit()
    seen = switch.seen if switch is not None else []
    gathered: list[list[str]] = [[] for _ in range(world_size)]
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        report = loka.comm_state.report()
        torch.save({"losses": recorder.losses, "seen": gathered, "report": report}, Path(out) / "r.pt")


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fp32")
    run_multiprocess(_run, world_size=2, args=(str(out), "fp32", None))
    return torch.load(out / "r.pt", weights_only=False)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8", "fp8"])
def test_each_precision_tracks_fp32(precision: str, fp32: dict, tmp_path: Path) -> None:
    run_multiprocess(_run, world_size=2, args=(str(tmp_path), precision, None))
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    a, b = torch.tensor(got["losses"]), torch.tensor(fp32["losses"])
    rel = ((a - b).abs() / b).mean().item()
    assert rel < TOLERANCE[precision], f"{precision}: mean relative loss gap {rel:.2e}"
    assert a[-4:].mean() < a[:4].mean()  # it trains
    if precision != "fp16":
        assert rel > 0, "lossy comm changed nothing: the codec was not used"


def test_switch_mid_run_and_ranks_agree(fp32: dict, tmp_path: Path) -> None:
    run_multiprocess(_run, world_size=2, args=(str(tmp_path), "fp32", "fp8"))
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    seen0, seen1 = got["seen"]
    assert seen0 == seen1
    assert seen0[: STEPS // 2] == ["fp32"] * (STEPS // 2) and seen0[-1] == "fp8"
    # Identical to the FP32 run before the switch, different after it.
    half = STEPS // 2 + 1
    assert got["losses"][:half] == fp32["losses"][:half]
    assert got["losses"][half + 1 :] != fp32["losses"][half + 1 :]
