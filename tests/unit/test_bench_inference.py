"""bench.inference's dry run on the CPU: a short LoKA run trained, its checkpoint served as each
variant, timed per batch size and evaluated on the same held-out batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.inference import main, parse_args


def test_the_dry_run_serves_each_variant_of_one_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "inf"
    assert main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16,32", "--train-steps", "4",
                 "--decide-steps", "6", "--warmup", "1", "--iters", "3", "--rounds", "2", "--eval-batches", "2",
                 "--pairs", "2", "--pair-calls", "2",
                 "--variants", "bf16,bf16+compile,loka,loka+decided,torchao+compile", "--out", str(out)]) == 0
    result = json.loads((out / "inference.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    for name in ("bf16", "loka"):
        r = rows[name]
        assert r["status"] == "ok" and 0 < r["ne"] < 2 and 0 <= r["auc"] <= 1
        assert all(r[f"b{b}"]["samples_per_s"] > 0 and r[f"b{b}"]["p99_ms"] >= r[f"b{b}"]["p50_ms"] for b in (16, 32))
        assert all(len(r[f"b{b}"]["round_p50_ms"]) == 2 for b in (16, 32)), "one p50 per round"
    # Both read the same checkpoint and the same held-out batches.
    assert rows["loka"]["ne"] == pytest.approx(rows["bf16"]["ne"], rel=0.05)
    assert rows["torchao+compile"]["status"] == "ok" or rows["torchao+compile"]["status"].startswith("not run")
    # Ratios against the compiled reference and against bf16 with the same settings.
    for b in (16, 32):
        cell = rows["loka"][f"b{b}"]
        assert cell["speedup_vs_same"] == pytest.approx(cell["samples_per_s"] / rows["bf16"][f"b{b}"]["samples_per_s"])
        assert cell["speedup_vs_ref"] == pytest.approx(
            cell["samples_per_s"] / rows["bf16+compile"][f"b{b}"]["samples_per_s"])
    # Paired ratios: against the reference and against bf16 with the same settings, per batch size.
    for b in (16, 32):
        paired = rows["loka"][f"b{b}"]["paired_vs_ref"]
        assert len(paired["ratios"]) == 2 and paired["min"] <= paired["median"] <= paired["max"]
        assert len(rows["loka"][f"b{b}"]["paired_vs_same"]["ratios"]) == 2
        assert "paired_vs_ref" not in rows["bf16+compile"][f"b{b}"] and "paired_vs_same" not in rows["bf16"][f"b{b}"]
    # Plans re-decided per batch size (decide_for_batch): a table per batch, at its shapes.
    decided = rows["loka+decided"]
    assert decided["status"] == "ok" and sorted(decided["decisions"]) == ["b16", "b32"]
    for b in (16, 32):
        table = decided["decisions"][f"b{b}"]
        # The trained FP8 forward, another the Probe judged safe, or high precision.
        assert table and all(d["shape"][0] % b == 0 and (d["chosen"] == "high" or d["chosen"].startswith("fp8:"))
                             for d in table)
        assert decided[f"b{b}"]["speedup_vs_same"] == pytest.approx(
            decided[f"b{b}"]["samples_per_s"] / rows["bf16"][f"b{b}"]["samples_per_s"])
    # The forward-only ledger: the served FP8 forwards at each batch size and the limit they give.
    ledgers = [r for r in result["rows"] if r["status"] == "ledger"]
    by_batch = {int(k[1:]): r[k] for r in ledgers for k in r if k.startswith("b")}
    assert sorted(by_batch) == [16, 32]
    shapes = {}
    for b, entry in by_batch.items():
        # Every forward with an FP8 candidate: served in FP8, or judged safe in FP8.
        assert entry["ledger"]["rows"] and all(row["role"] == "forward" and row["fp8"]
                                               for row in entry["ledger"]["rows"])
        assert {row["site"] for row in entry["ledger"]["rows"] if row["plan"] != "high"}
        shapes[b] = {row["site"]: row["shape"] for row in entry["ledger"]["rows"]}
        # FP8 GEMMs that save nothing leave the reference's latency; None: they would save more
        # than the reference's whole latency (host-clock timings on a CPU), no limit then.
        if entry["limit_vs_ref"] is None:
            assert "of_limit" not in rows["loka"][f"b{b}"]
        else:
            assert entry["limit_vs_ref"] >= 1.0
            # Paired against the reference: the share is the paired ratio over the limit that
            # the reference's paired block p50s give (the same GEMM saving as from its p50).
            cell = rows["loka"][f"b{b}"]
            paired = cell["paired_vs_ref"]
            ref_p50 = rows["bf16+compile"][f"b{b}"]["p50_ms"]
            saved = ref_p50 * (1 - 1 / entry["limit_vs_ref"])
            assert cell["of_limit_from"] == "paired" and paired["reference_p50_ms"] > saved
            assert cell["of_limit_vs"] == pytest.approx(
                paired["reference_p50_ms"] / (paired["reference_p50_ms"] - saved))
            assert cell["of_limit"] == pytest.approx(paired["median"] / cell["of_limit_vs"])
            # And against bf16 with the same settings (eager bf16 for the eager `loka`).
            same = cell["paired_vs_same"]
            assert same is not paired and same["reference_p50_ms"] > saved
            assert cell["of_same_limit_vs"] == pytest.approx(
                same["reference_p50_ms"] / (same["reference_p50_ms"] - saved))
            assert cell["of_same_limit"] == pytest.approx(same["median"] / cell["of_same_limit_vs"])
    # Each GEMM at the shape of its batch: twice the rows at twice the batch.
    assert shapes[16].keys() == shapes[32].keys()
    assert all(shapes[32][s] == [2 * shapes[16][s][0], *shapes[16][s][1:]] for s in shapes[16])
    # Each variant timed once after its build, and profiled there: where its calls' time goes.
    for name in ("bf16", "bf16+compile", "loka"):
        for b in (16, 32):
            assert rows[name]["first_pass_p50_ms"][f"b{b}"] > 0
            profile = rows[name]["profile"][f"b{b}"]
            assert profile["host_aten_calls_per_call"] > 0 and profile["kernel_ms_per_call"] > 0
            assert set(profile["categories_ms_per_call"]) >= {"gemm", "quantize"}
    # The served sites' FP8 GEMMs show among the operators' time; bf16 has none of them.
    assert any("loka" in op["name"] for op in rows["loka"]["profile"]["b16"]["top_host_ops"])
    assert not any("loka" in op["name"] for op in rows["bf16"]["profile"]["b16"]["top_host_ops"])
    # What dynamo made of a compiled variant: one graph per dense submodule and batch size, no break.
    assert rows["bf16+compile"]["dynamo"]["graphs"] >= 2 and rows["bf16+compile"]["dynamo"]["graph_breaks"] == {}
    assert "dynamo" not in rows["bf16"]
    md = (out / "inference.md").read_text()
    assert "| dlrm | loka |" in md and "samples/s" in md and "Where a call's time goes" in md and "(paired " in md
    assert "of limit, paired; " in md and "of the same settings' limit)" in md


def test_compiled_loka_variants_alone_still_get_the_forward_ledger(tmp_path: Path) -> None:
    out = tmp_path / "inf"
    assert main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16", "--train-steps", "4",
                 "--decide-steps", "6", "--warmup", "1", "--iters", "2", "--rounds", "1", "--eval-batches", "2",
                 "--pairs", "0", "--profile-calls", "0", "--variants", "bf16+compile,loka+compile",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "inference.json").read_text())["rows"]
    ledger = [r for r in rows if r["status"] == "ledger"]
    assert len(ledger) == 1 and ledger[0]["b16"]["ledger"]["rows"]
    assert all(row["role"] == "forward" and row["fp8"] for row in ledger[0]["b16"]["ledger"]["rows"])
    # The eager model's shapes: rows a multiple of the batch (none left at 0).
    assert all(row["shape"][0] > 0 and row["shape"][0] % 16 == 0 for row in ledger[0]["b16"]["ledger"]["rows"])
    loka = next(r for r in rows if r["variant"] == "loka+compile")
    limit = ledger[0]["b16"]["limit_vs_ref"]
    # No pairs timed: the share of the limit comes from the p50s, and says so.
    assert limit is None or (loka["b16"]["of_limit"] == pytest.approx(loka["b16"]["speedup_vs_ref"] / limit)
                             and loka["b16"]["of_limit_from"] == "p50" and loka["b16"]["of_limit_vs"] == limit)


def test_the_dry_run_holds_the_ne_budget_and_serves_without_guards(tmp_path: Path) -> None:
    out = tmp_path / "inf"
    assert main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16", "--train-steps", "4",
                 "--decide-steps", "6", "--warmup", "2", "--iters", "2", "--rounds", "1", "--eval-batches", "2",
                 "--pairs", "0", "--profile-calls", "0", "--no-ledger", "--ne-budget", "0",
                 "--variants", "bf16,loka,bf16+compile+skipguards,loka+compile+skipguards,loka+gatehigh,loka+fast",
                 "--out", str(out)]) == 0
    result = json.loads((out / "inference.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert "ne_gate" not in rows["bf16"]
    for name in ("loka", "loka+compile+skipguards"):
        steps = rows[name]["ne_gate"]["b16"]
        assert steps[0]["moved"] is None and all(st["moved"] for st in steps[1:])
        # A budget of 0: FP8 forwards go until the NE is no worse than bf16's on the gate's batches.
        assert steps[-1]["ne_delta"] <= 0 or steps[-1]["fp8_forwards"] == 0
        assert all(a["ne_delta"] > 0 for a in steps[:-1])
    assert rows["loka"]["ne_gate"] == rows["loka+compile+skipguards"]["ne_gate"]
    # The gate's moves on the same checkpoint: the default takes a tensor-wise forward row-wise
    # where that is enough, +gatehigh only to high precision.
    assert any(st["to"].startswith("fp8:") for st in rows["loka"]["ne_gate"]["b16"][1:])
    high_gate = rows["loka+gatehigh"]["ne_gate"]["b16"]
    assert len(high_gate) > 1 and all(st["to"] == "high" for st in high_gate[1:])
    assert rows["loka+gatehigh"]["b16"]["speedup_vs_same"] == pytest.approx(
        rows["loka+gatehigh"]["b16"]["samples_per_s"] / rows["bf16"]["b16"]["samples_per_s"])
    # Fast accumulation is served through the gate too, against bf16 with the same settings
    # (the CPU's emulated backend accumulates in fp32 either way: the same moves and NE).
    fast_moves = [st["to"] for st in rows["loka+fast"]["ne_gate"]["b16"][1:] if st["to"].startswith("fp8:")]
    assert fast_moves and all(to.endswith("+fast") for to in fast_moves)
    assert rows["loka+fast"]["ne"] == pytest.approx(rows["loka"]["ne"], rel=1e-3)
    assert rows["loka+fast"]["b16"]["speedup_vs_same"] == pytest.approx(
        rows["loka+fast"]["b16"]["samples_per_s"] / rows["bf16"]["b16"]["samples_per_s"])
    assert rows["loka+compile+skipguards"]["ne"] == pytest.approx(rows["loka"]["ne"], rel=1e-3)
    assert rows["bf16+compile+skipguards"]["ne"] == pytest.approx(rows["bf16"]["ne"], rel=1e-3)
    assert rows["loka+compile+skipguards"]["b16"]["speedup_vs_same"] > 0
    assert "NE budget (0.0000% of bf16's NE on 2 other held-out batches)" in (out / "inference.md").read_text()
    with pytest.raises(SystemExit, match="--ne-budget"):
        parse_args(["--out", "x", "--ne-budget", "-1"])
    with pytest.raises(SystemExit, match="give --ne-budget"):
        parse_args(["--out", "x", "--variants", "loka+gatehigh+compile"])


def test_a_run_stopped_in_a_later_build_keeps_the_variants_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.inference as inference

    real = inference.build

    def build(variant, *args, **kwargs):  # type: ignore[no-untyped-def]
        if variant == "loka":  # as a time limit stops a build that takes minutes
            raise TimeoutError("stopped")
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(inference, "build", build)
    out = tmp_path / "inf"
    with pytest.raises(TimeoutError):
        main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16", "--train-steps", "4",
              "--decide-steps", "6", "--warmup", "1", "--iters", "2", "--rounds", "1", "--eval-batches", "1",
              "--pairs", "0", "--profile-calls", "0", "--no-ledger", "--variants", "bf16,loka", "--out", str(out)])
    (row,) = json.loads((out / "inference.json").read_text())["rows"]
    assert row["variant"] == "bf16" and row["status"] == "ok" and row["first_pass_p50_ms"]["b16"] > 0
    assert "| dlrm | bf16 | first pass p50" in (out / "inference.md").read_text()


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(SystemExit, match="unknown"):
        parse_args(["--out", "x", "--variants", "fp4"])
    with pytest.raises(SystemExit, match="--configs: unknown"):
        parse_args(["--out", "x", "--configs", "resnet"])


def test_the_compiled_variants_get_the_recompiles_they_need_and_never_run_eagerly_unseen() -> None:
    import torch

    from bench.inference import allow_compiles

    args = parse_args(["--out", "x", "--batches", "512,2048,8192",
                       "--variants", "bf16+compile,bf16+compile+graphs,loka+compile,loka+decided+compile"])
    before = torch._dynamo.config.recompile_limit
    with allow_compiles(args):
        # 4 compiled variants x 3 batch sizes: each one more cache entry of the shared tower code.
        assert torch._dynamo.config.recompile_limit >= 12 and torch._dynamo.config.fail_on_recompile_limit_hit
    assert torch._dynamo.config.recompile_limit == before


def test_a_profile_that_records_no_kernel_leaves_the_timings_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    import bench.e2e.measure as measure
    from bench.inference import profile_calls, render

    def no_kernel(clock, median_ms):  # type: ignore[no-untyped-def]
        raise RuntimeError("the profiler recorded no CUDA kernel (CUPTI unavailable?)")

    monkeypatch.setattr(measure, "summarize_profile", no_kernel)

    class Model(nn.Module):
        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return dense.sum(-1)

    from types import SimpleNamespace

    batch = SimpleNamespace(dense_features=torch.randn(4, 3), sparse_features=None)
    got = profile_calls(Model(), [batch], 2, torch.device("cpu"), 1.0)
    assert got == {"error": "the profiler recorded no CUDA kernel (CUPTI unavailable?)"}
    cell = {"samples_per_s": 4.0, "p50_ms": 1.0, "p99_ms": 1.0}
    row = {"config": "dlrm", "variant": "bf16", "status": "ok", "b4": cell, "ne": 0.7, "auc": 0.8,
           "first_pass_p50_ms": {"b4": 1.0}, "profile": {"b4": got}}
    text = render({"device": "CPU", "command": "x", "args": {"batch_sizes": [4], "eval_batches": 1}, "rows": [row]})
    assert "| dlrm | bf16 | 4 | not profiled: the profiler recorded no CUDA kernel" in text


def test_paired_ratios_cancel_a_drift_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    import bench.inference as inference

    reference, model = nn.Identity(), nn.Identity()
    order: list[str] = []

    def fake_time_calls(which, batches, calls, device):  # type: ignore[no-untyped-def]
        # The machine slows down pair after pair; within a pair both see the same state. The
        # model takes half the reference's time.
        order.append("ref" if which is reference else "model")
        slow = 1.0 + (len(order) - 1) // 4  # per pair: an untimed call and a block, twice
        return [(2e-3 if which is reference else 1e-3) * slow] * calls

    monkeypatch.setattr(inference, "time_calls", fake_time_calls)
    got = inference.paired_ratio(reference, model, [None], 4, 3, torch.device("cpu"))
    assert got["ratios"] == [pytest.approx(2.0)] * 4 and got["median"] == pytest.approx(2.0)
    # One untimed call before each block, the order alternating from pair to pair.
    blocks = order[1::2]
    assert blocks == ["ref", "model", "model", "ref", "ref", "model", "model", "ref"]


def test_every_variant_serves_the_same_quantized_tables(tmp_path: Path) -> None:
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    import bench.inference as inference

    seen: list[object] = []
    real = inference.time_calls

    def recording(model, batches, calls, device):  # type: ignore[no-untyped-def]
        # The lookup each timed call runs, and whether its tables are quantized then.
        seen.append((model.sparse_arch, any(isinstance(m, QuantEmbeddingBagCollection)
                                            for m in model.sparse_arch.modules())))
        return real(model, batches, calls, device)

    out = tmp_path / "inf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inference, "time_calls", recording)
        assert main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16", "--train-steps", "4",
                     "--decide-steps", "4", "--warmup", "1", "--iters", "2", "--rounds", "1", "--eval-batches", "2",
                     "--pairs", "0", "--profile-calls", "0", "--no-ledger", "--embeddings", "int8",
                     "--variants", "bf16,loka,loka+decided", "--out", str(out)]) == 0
    # One lookup module for all, its tables in TorchRec's int8 inference module.
    assert len({id(m) for m, _ in seen}) == 1 and all(quantized for _, quantized in seen)
    result = json.loads((out / "inference.json").read_text())
    assert result["args"]["embeddings"] == "int8" and "int8, TorchRec inference modules" in (out / "inference.md").read_text()


def test_a_run_stopped_after_the_rounds_keeps_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.inference as inference

    def stopped(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt  # a time limit, as the paired ratios start

    monkeypatch.setattr(inference, "paired_ratio", stopped)
    out = tmp_path / "inf"
    with pytest.raises(KeyboardInterrupt):
        main(["--dry-run", "--device", "cpu", "--configs", "dlrm", "--batches", "16", "--train-steps", "4",
              "--decide-steps", "4", "--warmup", "1", "--iters", "2", "--rounds", "1", "--eval-batches", "2",
              "--pairs", "2", "--variants", "bf16+compile,loka", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads((out / "inference.json").read_text())["rows"]}
    # The rounds' figures and ratios were written before the pairs; no profile ran yet.
    assert rows["loka"]["b16"]["p50_ms"] > 0 and "speedup_vs_ref" in rows["loka"]["b16"]
    assert "paired_vs_ref" not in rows["loka"]["b16"] and "profile" not in rows["loka"]
    assert "| dlrm | loka |" in (out / "inference.md").read_text()


def test_the_seed_trains_another_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import bench.inference as inference
    from bench.e2e.variants import Composer

    jobs = []
    monkeypatch.setattr(inference, "run_job", jobs.append)  # the jobs as composed, not run
    args = parse_args(["--out", "x", "--dry-run", "--device", "cpu", "--configs", "dlrm", "--seed", "3"])
    with contextlib.ExitStack() as stack:
        job, _ = inference.train_run(Composer(stack), args, "dlrm", tmp_path)
    # The bf16 run and the LoKA decision resuming it: both with the seed.
    assert len(jobs) == 2 and jobs[1] is job and {j.trainer.seed for j in jobs} == {3}
    with pytest.raises(SystemExit, match="--seed"):
        parse_args(["--out", "x", "--seed", "-1"])


def test_the_limit_shares_take_each_limit_from_the_timings_they_compare() -> None:
    from bench.inference import _of_limit

    class Ledger:  # FP8 GEMMs that save 1 ms of the reference's latency
        def predict(self, ms: float, *, planned_step: bool) -> dict[str, float]:
            assert not planned_step
            return {"quant_free": ms / (ms - 1.0) if ms > 1.0 else math.inf}

    # Paired: the limit from the reference's paired block p50s (5 ms: 1.25x), not its p50 (3 ms).
    cell = {"speedup_vs_ref": 0.9, "paired_vs_ref": {"median": 1.2, "reference_p50_ms": 5.0},
            "paired_vs_same": {"median": 1.05, "reference_p50_ms": 4.0}}
    _of_limit(cell, Ledger(), 3.0)  # type: ignore[arg-type]
    assert (cell["of_limit_from"], cell["of_limit_vs"]) == ("paired", 1.25)
    assert cell["of_limit"] == pytest.approx(1.2 / 1.25)
    assert cell["of_same_limit_vs"] == pytest.approx(4.0 / 3.0)
    assert cell["of_same_limit"] == pytest.approx(1.05 / (4.0 / 3.0))
    # Unpaired: the ratio of p50s over the limit from the reference's p50; no same-settings share.
    cell = {"speedup_vs_ref": 0.9}
    _of_limit(cell, Ledger(), 3.0)  # type: ignore[arg-type]
    assert (cell["of_limit_from"], cell["of_limit_vs"]) == ("p50", 1.5)
    assert cell["of_limit"] == pytest.approx(0.9 / 1.5) and "of_same_limit" not in cell
    # A saving past the reference's latency gives no limit and no share.
    cell = {"speedup_vs_ref": 0.9}
    _of_limit(cell, Ledger(), 0.5)  # type: ignore[arg-type]
    assert "of_limit" not in cell
