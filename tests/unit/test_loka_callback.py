"""The LoKA callback on one CPU process, driven through a RunContext: report schedule, config
validation, and a resume whose dispatch config no longer allows the checkpointed plans."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from loka_train.dispatch import DispatchConfig
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.roles import ROLES
from loka_train.mods.config import ModsConfig
from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import LokaConfig
from loka_train.probe.config import ProbeConfig
from loka_train.runtime.context import RunContext
from loka_train.utils.console import is_table


def _started(config: LokaConfig, out_dir: Path) -> tuple[LokaCallback, RunContext]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=out_dir)
    cb = LokaCallback(config)
    cb.on_before_shard(ctx)
    cb.on_train_start(ctx)
    return cb, ctx


def _config(**overrides) -> LokaConfig:  # type: ignore[no-untyped-def]
    base = dict(
        enabled=True,
        probe=ProbeConfig(every_k_steps=1, interval=50, window=4),
        mods=ModsConfig(enabled=True),
    )
    base.update(overrides)
    return LokaConfig(**base)  # type: ignore[arg-type]


def _all_fp8_checkpoint(tmp_path: Path) -> tuple[LinearPlan, dict]:
    """A started callback's state at step 29 with every GEMM of every site on one FP8 plan."""
    first, _ = _started(_config(), tmp_path)
    fp8 = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="emulated")
    assert first.dispatcher is not None and first.probe is not None
    for name, site in first.sites.items():
        first.dispatcher.plans[name] = fp8
        site.set_plan(fp8)
    first.probe.begin_step(29)
    return fp8, first.state_dict()


def _resumed(config: LokaConfig, state: dict, out_dir: Path) -> LokaCallback:
    """A callback of `config` resumed from `state` on a fresh model, started."""
    resumed = LokaCallback(config)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=out_dir)
    resumed.on_before_shard(ctx)
    resumed.load_state_dict(state)
    resumed.on_train_start(ctx)
    return resumed


def test_report_every_fires_independently_of_the_probe_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cb, ctx = _started(_config(report_every=10), tmp_path)
    written: list[int] = []
    step_now = [0]
    monkeypatch.setattr(cb, "write_report", lambda trainer: written.append(step_now[0]))
    for step in range(120):
        step_now[0] = step
        cb.on_step_start(ctx, step)
        cb.on_step_end(ctx, step, {})
    assert written == list(range(9, 120, 10))


def test_report_before_the_first_interval_is_written(tmp_path: Path) -> None:
    cb, ctx = _started(_config(report_every=3), tmp_path)
    for step in range(3):
        cb.on_step_start(ctx, step)
        cb.on_step_end(ctx, step, {})
    assert (tmp_path / "loka" / "loka_report.json").exists()


def test_report_every_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="report_every=-5 must be >= 0"):
        LokaConfig(report_every=-5)
    assert LokaConfig(report_every=0).report_every == 0


def test_resume_resets_plans_the_new_dispatch_config_does_not_allow(tmp_path: Path) -> None:
    """A checkpoint whose plans are all FP8, resumed with dispatch off: every site runs its
    initial (high-precision) plan, and the resets are in the history and the report."""
    _, state = _all_fp8_checkpoint(tmp_path)
    resumed = _resumed(_config(dispatch=DispatchConfig(enabled=False)), state, tmp_path)
    assert resumed.sites and resumed.dispatcher is not None
    for name, site in resumed.sites.items():
        assert not site.has_fp8(), name
        assert resumed.dispatcher.plans[name] == LinearPlan.high_precision()
    assert resumed.dispatcher.fp8_coverage() == 0.0
    assert resumed.dispatcher.num_changes == len(resumed.sites) * len(ROLES)
    assert all(c.step == 29 and "enabled=false" in c.reason for c in resumed.dispatcher.history)
    report = resumed.report()
    assert report["plan_changes"] == len(resumed.sites) * len(ROLES)
    row = next(iter(report["sites"].values()))["forward"]
    assert "enabled=false" in row["why"] and len(row["history"]) == 1


def test_the_ledger_is_measured_logged_and_written_at_the_end(tmp_path: Path, capsys, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="loka_train.plugin.callback")
    cb, ctx = _started(_config(ledger=True), tmp_path)
    x = torch.randn(8, 16)
    for step in range(3):
        cb.on_step_start(ctx, step)
        ctx.model(x).sum().backward()
        cb.on_step_end(ctx, step, {})
    assert cb.dispatcher is not None
    assert not any(cb.dispatcher.shapes.values())  # no interval yet: the ledger reads the sites
    summary = {"train/steps_per_s": 50.0}
    cb.on_train_end(ctx, summary)
    assert cb.ledger is not None and cb.step_ms is not None and cb.step_ms > 0
    # Every GEMM of every site, each FP8 candidate the config allows timed on the CPU.
    assert {(r.site, r.role) for r in cb.ledger.rows} == {(s, r) for s in cb.sites for r in ROLES}
    assert all(r.high_ms > 0 and r.fp8 for r in cb.ledger.rows)
    assert summary["loka/ledger"] == str(tmp_path / "loka" / "ledger.md")
    written = (tmp_path / "loka" / "ledger.md").read_text()
    assert "FP8 is emulated" in written and "Predicted step speed-up" in written
    assert "prediction" in __import__("json").loads((tmp_path / "loka" / "ledger.json").read_text())
    # The plan and the ledger go through the logger (so into the run's log), marked as tables
    # that the launcher prints as they are; the library prints nothing itself.
    tables = [r.getMessage() for r in caplog.records if r.name == "loka_train.plugin.callback" and is_table(r)]
    assert [t.splitlines()[1] for t in tables] == [
        "LoKA plan", "LoKA per-GEMM ledger (15 largest GEMMs; all in ledger.md)"
    ], tables
    assert cb.dispatcher.table() in tables[0]
    assert capsys.readouterr().out == ""


def test_no_ledger_unless_asked(tmp_path: Path) -> None:
    cb, ctx = _started(_config(), tmp_path)
    summary: dict = {"train/steps_per_s": 50.0}
    cb.on_train_end(ctx, summary)
    assert cb.ledger is None and "loka/ledger" not in summary
    assert not (tmp_path / "loka" / "ledger.md").exists()


def test_sites_that_run_fp8_linear_share_operands_with_dispatch(tmp_path: Path) -> None:
    cb, _ = _started(_config(), tmp_path)
    assert cb.dispatcher is not None and cb.sites
    assert all(site.shares_operands for site in cb.sites.values())
    assert cb.dispatcher._shares_operands == set(cb.sites)


def test_residuals_dropped_at_a_resume_on_another_world_size_are_a_fallback(tmp_path: Path) -> None:
    first, _ = _started(_config(), tmp_path)
    state = first.state_dict()
    state["compressors"] = [{"residual": "rank 0's"}]  # the saved run had a dense-gradient hook
    resumed = LokaCallback(_config())
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    # Three processes (one process installs no hook, so it drops nothing it would have used).
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path, world_size=3)
    resumed.on_before_shard(ctx)
    merged = resumed.merge_rank_states([state, state], rank=0, world_size=3)
    assert merged["compressors"] == []
    resumed.load_state_dict(merged)
    resumed.on_train_start(ctx)
    assert [f for f in ctx.fallbacks if "error-feedback residuals" in f and "2 processes' state on 3" in f]
    resumed.on_train_start(ctx)  # reported once
    assert len([f for f in ctx.fallbacks if "error-feedback residuals" in f]) == 1


def test_the_report_lists_operands_the_reference_quantizer_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    from loka_train.kernels import linear

    monkeypatch.setattr(linear, "_REFERENCE_FALLBACKS", collections.Counter())
    linear._note_reference_fallback("rowwise operand (4, 32) with strides (32, 1) on torch_scaled_mm")
    cb, ctx = _started(_config(), tmp_path)  # an earlier run's count is not this run's
    assert not any(f.startswith("kernels:") for f in cb.report(ctx)["fallbacks"])
    linear._note_reference_fallback("rowwise operand (4, 32) with strides (32, 1) on torch_scaled_mm")
    linear._note_reference_fallback("rowwise operand (4, 32) with strides (32, 1) on torch_scaled_mm")
    lines = [f for f in cb.report(ctx)["fallbacks"] if f.startswith("kernels:")]
    assert lines == ["kernels: the reference quantizer took 2 x a rowwise operand (4, 32) with strides (32, 1) "
                     "on torch_scaled_mm (no Triton quantizer takes its shape or layout)"]


def test_dispatch_knows_which_sites_take_a_folded_relu(tmp_path: Path) -> None:
    """The ReLU before the second Linear folds into it (mods.fold_relu; the third Linear, the
    logit layer, is no site): Dispatch charges its forward candidates that do not apply it,
    and no other site's."""
    cb, _ = _started(_config(), tmp_path)
    assert cb.dispatcher is not None
    folded = {name for name, site in cb.sites.items() if site.input_relu}
    assert folded == {"2"}
    shape = (64, 32, 16)
    charged = {name for name in cb.sites if cb.dispatcher._unfolded_relu_s(name, "forward", shape, None) > 0}
    assert charged == folded


def test_the_site_that_feeds_the_logit_takes_its_own_sqnr_floors(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """``probe.logit_feeder_budget_db``: the site whose output feeds the logit layer (the last
    Linear, which stays high) is judged against its own floors for the roles given; every other
    site, and its other roles, against ``sqnr_budget_db``."""
    probe_cfg = ProbeConfig(every_k_steps=1, interval=50, window=4, logit_feeder_budget_db={"grad_weight": 20.0})
    cb, _ = _started(_config(probe=probe_cfg), tmp_path)
    assert cb.probe is not None
    budgets = {name: s["sqnr_budget_db"] for name, s in cb.probe.report()["sites"].items()}
    assert sorted(budgets) == ["0", "2"]  # "4", the logit layer, stays high; "2" feeds it (through a ReLU)
    assert budgets["2"] == {**probe_cfg.sqnr_budget_db, "grad_weight": 20.0}
    assert budgets["0"] == probe_cfg.sqnr_budget_db
    # The aggressive preset holds that grad-weight to 20 dB, safe's grad-weight floor.
    aggressive, safe = LokaConfig.preset("aggressive"), LokaConfig.preset("safe")
    assert aggressive.probe.logit_feeder_floors == {"grad_weight": safe.probe.sqnr_budget_db["grad_weight"]}
    with pytest.raises(ValueError, match="logit_feeder_budget_db has unknown roles"):
        ProbeConfig(logit_feeder_budget_db={"dgrad": 20.0})
    # No site feeds the logit (the top MLP not converted): said, and nothing changes.
    caplog.set_level(logging.WARNING, logger="loka_train.plugin.callback")
    only_first, _ = _started(_config(probe=probe_cfg, mods=ModsConfig(enabled=True, sites=["interaction"])),
                             tmp_path / "none")
    assert "applies to no site" in caplog.text and not only_first.sites


def test_a_resume_under_a_higher_floor_judges_that_gemm_again_in_high_precision(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint judged under other SQNR floors: this run's floors hold, the verdicts of the
    changed GEMMs are dropped (warned), and a GEMM whose floor rose runs high, as a plan change,
    until the Probe judges it again; the other GEMMs keep their restored plans."""
    fp8, state = _all_fp8_checkpoint(tmp_path)

    caplog.set_level(logging.WARNING)
    floors = ProbeConfig(every_k_steps=1, interval=50, window=4, logit_feeder_budget_db={"grad_weight": 30.0})
    resumed = _resumed(_config(probe=floors), state, tmp_path)
    assert resumed.probe is not None and resumed.dispatcher is not None
    assert resumed.probe.budget_changes == [("2", "grad_weight", 16.0, 30.0)]
    assert "judged it against an SQNR floor of 16.0 dB" in caplog.text
    assert resumed.dispatcher.plans["2"] == LinearPlan(forward=fp8.forward, grad_input=fp8.grad_input)
    assert resumed.dispatcher.plans["0"] == fp8 and resumed.sites["2"].plan == resumed.dispatcher.plans["2"]
    (change,) = resumed.dispatcher.history
    assert (change.step, change.site, change.role) == (29, "2", "grad_weight") and "raised from 16.0 to 30.0" in change.reason


def test_forward_ne_needs_a_loop_that_evaluates_again_and_logs_with_one(tmp_path: Path) -> None:
    from loka_train.plugin.config import GuardConfig

    config = _config(guard=GuardConfig(forward_ne=True), mods=ModsConfig(enabled=True, initial_plan="fp8_tensorwise"))
    with pytest.raises(ValueError, match="RunContext.evaluate_again"):
        _started(config, tmp_path)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    cb = LokaCallback(config)
    seen: list[dict[str, LinearPlan]] = []

    def evaluate_again() -> dict[str, float]:  # what the loop's evaluation sees
        seen.append({n: s.plan for n, s in cb.sites.items()})
        return {"eval/ne": 0.8}

    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path, evaluate_again=evaluate_again)
    cb.on_before_shard(ctx)
    cb.on_train_start(ctx)
    before = {n: s.plan for n, s in cb.sites.items()}
    assert any(p.forward.is_fp8 for p in before.values())
    metrics = {"eval/ne": 0.82, "eval/auc": 0.7}
    cb.on_eval_end(ctx, 9, metrics)
    (during,) = seen  # every forward high, the backward plans kept
    assert all(not p.forward.is_fp8 for p in during.values())
    assert all((p.grad_input, p.grad_weight) == (before[n].grad_input, before[n].grad_weight) for n, p in during.items())
    assert any(p.grad_input.is_fp8 for p in during.values())
    assert {n: s.plan for n, s in cb.sites.items()} == before  # restored
    assert metrics["loka/ne_forwards_high"] == 0.8
    assert metrics["loka/forward_ne_cost"] == pytest.approx(0.82 / 0.8 - 1)
    assert cb.evals[-1]["ne_forwards_high"] == 0.8
