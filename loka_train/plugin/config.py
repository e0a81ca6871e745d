"""Configuration of the LoKA plugin (the `loka:` group of the hydra config).

Presets live in conf/loka/: `off` (the library default: changes no numerics), `safe`
and `aggressive`. Each sub-config is its component's own dataclass (ProbeConfig,
ModsConfig, DispatchConfig, CommConfig) plus the quality guard here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loka_train.comm.config import CommConfig
from loka_train.dispatch.config import DispatchConfig
from loka_train.mods.config import ModsConfig
from loka_train.probe.config import ProbeConfig


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

    def __post_init__(self) -> None:
        if not (0.0 < self.ne_tolerance < 1.0):
            raise ValueError(f"loka.guard.ne_tolerance={self.ne_tolerance} must be in (0, 1)")
        if self.cooldown_evals < 0:
            raise ValueError(f"loka.guard.cooldown_evals={self.cooldown_evals} must be >= 0")


@dataclass(kw_only=True)
class LokaConfig:
    """What the LoKA callback does. The library default (`enabled=False`) changes nothing.

    Example:
        >>> LokaConfig(enabled=True, dispatch=DispatchConfig(objective="speed"))
    """

    enabled: bool = False
    """Attach the LoKA callback to the trainer."""

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
