"""A run trained on 2 gloo ranks (its tables sharded table-wise), exported on one process:
``load_trained`` reads every table whole and the replicated dense weights, with the plans the
ranks agreed on."""

from __future__ import annotations

from pathlib import Path

import torch

from loka_train.export import ServeConfig, load_trained, serve
from loka_train.job import JobConfig
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import PlanRecorder, num_fp8, preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import dense_params, tiny_data, tiny_model, tiny_trainer

FAST = (
    "loka.probe.every_k_steps=1", "loka.probe.interval=4", "loka.probe.window=4",
    "loka.probe.min_samples=2", "loka.comm_enabled=false", "loka.mods.static_scales=false",
)


def _job(out: Path) -> JobConfig:
    return JobConfig(model=tiny_model("wukong"), data=tiny_data(),
                     trainer=tiny_trainer(out, steps=12, sharding="table_wise", checkpoint_at_end=True),
                     loka=preset("aggressive", *FAST))


def _run(rank: int, world_size: int, out: str) -> None:
    job = _job(Path(out))
    loka = LokaCallback(job.loka)
    recorder = PlanRecorder(loka)
    trainer = Trainer(model=job.model, data=job.data, trainer=job.trainer, callbacks=[loka, recorder])
    trainer.fit()
    tables = {}
    for name, value in trainer.model.state_dict().items():
        if "embedding_bags" in name and hasattr(value, "local_shards"):
            for shard in value.local_shards():
                if tuple(shard.tensor.shape) == tuple(value.size()):  # a whole table on this rank
                    tables[name] = shard.tensor.clone()
    torch.save({"dense": dense_params(trainer), "tables": tables, "plans": loka.dispatcher.export()},  # type: ignore[union-attr]
               Path(out) / f"rank{rank}.pt")


def test_a_two_rank_run_loads_whole_on_one_process(tmp_path: Path) -> None:
    run_multiprocess(_run, world_size=2, args=(str(tmp_path),))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    trained = load_trained(_job(tmp_path), tmp_path / "latest")
    state = trained.model.state_dict()
    tables = {**ranks[0]["tables"], **ranks[1]["tables"]}
    assert len(tables) == 4 and ranks[0]["tables"] and ranks[1]["tables"]  # each rank held some
    for name, value in tables.items():
        assert torch.equal(state[name], value), name
    for name, value in ranks[0]["dense"].items():
        assert torch.equal(state[name], value), name
    plans = {n: p.to_dict() for n, p in trained.plans.items()}
    assert plans == ranks[0]["plans"] == ranks[1]["plans"] and num_fp8(plans) > 0
    served = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="fp32"))
    assert not served.training
