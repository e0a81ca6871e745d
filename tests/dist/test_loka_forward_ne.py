"""``loka.guard.forward_ne``: each evaluation runs again with the FP8 forwards in high precision
(two CPU processes, emulated FP8, the Trainer's TorchRec pipeline), logs what they cost the NE
and changes nothing the run trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import num_fp8, preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_trainer


def _train(rank: int, world_size: int, out: str, forward_ne: bool) -> None:
    loka = LokaCallback(preset(
        "aggressive", "loka.probe.interval=5", "loka.comm_enabled=false", "loka.dispatch.objective=coverage",
        f"loka.guard.forward_ne={str(forward_ne).lower()}",
    ))
    trainer = Trainer(
        model=ModelConfig(kind="dlrm", dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[128, 64, 1]),
        data=DataConfig(num_embeddings=2000),
        trainer=tiny_trainer(Path(out), steps=40, batch_size=128, eval_every=10, eval_batches=4),
        callbacks=[loka],
    )
    summary = trainer.fit()
    assert loka.dispatcher is not None
    summary["plan"] = loka.dispatcher.export()
    summary["evals"] = loka.evals
    if rank == 0:  # rank 0 writes the metrics and the report
        summary["logged"] = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
        summary["report_md"] = (trainer.out_dir / "loka" / "loka_report.md").read_text()
        torch.save(summary, Path(out) / "summary.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict]:
    out = {}
    for forward_ne in (False, True):
        path = tmp_path_factory.mktemp(f"forward_ne_{forward_ne}")
        run_multiprocess(_train, world_size=2, args=(str(path), forward_ne), timeout=300)
        out[forward_ne] = torch.load(path / "summary.pt", weights_only=False)
    return out


def test_each_evaluation_logs_what_the_fp8_forwards_cost(runs: dict[bool, dict]) -> None:
    on = runs[True]
    assert any(p["forward"]["precision"] == "fp8" for p in on["plan"].values()), "no FP8 forward: vacuous"
    evals = [m for m in on["logged"] if "eval/ne" in m]
    assert [m["step"] for m in evals] == [10, 20, 30, 40]
    # Until the Probe judged a forward safe (after step 20 here) nothing is moved or logged.
    with_cost = [m for m in evals if "loka/ne_forwards_high" in m]
    assert [m["step"] for m in with_cost] == [30, 40]
    for m in with_cost:
        assert m["loka/ne_forwards_high"] > 0
        assert math.isclose(m["loka/forward_ne_cost"], m["eval/ne"] / m["loka/ne_forwards_high"] - 1, rel_tol=1e-9)
        # The FP8 forwards change the logits: their NE is not the high-precision forwards' NE.
        assert m["loka/forward_ne_cost"] != 0.0
    assert [e.get("ne_forwards_high") for e in on["evals"]] == [m.get("loka/ne_forwards_high") for m in evals]
    assert "NE with FP8 forwards high" in on["report_md"] and "FP8 forwards cost" in on["report_md"]


def test_the_second_evaluation_changes_nothing_the_run_trains(runs: dict[bool, dict]) -> None:
    """Two ranks, a second evaluation at steps 30 and 40: the steps after the one at step 30
    train as without it, and both ranks stay in step (a hang would time the run out)."""
    on, off = runs[True], runs[False]
    assert num_fp8(on["plan"]) > 0 and on["plan"] == off["plan"]
    losses = {b: [(m["step"], m["train/loss"]) for m in runs[b]["logged"] if "train/loss" in m] for b in runs}
    assert len(losses[True]) == 40 and losses[True] == losses[False]
    assert on["eval/ne"] == off["eval/ne"]
    assert not any("loka/ne_forwards_high" in m for m in off["logged"])
    assert "NE with FP8 forwards high" not in off["report_md"]
