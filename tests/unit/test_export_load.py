"""``loka_train.export.load_trained``: a run's checkpoint read back unsharded with its LoKA plans,
served, and evaluated to the run's own closing NE (one CPU process, emulated FP8)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from loka_train.data import DataConfig, make_dataset
from loka_train.data.metrics import normalized_entropy
from loka_train.export import ExportConfig, ServeConfig, load_trained, serve, served_sites
from loka_train.export.run import export_run
from loka_train.job import JobConfig, run_job
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.models.config import ModelConfig
from loka_train.mods import sites
from loka_train.plugin.config import LokaConfig
from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.config import TrainerConfig


def _job(out_dir: Path) -> JobConfig:
    return JobConfig(
        model=ModelConfig(kind="dlrm", embedding_dim=8, dense_arch_layer_sizes=[32, 8],
                          over_arch_layer_sizes=[64, 32, 1]),
        data=DataConfig(kind="synthetic", num_embeddings=200, chunk_size=32),
        trainer=TrainerConfig(steps=12, batch_size=64, device="cpu", eval_batches=2, log_every=12,
                              out_dir=str(out_dir), checkpoint_at_end=True, tensorboard=False,
                              progress_bar=False, dense_lr=0.1, sparse_lr=0.1),
        # Every site sampled every step and a re-plan every 4 steps, so the run ends with FP8
        # plans (tensor-wise ones with the preset's static scales).
        loka=LokaConfig.preset("aggressive", probe={"every_k_steps": 1, "interval": 4, "min_samples": 2}),
    )


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobConfig, Path, dict]:
    out = tmp_path_factory.mktemp("runs")
    job = _job(out)
    summary = run_job(job)
    # launch/train.py writes the composed config there (run_job alone does not).
    (out / "latest" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return job, out / "latest", summary


def _eval_ne(job: JobConfig, model: torch.nn.Module) -> float:
    data = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=job.trainer.batch_size)
    logits, labels = [], []
    with torch.no_grad():
        for batch in data.batches(0, job.trainer.eval_batches):
            _, (_, logits_B, labels_B) = model(batch)
            logits.append(logits_B.float())
            labels.append(labels_B.float())
    return normalized_entropy(torch.cat(logits), torch.cat(labels))


def test_a_run_is_served_with_its_plans_and_evaluates_to_its_own_ne(trained_run) -> None:  # type: ignore[no-untyped-def]
    job, run, summary = trained_run
    trained = load_trained(job, run)
    report = json.loads((run / "loka" / "loka_report.json").read_text())
    assert trained.step == 12 and trained.checkpoint.name == "step_00000012"
    # The plans Dispatch held at the end, site by site.
    assert {n: {r: str(getattr(p, r)) for r in ("forward", "grad_input", "grad_weight")}
            for n, p in trained.plans.items()} == {
        n: {r: e["plan"] for r, e in roles.items()} for n, roles in report["sites"].items()}
    fp8 = [n for n, p in trained.plans.items() if p.forward.is_fp8]
    assert fp8, "the run should end with FP8 forwards"
    # The Probe's forward verdicts at the end, with the run's Dispatch config: each trained FP8
    # forward among the safe ones (re-decision's candidates).
    safe = trained.safe_forwards
    assert safe is not None and safe.config == job.loka.dispatch
    assert {k[1] for k in safe.verdicts} == {"forward"} and {k[0] for k in safe.verdicts} == set(trained.plans)
    for n in fp8:
        forward = trained.plans[n].forward
        assert safe.verdicts[(n, "forward", forward.fmt, forward.scaling)].safe, n
    # Static scales restored from the Probe's window, as a resumed run restores them.
    static = [n for n, site in sites(trained.model).items()
              if site.static_slots is not None and trained.plans[n].forward.scaling is Scaling.TENSORWISE]
    assert static and all(float(sites(trained.model)[n].static_slots[0, 0]) > 0 for n in static)
    served = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="fp32"))
    assert all(served_sites(served)[n].endswith("weight quantized once") for n in fp8
               if served_sites(served)[n].startswith("fp8") and "bmm" not in n)
    # Its forward is the trained model's: the run's closing evaluation (NE to 1e-6).
    assert _eval_ne(job, served) == pytest.approx(summary["eval/ne"], rel=1e-6)
    # All-high plans on the same weights give another NE: the plans carried over matter.
    high = load_trained(job, run)
    serve(high.model, plans={n: LinearPlan() for n in high.plans}, config=ServeConfig(dtype="fp32"))
    assert _eval_ne(job, high.model) != _eval_ne(job, served)


def test_a_checkpoint_of_another_job_or_none_is_refused_with_the_fix(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job, run, _ = trained_run
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        load_trained(job, tmp_path)
    wider = replace(job, model=replace(job.model, over_arch_layer_sizes=[128, 32, 1]))
    with pytest.raises(CheckpointError, match="does not hold this job's model"):
        load_trained(wider, run)


def test_the_export_job_writes_what_it_measured_and_its_state_dict_serves_again(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from launch.export import report, run_config

    job, run, summary = trained_run
    read = run_config(str(run))  # the run's own config.yaml, read back
    assert (read.model, read.data, read.trainer, read.loka.mods) == (job.model, job.data, job.trainer, job.loka.mods)
    out = tmp_path / "export"
    result = export_run(job, ExportConfig(run=str(run), out=str(out)))  # the run's dtype: fp32
    assert result["serve"]["dtype"] == "fp32" and result["step"] == 12
    assert result["metrics"]["served"]["ne"] == pytest.approx(summary["eval/ne"], rel=1e-6)
    assert result["metrics"]["served"]["ne"] != result["metrics"]["high"]["ne"]
    assert json.loads((out / "export.json").read_text())["metrics"] == result["metrics"]
    assert sorted(Path(p).name for p in result["programs"]) == ["dense_arch.pt2", "inter_arch.pt2", "over_arch.pt2"]
    names = {r["site"] for r in result["numerics"]}
    assert names and names <= set(result["sites"]) and "local SQNR dB" in (out / "numerics.md").read_text()
    assert "NE" in report(result) and str(out) in report(result) and "3 in dense/" in report(result)
    # served.pt loads into the model load_trained and serve rebuild, and computes the same.
    saved = torch.load(out / "served.pt", weights_only=False)
    again = load_trained(job, run)
    serve(again.model, plans={n: LinearPlan.from_dict(p) for n, p in saved["plans"].items()},
          config=ServeConfig(**saved["serve"]))
    again.model.load_state_dict(saved["state_dict"])
    assert any(k.endswith(".served.w_data") for k in saved["state_dict"])
    data = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=job.trainer.batch_size)
    batch = next(iter(data.batches(0, 1)))
    fresh = load_trained(job, run)
    serve(fresh.model, plans=fresh.plans, config=ServeConfig(dtype="fp32"))
    with torch.no_grad():
        assert torch.equal(again.model(batch)[1][1], fresh.model(batch)[1][1])


def test_a_run_config_from_another_version_names_the_fix(tmp_path: Path, trained_run) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from launch.export import run_config

    _, run, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run.resolve(), copy)
    text = (copy / "config.yaml").read_text().replace("trainer:\n", "trainer:\n  retired_field: 1\n", 1)
    (copy / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match="does not fit this loka_train's JobConfig .*retired_field"):
        run_config(str(copy))
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        run_config(str(tmp_path / "nothing"))


def test_the_config_a_run_resumed_with_before_the_checkpoint_is_the_one_read(tmp_path: Path, trained_run) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from launch.export import run_config

    _, run, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run.resolve(), copy)
    text = (copy / "config.yaml").read_text()
    (copy / "config.resumed_00000010.yaml").write_text(text.replace("eval_batches: 2", "eval_batches: 3", 1))
    (copy / "config.resumed_00000020.yaml").write_text(text.replace("eval_batches: 2", "eval_batches: 5", 1))
    assert run_config(str(copy)).trainer.eval_batches == 3  # resumed at 10, the checkpoint is at 12


def test_the_served_dense_submodules_export_as_programs_for_any_batch(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from loka_train.export import export_dense, install_programs, load_programs, save_programs
    from loka_train.runtime.graphs import DENSE_SUBMODULES, dense_submodules

    job, run, _ = trained_run
    trained = load_trained(job, run)
    served = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="fp32")).model
    example = next(iter(make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=64).batches(0, 1)))
    programs = export_dense(served, example, autocast=None)
    assert sorted(programs) == ["dense_arch", "inter_arch", "over_arch"]
    save_programs(programs, tmp_path / "dense")
    # Installed in a fresh copy of the model, the programs compute the served model's logits as
    # torch.compile traces it, bit for bit, at another batch size too (the batch dimension is
    # dynamic). (On the CPU a traced tensor-wise cast takes its dynamic scale, the eager one the
    # static scale: loka.mods.static_scales.)
    compiled = serve(load_trained(job, run).model, plans=trained.plans, config=ServeConfig(dtype="fp32")).model
    for module in dense_submodules(compiled, DENSE_SUBMODULES, setting="test", verb="compile").values():
        module.compile(backend="aot_eager", dynamic=False)
    fresh = load_trained(job, run).model.model
    install_programs(fresh, load_programs(tmp_path / "dense"))
    assert not sites(fresh), "the programs replace the sites"
    other = next(iter(make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=96).batches(0, 1)))
    with torch.no_grad():
        for batch in (example, other):
            assert torch.equal(fresh(batch.dense_features, batch.sparse_features),
                               compiled(batch.dense_features, batch.sparse_features))
    # The FP8 forwards are in the programs: all-high plans on the same weights compute otherwise.
    high = serve(load_trained(job, run).model, plans={n: LinearPlan() for n in trained.plans},
                 config=ServeConfig(dtype="fp32")).model
    with torch.no_grad():
        assert not torch.equal(high(other.dense_features, other.sparse_features),
                               fresh(other.dense_features, other.sparse_features))
    with pytest.raises(ValueError, match="name no dense submodule"):
        install_programs(fresh, {"tower": programs["over_arch"]})
    with pytest.raises(FileNotFoundError, match="save_programs"):
        load_programs(tmp_path / "none")


def test_an_exported_program_compiles_into_an_aot_inductor_package(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from loka_train.export import aoti_package, export_dense

    job, run, _ = trained_run
    trained = load_trained(job, run)
    served = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="fp32")).model
    example = next(iter(make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=64).batches(0, 1)))
    program = export_dense(served, example, autocast=None)["dense_arch"]
    assert any(p.forward.is_fp8 for n, p in trained.plans.items() if n.startswith("model.dense_arch"))
    package = torch._inductor.aoti_load_package(str(aoti_package(program, tmp_path / "dense_arch.pt2")))
    x = torch.rand(40, example.dense_features.shape[1]) * 4
    with torch.no_grad():
        assert torch.equal(package(x), program.module()(x))


@pytest.mark.parametrize("fp8_faster", [True, False])
def test_the_export_serves_plans_re_decided_for_its_batch(
    trained_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp8_faster: bool,  # type: ignore[no-untyped-def]
) -> None:
    from loka_train.dispatch.ledger import Fp8Times, Ledger, LedgerRow
    from loka_train.export import decide as decide_module

    def ledger(gemms, *, device, timer=None, static_scales=False):  # type: ignore[no-untyped-def]
        # Every FP8 candidate 0.2 ms (or 2.2 ms) against bf16's 1 ms.
        gemm_ms = 0.1 if fp8_faster else 2.1
        return Ledger(rows=[LedgerRow(site=g.site, role=g.role, shape=g.shape, plan=str(g.plan) if g.plan.is_fp8 else "high",
                                      high_ms=1.0, fp8=tuple(Fp8Times(plan=str(p), gemm_ms=gemm_ms, quant_a_ms=0.1,
                                                                      quant_b_ms=0.0) for p in g.candidates))
                            for g in gemms], device="cpu", timing="fake")

    monkeypatch.setattr(decide_module, "measure_ledger", ledger)
    from loka_train.export import run as run_module

    given: list[dict[str, object]] = []
    real = run_module.decide_for_batch

    def decide(*args, **kwargs):  # type: ignore[no-untyped-def]
        given.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "decide_for_batch", decide)
    job, run, _ = trained_run
    out = tmp_path / "export"
    result = export_run(job, ExportConfig(run=str(run), out=str(out), decide_batch=64, programs=False))
    # The run's safe forwards are candidates, costed as the export serves the weights.
    (kwargs,) = given
    assert kwargs["safe"] is not None and kwargs["safe"].verdicts and kwargs["quantize_weights_once"] is True
    decided = {d["site"]: d for d in result["decisions"]}
    trained = load_trained(job, run)
    # Every site the call reached with a safe FP8 forward or a trained one was decided, at batch 64.
    assert decided and all(d["shape"][0] % 64 == 0 for d in decided.values())
    assert {n for n, p in trained.plans.items() if p.forward.is_fp8} <= set(decided)
    # The served plans are the decisions, and the metrics are theirs.
    forwards = {n: LinearPlan.from_dict(p).forward for n, p in result["plans"].items()}
    assert {n: str(f) if f.is_fp8 else "high" for n, f in forwards.items() if n in decided} == {
        n: d["chosen"] for n, d in decided.items()}
    assert all(d["chosen"] != "high" for d in decided.values()) if fp8_faster else not any(
        d["chosen"] != "high" for d in decided.values())
    if not fp8_faster:  # every site in high precision: the served model is the high-precision one
        assert result["metrics"]["served"]["ne"] == pytest.approx(result["metrics"]["high"]["ne"], rel=1e-6)
    assert "| chosen |" in (out / "decisions.md").read_text()
    from launch.export import report

    changed = sum(d["chosen"] != d["trained"] for d in decided.values())
    assert f"re-decided for batch 64: {changed} of {len(decided)} timed forwards changed" in report(result)
    with pytest.raises(ValueError, match="decide_batch"):
        ExportConfig(decide_batch=0)
    with pytest.raises(ValueError, match="decide_batch=16: data.chunk_size=32 does not divide"):
        export_run(job, ExportConfig(run=str(run), out=str(out), decide_batch=16, programs=False))


@pytest.mark.parametrize(("embeddings", "rel"), [("fp16", 1e-4), ("int8", 5e-3)])
def test_the_tables_serve_in_torchrecs_inference_modules(
    trained_run, tmp_path: Path, embeddings: str, rel: float,  # type: ignore[no-untyped-def]
) -> None:
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    from loka_train.export import serve_embeddings

    job, run, summary = trained_run
    trained = load_trained(job, run)
    served = serve(trained.model, plans=trained.plans, config=ServeConfig(dtype="fp32", embeddings=embeddings))
    quantized = [m for m in served.modules() if isinstance(m, QuantEmbeddingBagCollection)]
    assert quantized and not any(type(m).__name__ == "EmbeddingBagCollection" and m not in quantized
                                 for m in served.modules())
    # Their lookups round the tables: NE moves, within the format's rounding.
    ne = _eval_ne(job, served)
    assert ne == pytest.approx(summary["eval/ne"], rel=rel) and ne != summary["eval/ne"]
    assert not any(m.training for q in quantized for m in q.modules())
    # Serving it again (other plans, the same tables) leaves the quantized tables as they are;
    # another format is refused (the tables are quantized already).
    assert serve_embeddings(served, embeddings) == len(quantized)
    with pytest.raises(ValueError, match="already serve in"):
        serve_embeddings(served, "int8" if embeddings == "fp16" else "fp16")
    serve(served, plans=trained.plans, config=ServeConfig(dtype="fp32", embeddings=embeddings))
    assert _eval_ne(job, served) == ne
    # The export serves both of its models so: their NE difference is the FP8 sites' alone.
    result = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "e"), programs=False, embeddings=embeddings))
    assert result["serve"]["embeddings"] == embeddings
    from launch.export import report

    assert f"served (fp32, {embeddings} tables in TorchRec's inference modules)" in report(result)
    assert result["metrics"]["served"]["ne"] == pytest.approx(ne, rel=1e-6)
    high = load_trained(job, run)
    serve(high.model, plans={n: LinearPlan() for n in high.plans}, config=ServeConfig(dtype="fp32",
                                                                                      embeddings=embeddings))
    assert result["metrics"]["high"]["ne"] == pytest.approx(_eval_ne(job, high.model), rel=1e-6)
    # served.pt loads into the model load_trained and serve rebuild with its serve config.
    saved = torch.load(tmp_path / "e" / "served.pt", weights_only=False)
    again = load_trained(job, run)
    serve(again.model, plans={n: LinearPlan.from_dict(p) for n, p in saved["plans"].items()},
          config=ServeConfig(**saved["serve"]))
    assert [type(m) for m in again.model.modules() if isinstance(m, QuantEmbeddingBagCollection)]
    again.model.load_state_dict(saved["state_dict"])
    assert _eval_ne(job, again.model) == pytest.approx(ne, rel=1e-6)


def test_tables_without_a_collection_or_in_another_format_name_the_fix() -> None:
    from loka_train.export import serve_embeddings

    with pytest.raises(ValueError, match="embeddings='int4': choose one of"):
        ServeConfig(embeddings="int4")
    with pytest.raises(ValueError, match="export embeddings='bf8'"):
        ExportConfig(embeddings="bf8")
    with pytest.raises(ValueError, match="no TorchRec EmbeddingBagCollection"):
        serve_embeddings(torch.nn.Linear(2, 2), "fp16")
    with pytest.raises(ValueError, match="choose one of \\['fp16', 'int8'\\]"):
        serve_embeddings(torch.nn.Linear(2, 2), "trained")


def _tensorwise_forwards_cost_ne(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each tensor-wise FP8 forward of an evaluated model adds 0.1% to its NE: a model this
    small, judged on 128 samples, may come out ahead of high precision by chance, where the
    gate then has nothing to hold. With the cost, the served model is behind by about
    0.1% a tensor-wise forward, whatever the rounding of the machine."""
    import loka_train.export.run as run_module

    evaluate = run_module._evaluate

    def costed(model, batches, autocast):  # type: ignore[no-untyped-def]
        got = evaluate(model, batches, autocast)
        tensorwise = sum(1 for s in sites(model).values()
                         if s.plan.forward.is_fp8 and s.plan.forward.scaling is Scaling.TENSORWISE)
        return {**got, "ne": got["ne"] * (1 + 1e-3 * tensorwise)}

    monkeypatch.setattr(run_module, "_evaluate", costed)


def test_the_export_serves_and_records_fast_accumulation(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job, run, _ = trained_run
    plain = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "plain"), programs=False))
    fast = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "fast"), programs=False, fast_accum=True))
    forwards = {n: LinearPlan.from_dict(p).forward for n, p in fast["plans"].items()}
    trained = {n: LinearPlan.from_dict(p).forward for n, p in plain["plans"].items()}
    assert any(f.is_fp8 for f in trained.values()) and fast["serve"]["fast_accum"] is True
    # Every served FP8 forward and its record take it (the CPU's emulated backend has it for
    # every scaling and accumulates in fp32 either way: the same metrics).
    assert forwards == {n: f.with_fast_accum() for n, f in trained.items()}
    assert all(f.fast_accum for f in forwards.values() if f.is_fp8)
    assert fast["metrics"]["served"]["ne"] == pytest.approx(plain["metrics"]["served"]["ne"], rel=1e-6)


def test_the_export_holds_the_ne_budget_on_batches_it_does_not_report(trained_run, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from launch.export import report

    _tensorwise_forwards_cost_ne(monkeypatch)
    job, run, _ = trained_run
    plain = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "plain"), programs=False))
    result = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "gated"), programs=False, ne_budget=0.0))
    gate = result["ne_gate"]
    assert gate[0]["moved"] is None and result["ne_budget"] == 0.0 and plain["ne_gate"] == []
    # Judged on the held-out batches after the reported ones: another NE difference as served.
    assert gate[0]["ne_delta"] != pytest.approx(plain["ne_delta_rel_vs_high"], rel=1e-6)
    moved = [st["moved"] for st in gate[1:]]
    assert gate[-1]["ne_delta"] <= 0 or gate[-1]["fp8_forwards"] == 0
    # The served plans are the gate's: each moved site's forward where the gate left it (row-wise
    # or high precision), the rest as trained.
    now = {st["moved"]: st["to"] for st in gate[1:]}
    forwards = {n: str(LinearPlan.from_dict(p).forward) for n, p in result["plans"].items()}
    trained = {n: str(LinearPlan.from_dict(p).forward) for n, p in plain["plans"].items()}
    assert forwards == {**trained, **now} and sum(f != "high" for f in forwards.values()) == gate[-1]["fp8_forwards"]
    assert all(result["sites"][n].startswith("fp8") == (to != "high") for n, to in now.items())
    if moved:
        assert result["metrics"]["served"]["ne"] != plain["metrics"]["served"]["ne"]
        assert "| 1 |" in (tmp_path / "gated" / "gate.md").read_text()
        assert f"{len(moved)} FP8 forward(s) moved to hold it ({moved[0]} to {gate[1]['to']}" in report(result)
    # A budget just under the NE as served: one move, a tensor-wise forward gone row-wise here,
    # and the served plans carry it.
    near = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "near"), programs=False,
                                        ne_budget=0.99 * gate[0]["ne_delta"]))
    (step,) = near["ne_gate"][1:]
    rowwise_within = [(n, to) for n, moves in step["tried"].items() for to, d in moves.items()
                      if to != "high" and d <= near["ne_budget"]]
    assert step["to"].startswith("fp8:e4m3/rowwise") and (step["moved"], step["to"]) in rowwise_within
    assert step["fp8_forwards"] == gate[0]["fp8_forwards"]
    assert str(LinearPlan.from_dict(near["plans"][step["moved"]]).forward) == step["to"]
    assert near["sites"][step["moved"]].startswith("fp8")
    # A gate that ends over its budget says why.
    stuck = {**near, "ne_gate": [*near["ne_gate"][:-1], {**step, "ne_delta": 1.0}]}
    assert "+100.0000% of high precision's on the gate's own held-out batches (over the budget: no move of the FP8 " \
           "forwards left lowers it)" in report(stuck)
    assert "(over the budget: no FP8 forward left)" in report(
        {**stuck, "ne_gate": [*near["ne_gate"][:-1], {**step, "ne_delta": 1.0, "fp8_forwards": 0}]})
    assert "over the budget" not in report(near) and "failed" not in report(near)
    # Stopped in its first round: no forward moved; a row-wise move that failed is counted.
    first = {**near["ne_gate"][0], "ne_delta": 1.0}
    stopped = {**near, "ne_gate": [first, {**first, "tried": step["tried"], "failed": {"x": "RuntimeError: no"}}]}
    assert "no FP8 forward moved, NE +100.0000%" in report(stopped)
    assert "(over the budget: no move of the FP8 forwards left lowers it); 1 row-wise move(s) failed" in report(stopped)
    lenient = export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "lenient"), programs=False, ne_budget=1.0))
    assert [st["moved"] for st in lenient["ne_gate"]] == [None] and "within it as served" in report(lenient)
    assert lenient["plans"] == plain["plans"]
    with pytest.raises(ValueError, match="ne_budget"):
        ExportConfig(ne_budget=-0.1)


def test_the_ne_gate_names_the_fix_where_the_eval_split_is_too_short(
    trained_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    from loka_train.export import run as run_module

    class Short:  # an eval split of exactly the evaluated batches
        def __init__(self, data) -> None:  # type: ignore[no-untyped-def]
            self.data = data

        def batches(self, start: int = 0, num_steps: int | None = None):  # type: ignore[no-untyped-def]
            return iter([]) if start else self.data.batches(start, num_steps)

    real = run_module.make_dataset
    monkeypatch.setattr(run_module, "make_dataset", lambda *a, **k: Short(real(*a, **k)))
    job, run, _ = trained_run
    with pytest.raises(ValueError, match="lower eval_batches to 1 or less"):
        export_run(job, ExportConfig(run=str(run), out=str(tmp_path / "x"), programs=False, ne_budget=1e-4))
