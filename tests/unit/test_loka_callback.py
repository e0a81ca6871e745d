"""The LoKA callback on one CPU process, driven through a RunContext: report schedule, config
validation, and a resume whose dispatch config no longer allows the checkpointed plans."""

from __future__ import annotations

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
    first, _ = _started(_config(), tmp_path)
    fp8 = LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="emulated")
    assert first.dispatcher is not None and first.probe is not None
    for name, site in first.sites.items():
        first.dispatcher.plans[name] = fp8
        site.set_plan(fp8)
    first.probe.begin_step(29)
    state = first.state_dict()

    resumed = LokaCallback(_config(dispatch=DispatchConfig(enabled=False)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path)
    resumed.on_before_shard(ctx)
    resumed.load_state_dict(state)
    resumed.on_train_start(ctx)
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
