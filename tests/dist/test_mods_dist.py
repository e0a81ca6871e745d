"""Converted models shard and train under DistributedModelParallel (2 gloo ranks).

The conversion runs in a callback's ``on_before_shard`` (on the unsharded ``RecTrainModel``),
as the LoKA callback does. In high precision with the reassociating fusions off, the converted
sharded run is bit-identical to the unconverted sharded run; with FP8 (emulated) and every
adaptation on, it trains, its sites are found through the DMP/DDP wrappers under the names
``convert`` gave them, and the dense parameters stay identical across ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loka_train.mods import ModsConfig, convert, sites
from loka_train.runtime import Callback
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, dense_params, tiny_data, tiny_model, tiny_trainer

HP_EXACT = dict(horizontal_fusion=False, dcn_epilogue_fusion=False)


class ConvertCallback(Callback):
    """Converts the unsharded model before DMP wraps it; checks the sites after."""

    def __init__(self, config: ModsConfig) -> None:
        self.config = config
        self.names_at_convert: list[str] = []
        self.names_after_shard: list[str] = []
        self.plans: dict[str, str] = {}

    def on_before_shard(self, trainer: Any) -> None:
        convert(trainer.model, config=self.config)
        self.names_at_convert = sorted(sites(trainer.model))

    def on_train_start(self, trainer: Any) -> None:
        from torchrec.distributed import DistributedModelParallel

        assert isinstance(trainer.model, DistributedModelParallel)
        found = sites(trainer.model)
        self.names_after_shard = sorted(found)
        self.plans = {n: str(s.plan) for n, s in found.items()}


def _train(rank: int, world_size: int, out: str, kind: str, mods: dict[str, Any] | None) -> dict[str, Any]:
    recorder = LossRecorder()
    callbacks: list[Callback] = [recorder]
    conv = None
    if mods is not None:
        conv = ConvertCallback(ModsConfig(**mods))
        callbacks.append(conv)
    trainer = Trainer(
        model=tiny_model(kind),
        data=tiny_data(),
        trainer=tiny_trainer(Path(out) / f"run_{rank}", sharding="table_wise"),
        callbacks=callbacks,
    )
    summary = trainer.fit()
    return {
        "losses": recorder.losses,
        "dense": dense_params(trainer),
        "summary": summary,
        "names_at_convert": conv.names_at_convert if conv else [],
        "names_after_shard": conv.names_after_shard if conv else [],
        "plans": conv.plans if conv else {},
    }


def test_high_precision_sharded_run_is_identical(tmp_path: Path) -> None:
    plain = run_multiprocess(_train, world_size=2, args=(str(tmp_path / "a"), "wukong", None))
    conv = run_multiprocess(_train, world_size=2, args=(str(tmp_path / "b"), "wukong", HP_EXACT))
    assert conv[0]["names_at_convert"] and conv[0]["names_after_shard"] == conv[0]["names_at_convert"]
    assert all(p == "fwd=high dgrad=high wgrad=high" for p in conv[0]["plans"].values())
    for rank in range(2):
        assert conv[rank]["losses"] == plain[rank]["losses"]
        assert conv[rank]["dense"].keys() == plain[rank]["dense"].keys()
        for name, value in plain[rank]["dense"].items():
            assert torch.equal(conv[rank]["dense"][name], value), name


@pytest.mark.parametrize("kind", ["dlrm", "dcn", "wukong"])
def test_fp8_sharded_training(kind: str, tmp_path: Path) -> None:
    results = run_multiprocess(
        _train, world_size=2, args=(str(tmp_path), kind, {"initial_plan": "fp8_rowwise"})
    )
    r0, r1 = results
    names = r0["names_at_convert"]
    assert len(names) >= 4 and r0["names_after_shard"] == names == r1["names_after_shard"]
    assert all("fp8:e4m3/rowwise@emulated" in p for p in r0["plans"].values())
    losses = torch.tensor(r0["losses"])
    assert len(losses) == 6 and torch.isfinite(losses).all()
    assert losses[-1] < losses[0]  # it learns
    assert r0["losses"] == r1["losses"]  # the recorder all-reduces: same on both ranks
    # DDP keeps the dense replicas (all site parameters included) identical across ranks.
    assert r0["dense"].keys() == r1["dense"].keys()
    for name, value in r0["dense"].items():
        assert torch.equal(value, r1["dense"][name]), name
