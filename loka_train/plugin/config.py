"""Configuration of the LoKA plugin (the `loka:` group of the hydra config) and its presets.

Each sub-config is its component's own dataclass (ProbeConfig, ModsConfig, DispatchConfig,
CommConfig) plus the quality guard here. The presets, in plain Python
(``LokaConfig.preset(name)``), are defined here and nowhere else; ``conf/loka/<name>.yaml``
(what hydra's ``loka=<name>`` selects) is written from them by ``python -m launch.presets``,
and a test fails when a YAML file and its preset differ.

* ``off``: the library default (``LokaConfig()``); the callback does nothing at all and no
  numerics change.
* ``safe``: FP8 only where the Probe's conservative SQNR bound fits a tight budget AND the GEMM
  is faster than high precision by a 5% margin; row-wise scaling; forward and grad-input GEMMs
  (weight gradients stay in high precision); FP32 comms. Sampling is sparse (every site on
  every 300th step), sized for long GPU runs.
* ``aggressive``: FP8 wherever the Probe says it is safe under looser budgets and it is not
  slower than high precision (margin 0), except the grad-weight of the layer before the logit,
  held to a 20 dB floor (``probe.logit_feeder_budget_db``); tensor-wise and row-wise scaling, tensor-wise
  activations and gradients with static scales from the Probe's window
  (``mods.static_scales``); all three GEMMs; the embedding all-to-all moves down to FP8 when
  the comm policy measures it safe. On a CPU,
  where FP8 is emulated, it takes FP8 wherever it is safe (``dispatch.cpu_objective=
  "coverage"``): a CPU run exercises the numerics a GPU run would risk, not their speed.

Example:
    >>> cfg = LokaConfig.preset("aggressive", probe={"interval": 50}, report_every=100)
    >>> cfg.probe.interval, cfg.probe.every_k_steps   # the rest of the preset is kept
    (50, 20)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loka_train.comm.config import CommChannel, CommConfig, CommPrecision
from loka_train.dispatch.config import DispatchConfig
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.mods.config import ModsConfig
from loka_train.probe.config import ProbeConfig

__all__ = ["PRESETS", "GuardConfig", "LokaConfig"]


@dataclass(kw_only=True)
class GuardConfig:
    """Model-quality guard: held-out NE versus its own trend.

    Example:
        >>> GuardConfig(ne_tolerance=0.005)
    """

    enabled: bool = True
    """Watch every evaluation's NE while LoKA runs sites in FP8."""

    ne_tolerance: float = 0.005
    """Relative NE regression tolerated against the best NE seen so far (0.005 = 0.5%).
    Beyond it every FP8 site moves back to high precision (logged, counted)."""

    cooldown_evals: int = 2
    """Evaluations after a trip during which Dispatch may not move sites back to FP8."""

    forward_ne: bool = False
    """At every evaluation while a site's forward runs in FP8, evaluate once more with the sites'
    FP8 forwards in high precision (another pass over the eval batches; the embedding exchange
    keeps its codecs) and log what those forwards cost the NE: ``loka/ne_forwards_high`` and
    ``loka/forward_ne_cost`` (the NE over that NE, minus 1), also in the run report. The
    forwards' share of FP8's NE cost, without a bf16 run to compare with. Watches only: nothing
    moves. Under ``compile_dense`` the first such evaluation of each plan set compiles the towers
    for it."""

    def __post_init__(self) -> None:
        if not (0.0 < self.ne_tolerance < 1.0):
            raise ValueError(f"loka.guard.ne_tolerance={self.ne_tolerance} must be in (0, 1)")
        if self.cooldown_evals < 0:
            raise ValueError(f"loka.guard.cooldown_evals={self.cooldown_evals} must be >= 0")


@dataclass(kw_only=True)
class LokaConfig:
    """What the LoKA callback does. The library default (`enabled=False`) changes nothing.

    Start from a preset (:meth:`preset`) rather than from the defaults, which are the ``off``
    preset's.

    Example:
        >>> LokaConfig.preset("safe")
        >>> LokaConfig(enabled=True, dispatch=DispatchConfig(objective="speed"))
    """

    enabled: bool = False
    """Whether the LoKA callback does anything. Off: it converts no module, installs no hook or
    codec, samples nothing and writes no report (and `run_job` does not add it)."""

    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """Online statistics: sampling, window, interval, budgets (loka_train.probe)."""

    mods: ModsConfig = field(default_factory=ModsConfig)
    """Which dense GEMMs become FP8-capable sites, and the adaptations (loka_train.mods)."""

    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    """How each GEMM's plan is chosen (loka_train.dispatch)."""

    comm: CommConfig = field(default_factory=CommConfig)
    """Embedding all-to-all and dense-gradient precision, and its policy (loka_train.comm)."""

    comm_enabled: bool = False
    """Install the comm codecs and dense-gradient hook (off: TorchRec's default FP32 comms)."""

    guard: GuardConfig = field(default_factory=GuardConfig)
    """Model-quality guard."""

    report_every: int = 0
    """Steps between on-demand reports, independent of the Probe interval (0: only at the end
    of training)."""

    ledger: bool = False
    """At the end of training, measure the per-GEMM ledger on rank 0 (each GEMM's high-precision
    time, every FP8 candidate's GEMM and quantization time as the site runs them, and the step
    speed-ups they predict; ``loka_train.dispatch.ledger``), print it and write it to the report
    (``ledger.md``, ``ledger.json``). On a GPU it takes a few seconds per distinct GEMM shape;
    on a CPU FP8 is emulated and the times say nothing of a GPU."""

    def __post_init__(self) -> None:
        # Dispatch may only pick formats the Probe measures, with the same operand-b format in
        # the backward GEMMs, or its "safe" would rest on another GEMM's SQNR.
        measured = {f.value for f in self.probe.formats}
        roles = set(self.dispatch.fp8_roles) if self.enabled and self.dispatch.enabled else set()
        backward = bool(roles & {"grad_input", "grad_weight"})
        used = [("fmt_forward", self.dispatch.fmt_forward)] if roles else []
        if backward:
            used.append(("fmt_backward", self.dispatch.fmt_backward))
        for key, fmt in used:
            if fmt not in measured:
                raise ValueError(
                    f"loka.dispatch.{key}={fmt!r} is not among loka.probe.formats "
                    f"{sorted(measured)}: add it there, or choose one of those"
                )
        # Operand b of the backward GEMMs (only where one of them can run FP8): Dispatch runs
        # it in fmt_forward, the Probe measures it in backward_fmt_b (null: dY's format).
        fmt_b = self.probe.backward_fmt_b
        if backward and fmt_b is None and self.dispatch.fmt_backward != self.dispatch.fmt_forward:
            raise ValueError(
                "loka.probe.backward_fmt_b=null measures the backward GEMMs with operand b in "
                f"dY's format, but Dispatch runs it in loka.dispatch.fmt_forward="
                f"{self.dispatch.fmt_forward!r}: set backward_fmt_b to that format"
            )
        if backward and fmt_b is not None and fmt_b.value != self.dispatch.fmt_forward:
            raise ValueError(
                f"loka.probe.backward_fmt_b={fmt_b.value!r} but loka.dispatch.fmt_forward="
                f"{self.dispatch.fmt_forward!r}: backward GEMMs keep operand b in fmt_forward, so "
                "the Probe must measure them that way; set both to the same format"
            )
        if self.report_every < 0:
            raise ValueError(
                f"loka.report_every={self.report_every} must be >= 0 (0: report only at the end)"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LokaConfig:
        """The LoKA preset `name` (``"off"``, ``"safe"``, ``"aggressive"``; see the module
        docstring), with fields replaced by `overrides`.

        An override of a sub-config (``probe``, ``mods``, ``dispatch``, ``comm``, ``guard``) is
        either a whole config object, which replaces the preset's, or a mapping of its fields,
        which replaces only those (as hydra's ``loka.probe.interval=50`` does). The result is
        validated as any `LokaConfig` is. ``dataclasses.replace`` works on the result too.

        Args:
            name: the preset.
            **overrides: `LokaConfig` fields to replace.

        Raises:
            ValueError: an unknown preset or field, or a value the config refuses.

        Example:
            >>> LokaConfig.preset("safe", probe={"interval": 100}, ledger=True).probe.interval
            100
        """
        if name not in PRESETS:
            raise ValueError(f"unknown LoKA preset {name!r}: choose one of {sorted(PRESETS)}")
        config: LokaConfig = _replace(PRESETS[name](), overrides, prefix="loka")
        return config


def _replace(config: Any, overrides: Mapping[str, Any], *, prefix: str) -> Any:
    """`config` with `overrides` applied; a mapping for a dataclass field replaces only the
    fields it names, recursively."""
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"{prefix} has no field {', '.join(unknown)}; its fields: {sorted(fields)}")
    resolved = {}
    for key, value in overrides.items():
        current = getattr(config, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            value = _replace(current, value, prefix=f"{prefix}.{key}")
        resolved[key] = value
    return dataclasses.replace(config, **resolved)


def _off() -> LokaConfig:
    return LokaConfig(enabled=False)


def _safe() -> LokaConfig:
    return LokaConfig(
        enabled=True,
        probe=ProbeConfig(
            # Every site on every 300th step: with trainer.cuda_graphs a sampled step replays
            # one capture per module (a rotating subset of sites would need one per subset).
            # Each site is sampled about as often as 2 rotating sites every 50 steps gave a
            # 14-site Wukong-style model (every 350 steps), half as often on a 5-site DLRM.
            every_k_steps=300,
            sites_per_step=None,
            window=16,  # samples per (site, GEMM) in the rolling window
            interval=500,  # all-reduce, verdicts and re-plan every 500 steps
            formats=(Fp8Format.E4M3, Fp8Format.E5M2),
            scalings=(Scaling.ROWWISE,),
            quantile=0.1,  # judge the 10th percentile of SQNR over the window
            sqnr_budget_db={"forward": 24.0, "grad_input": 20.0, "grad_weight": 20.0},
            hysteresis_intervals=2,
            min_samples=4,
        ),
        mods=ModsConfig(enabled=True, keep_last_layer_high=True, initial_plan="high"),
        dispatch=DispatchConfig(
            objective="speed",  # FP8 only where faster than high precision by `margin`
            margin=0.05,
            scalings=("rowwise",),
            fp8_roles=("forward", "grad_input"),  # weight gradients stay in high precision
            hysteresis_intervals=2,
        ),
        guard=GuardConfig(enabled=True, ne_tolerance=0.005),
        comm_enabled=False,
    )


def _aggressive() -> LokaConfig:
    return LokaConfig(
        enabled=True,
        probe=ProbeConfig(
            every_k_steps=80,  # every site (as in safe), as often as 4 rotating every 20 on Wukong
            sites_per_step=None,
            window=16,
            interval=200,
            formats=(Fp8Format.E4M3, Fp8Format.E5M2),
            scalings=(Scaling.TENSORWISE, Scaling.ROWWISE),
            quantile=0.1,
            sqnr_budget_db={"forward": 18.0, "grad_input": 14.0, "grad_weight": 14.0},
            logit_feeder_budget_db={"forward": None, "grad_input": None, "grad_weight": 20.0},  # 20 dB as in safe: the layer before the logit
            hysteresis_intervals=1,
            min_samples=4,
        ),
        mods=ModsConfig(enabled=True, keep_last_layer_high=True, initial_plan="high", static_scales=True),
        dispatch=DispatchConfig(
            objective="speed",
            cpu_objective="coverage",  # CPU: FP8 is emulated; exercise its numerics
            margin=0.0,
            scalings=("tensorwise", "rowwise"),
            fp8_roles=("forward", "grad_input", "grad_weight"),
            hysteresis_intervals=1,
        ),
        guard=GuardConfig(enabled=True, ne_tolerance=0.01),
        comm_enabled=True,
        comm=CommConfig(
            a2a_forward=CommPrecision.FP32,
            a2a_backward=CommPrecision.FP32,
            adaptive_channels=(CommChannel.A2A_FWD, CommChannel.A2A_BWD),
            policy_interval=200,
        ),
    )


PRESETS: dict[str, Callable[[], LokaConfig]] = {
    "off": _off,
    "safe": _safe,
    "aggressive": _aggressive,
}
"""Preset name -> a function that builds a fresh `LokaConfig` of that preset."""
