"""bench.sampled_fold: plans read back from their string form, and the gaps it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sampled_fold
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan


@pytest.mark.parametrize("plan", [
    GemmPlan(),
    LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm").grad_input,
    LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton").forward,
    GemmPlan(precision="fp8", fmt="e4m3", scaling="rowwise", backend="torch_scaled_mm", fast_accum=True),
])
def test_a_plan_reads_back_from_its_string(plan: GemmPlan) -> None:
    assert sampled_fold.parse_gemm_plan(str(plan)) == plan


@pytest.mark.parametrize("text", ["fp8:e4m3", "bf16:e4m3/rowwise@triton", "fp8:e4m3/rowwise"])
def test_a_malformed_plan_names_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="expected 'high' or 'fp8:"):
        sampled_fold.parse_gemm_plan(text)


def test_the_report_compares_folded_with_unfolded_runs_per_sampled_mode(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each gap compares the runs it names, per plan file: a fold that changes the compiled
    sampled steps' losses shows there and nowhere else, at step 1 and as the largest."""
    def fake_train(*, fold: bool, sampled_compiled: bool, plans: dict, **_: object) -> dict[str, object]:
        bad = fold and sampled_compiled and "x" in plans
        losses = [1.0, 2.0 * (1.1 if bad else 1.0) * (1.001 if sampled_compiled else 1.0), 3.0 * (1.2 if bad else 1.0)]
        return {"losses": losses, "plans": {}, "missing": [], "casts_fold": True}

    monkeypatch.setattr(sampled_fold, "train", fake_train)
    (tmp_path / "mixed.json").write_text(json.dumps({"x": {}}))
    (tmp_path / "clean.json").write_text(json.dumps({}))
    result = sampled_fold.main(["--out", str(tmp_path), "--device", "cpu", "--no-graphs", "--batches", "64",
                                "--plans", f"{tmp_path / 'mixed.json'},{tmp_path / 'clean.json'}"])
    mixed = result["cases"]["mixed"]["batches"]["64"]["gaps"]
    assert mixed["fold, sampled compiled"] == {"step1": pytest.approx(0.1), "gap": pytest.approx(0.2), "step": 2}
    assert mixed["fold, sampled eager"] == {"step1": 0.0, "gap": 0.0, "step": 0}
    assert mixed["compiling the sampled steps, unfolded"]["step1"] == pytest.approx(0.001)
    assert result["cases"]["clean"]["batches"]["64"]["gaps"]["fold, sampled compiled"]["gap"] == 0.0
    saved = json.loads((tmp_path / "sampled_fold.json").read_text())
    assert saved["cases"]["mixed"]["batches"]["64"]["gaps"] == mixed
    only = sampled_fold.main(["--device", "cpu", "--no-graphs", "--batches", "64", "--sampled", "compiled"])
    assert list(only["cases"]["initial"]["batches"]["64"]["gaps"]) == ["fold, sampled compiled"]
    with pytest.raises(SystemExit, match="compiled, eager"):
        sampled_fold.main(["--sampled", "graphed"])


def test_a_run_trains_on_the_given_plans_with_the_relus_folded_as_asked(tmp_path: Path) -> None:
    """On the CPU under TRITON_INTERPRET=1 (sampled steps compiled, no graphs): the given sites
    keep their plans and backends through the run, the others the initial tensor-wise one on
    torch_scaled_mm, a site the model lacks is named, and the ReLUs fold as asked."""
    high = {"forward": "high", "grad_input": "high", "grad_weight": "high"}
    mixed = {"forward": "fp8:e4m3/tensorwise@torch_scaled_mm", "grad_input": "high", "grad_weight": "high"}
    plans = {"model.dense_arch.model._mlp.1._linear": high, "model.inter_arch.0.fmb.mlp.0": mixed,
             "model.no_such_site": high}
    run = sampled_fold.train(fold=True, sampled_compiled=True, plans=plans, batch=64, steps=2, every=1,
                             interval=2, device="cpu", graphs=False, out_dir=tmp_path)
    assert len(run["losses"]) == 2 and run["missing"] == ["model.no_such_site"] and run["casts_fold"] is True
    assert run["plans"]["model.dense_arch.model._mlp.1._linear"] == high
    assert run["plans"]["model.inter_arch.0.fmb.mlp.0"] == mixed
    assert run["plans"]["model.over_arch.model.0._mlp.0._linear"]["forward"] == "fp8:e4m3/tensorwise@torch_scaled_mm"


def test_reset_cases_drop_the_named_sites_plans_and_refuse_a_part_that_names_none() -> None:
    high = {"forward": "high"}
    cases = {"mix": {"model.dense_arch.a": high, "model.dense_arch.b": high, "model.over_arch.c": high}}
    got = sampled_fold.with_resets(cases, ["dense_arch", "over_arch.c"])
    assert got == {"mix": cases["mix"], "mix-dense_arch": {"model.over_arch.c": high},
                   "mix-over_arch.c": {"model.dense_arch.a": high, "model.dense_arch.b": high}}
    with pytest.raises(SystemExit, match="xt_proj"):
        sampled_fold.with_resets(cases, ["xt_proj"])
