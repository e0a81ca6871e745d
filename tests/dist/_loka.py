"""Helpers for LoKA end-to-end tests: presets composed from conf/loka/*.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from loka_train.kernels.roles import ROLES
from loka_train.runtime import Callback
from loka_train.plugin.callback import LokaCallback
from loka_train.plugin.config import LokaConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def preset(name: str, *overrides: str) -> LokaConfig:
    """The conf/loka/<name>.yaml preset (validated by the schema), with overrides."""
    import launch.train  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"loka={name}", *overrides])
    job = OmegaConf.to_object(cfg)
    return job.loka  # type: ignore[attr-defined, no-any-return]


class PlanRecorder(Callback):
    """After each LoKA interval, records (step, plan export) of the LoKA callback."""

    def __init__(self, loka: LokaCallback) -> None:
        self.loka = loka
        self.plans: list[tuple[int, dict[str, Any]]] = []
        self.losses: list[float] = []
        self.loss_by_step: dict[int, float] = {}

    def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        assert self.loka.probe is not None and self.loka.dispatcher is not None
        if "train/loss" in metrics:
            self.losses.append(metrics["train/loss"])
            self.loss_by_step[step] = metrics["train/loss"]
        if self.loka.probe.should_reduce(step):
            self.plans.append((step, self.loka.dispatcher.export()))


def num_fp8(export: dict[str, Any]) -> int:
    return sum(plan[r]["precision"] == "fp8" for plan in export.values() for r in ROLES)
