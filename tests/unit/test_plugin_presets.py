"""The LoKA presets in plain Python are what conf/loka/<name>.yaml gives hydra, field for field;
overrides replace only what they name and are validated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from launch.presets import CONF_LOKA, preset_yaml
from loka_train.plugin.config import PRESETS, LokaConfig
from loka_train.probe.config import ProbeConfig


def _data(config: LokaConfig) -> dict[str, Any]:
    """`config` as plain data (tuples and lists alike), through the schema."""
    return OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[return-value]


def _from_yaml(path: Path) -> LokaConfig:
    """A conf/loka file read the way hydra reads it: merged into the schema, then validated."""
    merged = OmegaConf.merge(OmegaConf.structured(LokaConfig), OmegaConf.load(path))
    config = OmegaConf.to_object(merged)
    assert isinstance(config, LokaConfig)
    return config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_yaml_file_gives_exactly_the_preset(name: str) -> None:
    assert _data(_from_yaml(CONF_LOKA / f"{name}.yaml")) == _data(LokaConfig.preset(name))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_yaml_file_is_written_from_the_preset(name: str) -> None:
    text = (CONF_LOKA / f"{name}.yaml").read_text()
    assert text == preset_yaml(name), "conf/loka is out of date: run `python -m launch.presets`"


def test_there_is_a_yaml_file_for_every_preset_and_no_other() -> None:
    assert sorted(p.stem for p in CONF_LOKA.glob("*.yaml")) == sorted(PRESETS)


def test_off_is_the_library_default() -> None:
    assert LokaConfig.preset("off") == LokaConfig()
    assert LokaConfig.preset("safe").enabled and LokaConfig.preset("aggressive").enabled


def test_presets_and_overrides_in_plain_python() -> None:
    safe = LokaConfig.preset("safe")
    assert safe.dispatch.fp8_roles == ("forward", "grad_input")
    assert not safe.comm_enabled
    # A mapping replaces only the fields it names; the rest of the preset stays.
    cfg = LokaConfig.preset("aggressive", probe={"interval": 50}, report_every=100)
    assert (cfg.probe.interval, cfg.probe.every_k_steps, cfg.report_every) == (50, 80, 100)
    assert cfg.probe.sqnr_budget_db == LokaConfig.preset("aggressive").probe.sqnr_budget_db
    # A config object replaces the preset's.
    probe = ProbeConfig(every_k_steps=5)
    assert LokaConfig.preset("safe", probe=probe).probe is probe
    # dataclasses.replace works on the result too.
    assert dataclasses.replace(safe, ledger=True).ledger
    # Each call builds a fresh config.
    safe.probe.interval = 7
    assert LokaConfig.preset("safe").probe.interval == 500


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("fast", {}, "unknown LoKA preset 'fast'"),
        ("safe", {"probes": {}}, "loka has no field probes"),
        ("safe", {"probe": {"intervall": 5}}, "loka.probe has no field intervall"),
        ("safe", {"probe": {"window": 2}}, "probe.min_samples=4 exceeds probe.window=2"),
        ("safe", {"dispatch": {"fmt_forward": "e5m2"}}, "loka.probe.backward_fmt_b='e4m3'"),
    ],
)
def test_bad_presets_and_overrides_name_the_fix(name: str, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        LokaConfig.preset(name, **overrides)


def test_the_user_guide_example() -> None:
    """The snippet of the user guide, as written there."""
    import dataclasses

    from loka_train.plugin import LokaCallback, LokaConfig

    safe = LokaConfig.preset("safe")  # what conf/loka/safe.yaml gives hydra's loka=safe
    short_run = LokaConfig.preset("aggressive", probe={"every_k_steps": 5, "interval": 50}, report_every=100)
    with_ledger = dataclasses.replace(safe, ledger=True)
    off = LokaConfig.preset("off")  # == LokaConfig(): the callback does nothing at all
    callback = LokaCallback(safe)

    assert short_run.probe.sqnr_budget_db["forward"] == 18.0  # the rest of the preset is kept
    assert with_ledger.ledger and not off.enabled and callback.config is safe
