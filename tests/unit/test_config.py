"""The hydra config composes into validated dataclasses; bad keys and values are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import launch.train  # noqa: F401  (registers the schema in the ConfigStore)
from loka_train.data import DataConfig, make_dataset
from loka_train.job import JobConfig
from loka_train.models import ModelConfig
from loka_train.runtime.config import TrainerConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _compose(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_default_job_composes() -> None:
    job = _compose()
    assert isinstance(job.model, ModelConfig) and job.model.kind == "dlrm"
    assert isinstance(job.trainer, TrainerConfig) and job.trainer.device == "cpu"
    assert job.loka.enabled is True and job.loka.dispatch.objective == "speed"
    assert job.loka.dispatch.cpu_objective == "coverage"  # the CPU main job exercises FP8


@pytest.mark.parametrize("preset", ["off", "safe", "aggressive"])
def test_loka_presets(preset: str) -> None:
    loka = _compose(f"loka={preset}").loka
    assert loka.enabled is (preset != "off")
    # A folded ReLU's mask kept as bits by default (same gradients, less memory); off on request.
    assert loka.mods.fold_relu is True and loka.mods.relu_mask_bits is True
    assert _compose(f"loka={preset}", "loka.mods.relu_mask_bits=false").loka.mods.relu_mask_bits is False


@pytest.mark.parametrize("preset", ["dlrm", "dcn", "wukong"])
def test_model_presets(preset: str) -> None:
    assert _compose(f"model={preset}").model.kind == preset


@pytest.mark.parametrize("override", ["model.kindd=dlrm", "trainer.stepz=3", "data.nope=1"])
def test_misspelled_key_is_an_error(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        _compose(override)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.steps=0", "trainer.steps"),
        ("trainer.sharding=diagonal", "trainer.sharding"),
        ("trainer.dense_dtype=fp16", "trainer.dense_dtype"),
        ("model.kind=transformer", "model.kind"),
        ("model.embedding_dim=32", "dense_arch_layer_sizes"),
        # Dispatch may only rely on verdicts measured with its own operand formats.
        ("loka.dispatch.fmt_forward=e5m2", "loka.probe.backward_fmt_b='e4m3'"),
        ("loka.probe.formats=[E4M3]", "loka.dispatch.fmt_backward='e5m2' is not among"),
        ("loka.probe.backward_fmt_b=null", "backward_fmt_b=null"),
    ],
)
def test_bad_value_names_the_field(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _compose(override)


def test_missing_data_path_names_the_key(tmp_path: Path) -> None:
    cfg = DataConfig(kind="criteo_tsv", path=str(tmp_path / "nowhere.tsv"))
    with pytest.raises(FileNotFoundError, match="data.path"):
        make_dataset(cfg, split="train", rank=0, world_size=1, batch_size=8)


def test_dense_lr_warms_up_linearly_then_holds() -> None:
    cfg = TrainerConfig(dense_lr=0.01, dense_warmup_steps=4)
    assert [cfg.dense_lr_at(s) for s in range(6)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    assert TrainerConfig(dense_lr=0.01).dense_lr_at(0) == 0.01  # no warm-up by default
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        TrainerConfig(dense_warmup_steps=-1)
    gpu = _compose("trainer=gpu").trainer
    assert gpu.dense_warmup_steps > 0 and gpu.dense_lr <= 0.01


def test_lr_decay_schedule() -> None:
    cfg = TrainerConfig(dense_lr=0.01, sparse_lr=0.04, dense_warmup_steps=2, lr_decay_start=3, lr_decay_steps=4)
    assert [cfg.dense_lr_at(s) for s in range(9)] == pytest.approx(
        [0.005, 0.01, 0.01, 0.01, 0.01 * 0.75**2, 0.01 * 0.25, 0.01 * 0.25**2, 0.0, 0.0]
    )
    assert [cfg.sparse_lr_at(s) for s in (0, 3, 5, 7, 100)] == pytest.approx([0.04, 0.04, 0.01, 0.0, 0.0])
    assert TrainerConfig(sparse_lr=0.04).sparse_lr_at(10**6) == 0.04  # no decay by default
    with pytest.raises(ValueError, match="lr_decay_steps"):
        TrainerConfig(lr_decay_steps=-1)
    with pytest.raises(ValueError, match="lr_decay_power"):
        TrainerConfig(lr_decay_steps=4, lr_decay_power=0)
    for ignored in ({"lr_decay_start": 100}, {"lr_decay_power": 1.0}):  # set, but no decay: refused
        with pytest.raises(ValueError, match="trainer.lr_decay_steps=N"):
            TrainerConfig(**ignored)


@pytest.mark.parametrize(
    "overrides",
    [
        ("loka.probe.formats=[E4M3]", "loka.dispatch.fp8_roles=[forward]"),  # no FP8 backward GEMM
        ("loka.probe.formats=[E4M3]", "loka.dispatch.enabled=false"),
        ("loka=off", "loka.probe.formats=[E4M3]"),
    ],
)
def test_format_checks_only_apply_to_gemms_that_can_run_fp8(overrides: tuple[str, ...]) -> None:
    _compose(*overrides)


@pytest.mark.parametrize(("override", "expected"), [(None, None), ("trainer.pin_memory=false", False)])
def test_pin_memory_composes(override: str | None, expected: bool | None) -> None:
    job = _compose(*([override] if override else []))
    assert job.trainer.pin_memory is expected


def test_pin_memory_on_a_cpu_run_names_the_fix() -> None:
    with pytest.raises(ValueError, match="trainer.pin_memory=true needs trainer.device=cuda"):
        _compose("trainer.pin_memory=true")


def test_the_logit_feeders_floor_is_set_and_cleared_from_the_command_line() -> None:
    safe = _compose("loka=safe", "loka.probe.logit_feeder_budget_db.grad_weight=20").loka
    assert safe.probe.logit_feeder_floors == {"grad_weight": 20.0}
    assert _compose("loka=safe").loka.probe.logit_feeder_floors == {}
    assert _compose("loka=aggressive").loka.probe.logit_feeder_floors == {"grad_weight": 20.0}
    cleared = _compose("loka=aggressive", "loka.probe.logit_feeder_budget_db.grad_weight=null").loka
    assert cleared.probe.logit_feeder_floors == {}
    with pytest.raises(Exception, match="dgrad"):
        _compose("loka=aggressive", "loka.probe.logit_feeder_budget_db.dgrad=20")
