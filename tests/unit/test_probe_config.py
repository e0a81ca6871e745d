"""ProbeConfig: validation at construction, string/enum coercion."""

from __future__ import annotations

import pytest

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.probe import ProbeConfig


def test_defaults_are_valid_and_typed() -> None:
    cfg = ProbeConfig()
    assert cfg.formats == (Fp8Format.E4M3, Fp8Format.E5M2)
    assert cfg.scalings == (Scaling.TENSORWISE, Scaling.ROWWISE)
    assert cfg.max_rows == 1024
    assert cfg.sites_per_step == 2 and cfg.every_k_steps == 100
    assert set(cfg.sqnr_budget_db) == {"forward", "grad_input", "grad_weight"}
    assert cfg.min_samples <= cfg.window


def test_strings_and_names_are_coerced_to_enums() -> None:
    # hydra (OmegaConf) hands enum names and lists; Python users pass values.
    cfg = ProbeConfig(formats=["E5M2", "e4m3"], scalings=["ROWWISE", "mx"], backward_fmt_b="e5m2")
    assert cfg.formats == (Fp8Format.E5M2, Fp8Format.E4M3)
    assert cfg.scalings == (Scaling.ROWWISE, Scaling.MX)
    assert cfg.backward_fmt_b is Fp8Format.E5M2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_k_steps": 0}, "every_k_steps"),
        ({"window": -1}, "window"),
        ({"interval": 0}, "interval"),
        ({"sites_per_step": 0}, "sites_per_step"),
        ({"min_samples": 17, "window": 16}, "min_samples"),
        ({"formats": ("e3m4",)}, "formats"),
        ({"scalings": ("columnwise",)}, "scalings"),
        ({"formats": ()}, "at least one"),
        ({"scalings": ("rowwise", "ROWWISE")}, "duplicates"),
        ({"sqnr_budget_db": {"forward": 20.0}}, "sqnr_budget_db"),
        ({"quantile": 0.9}, "quantile"),
        ({"margin_db": -1.0}, "margin_db"),
        ({"hysteresis_intervals": 0}, "hysteresis_intervals"),
        ({"max_underflow_fraction": 2.0}, "max_underflow_fraction"),
        ({"enabled": "yes"}, "enabled"),
        ({"max_rows": 2}, "max_rows"),
    ],
)
def test_bad_values_raise_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProbeConfig(**kwargs)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        ProbeConfig(True)  # type: ignore[misc]
