"""Eval calibration on 2 gloo ranks: the ratio over the whole eval set gathered from both
ranks, logged in metrics.jsonl and the run summary with NE and AUC."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loka_train.runtime import Callback
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_data, tiny_model, tiny_trainer


class _EvalOutputs(Callback):
    """Captures the model's eval outputs on this rank and, at each eval's end, the global
    and this rank's own sum of probabilities over sum of labels, with the Trainer's figure."""

    def __init__(self) -> None:
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.records: list[dict[str, float]] = []
        self._handle: Any = None

    def _capture(self, module: Any, inputs: Any, output: Any) -> None:
        _, (_, logits_B, labels_B) = output
        self.outputs.append((logits_B.detach().float(), labels_B.detach().float()))

    def on_eval_start(self, trainer, step):  # type: ignore[no-untyped-def]
        self.outputs.clear()
        self._handle = trainer.model.register_forward_hook(self._capture)

    def on_eval_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        self._handle.remove()
        logits_N = torch.cat([o[0].reshape(-1) for o in self.outputs]).double()
        labels_N = torch.cat([o[1].reshape(-1) for o in self.outputs]).double()
        local = torch.stack([torch.sigmoid(logits_N).sum(), labels_N.sum()])
        total = local.clone()
        dist.all_reduce(total)
        self.records.append({
            "trainer": metrics["eval/calibration"],
            "global": float(total[0] / total[1]),
            "local": float(local[0] / local[1]),
            "samples": metrics["eval/samples"],
            "local_samples": float(labels_N.numel()),
        })


def _run(rank: int, world_size: int, out: str) -> dict[str, Any]:
    recorder = _EvalOutputs()
    trainer = Trainer(
        model=tiny_model(), data=tiny_data(),
        trainer=tiny_trainer(Path(out), steps=4, eval_every=2, eval_batches=4),
        callbacks=[recorder],
    )
    summary = trainer.fit()
    result: dict[str, Any] = {"records": recorder.records, "summary": summary}
    if rank == 0:
        result["logged"] = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
        result["written"] = json.loads((trainer.out_dir / "summary.json").read_text())
    return result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("eval_metrics")
    return run_multiprocess(_run, world_size=2, args=(str(out),), timeout=180)


def test_eval_calibration_is_the_ratio_over_both_ranks(two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        records = result["records"]
        assert len(records) == 2  # after steps 2 and 4
        for record in records:
            assert record["samples"] == 2 * record["local_samples"] == 2 * 4 * 32
            assert record["trainer"] == pytest.approx(record["global"], rel=1e-9), record
    # The ranks' own ratios differ from the global one, so a rank-local figure would fail above.
    local = [result["records"][-1]["local"] for result in two_ranks]
    assert all(abs(x - two_ranks[0]["records"][-1]["global"]) > 1e-6 for x in local), local


def test_eval_calibration_reaches_metrics_jsonl_and_the_summary(two_ranks: list[dict[str, Any]]) -> None:
    rank0 = two_ranks[0]
    evals = [m for m in rank0["logged"] if "eval/ne" in m]
    assert [m["step"] for m in evals] == [2, 4]
    figures = [r["trainer"] for r in rank0["records"]]
    assert [m["eval/calibration"] for m in evals] == figures
    for summary in (rank0["summary"], rank0["written"]):
        assert summary["eval/calibration"] == figures[-1]
        assert {"eval/ne", "eval/auc", "eval/calibration"} <= summary.keys()
