"""Configuration of Dispatch (the ``loka.dispatch`` group of the hydra config), and the record
of one plan change.

Example:
    >>> cfg = DispatchConfig(objective="speed", margin=0.05, scalings=("rowwise",))
    >>> cfg.fp8_roles
    ('forward', 'grad_input', 'grad_weight')
"""

from __future__ import annotations

from dataclasses import dataclass

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES

__all__ = ["OBJECTIVES", "TIMINGS", "DispatchConfig", "PlanChange"]

OBJECTIVES: tuple[str, ...] = ("speed", "coverage")
"""Values of :attr:`DispatchConfig.objective`."""

TIMINGS: tuple[str, ...] = ("auto", "measure", "cost_model")
"""Values of :attr:`DispatchConfig.timing`."""


@dataclass(kw_only=True)
class DispatchConfig:
    """How Dispatch picks each GEMM's plan.

    Example:
        >>> DispatchConfig(objective="speed", margin=0.05, scalings=("rowwise",))
    """

    enabled: bool = True
    """Re-plan at Probe intervals. Off: every site keeps its initial plan (on resume, a
    checkpointed plan other than that or high precision is reset to it, see ``load_state_dict``)."""

    objective: str = "speed"
    """"speed": FP8 only where it is safe AND faster than high precision by `margin`;
    "coverage": FP8 wherever it is safe (fastest safe candidate)."""

    cpu_objective: str | None = None
    """Objective when the job runs on CPU, where FP8 is emulated and only its numerics matter
    (the speed side is the H100 cost model's guess); None: the same as ``objective``."""

    margin: float = 0.05
    """Relative speed-up an FP8 candidate must show over high precision (0.05 = 5%)."""

    scalings: tuple[str, ...] = ("rowwise",)
    """Scaling granularities Dispatch may choose (subset of the Probe's candidates)."""

    backends: tuple[str, ...] = ("triton", "fbgemm_rowwise", "torch_scaled_mm", "emulated")
    """FP8 backends Dispatch may choose, in order of preference on equal time. "emulated"
    (quantize, dequantize, fp32 matmul) is what runs on CPU."""

    cpu_backends: tuple[str, ...] = ("emulated",)
    """Backends Dispatch may choose when the job runs on CPU, where FP8 only serves the
    numerics (the Triton interpreter would run but is far too slow to train with)."""

    fmt_forward: str = "e4m3"
    """Format of the forward GEMM's operands."""

    fmt_backward: str = "e5m2"
    """Format of the output gradient in the backward GEMMs (the other operand stays e4m3)."""

    fp8_roles: tuple[str, ...] = ("forward", "grad_input", "grad_weight")
    """GEMM roles that may run in FP8 at all; the others always stay in high precision."""

    hysteresis_intervals: int = 2
    """Consecutive intervals a new (not safety-driven) target must persist before it is applied."""

    timing: str = "auto"
    """"measure" (on-device micro-benchmark, needs CUDA), "cost_model", or "auto" (measure
    when on CUDA, else the cost model)."""

    bench_iters: int = 20
    """Timed repetitions of each micro-benchmark (after 3 warm-up runs)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"dispatch.objective={self.objective!r}: choose one of {OBJECTIVES}")
        if self.cpu_objective is not None and self.cpu_objective not in OBJECTIVES:
            raise ValueError(
                f"dispatch.cpu_objective={self.cpu_objective!r}: choose one of {OBJECTIVES} or null"
            )
        if self.timing not in TIMINGS:
            raise ValueError(f"dispatch.timing={self.timing!r}: choose one of {TIMINGS}")
        if not (0.0 <= self.margin < 10.0):
            raise ValueError(f"dispatch.margin={self.margin} must be in [0, 10)")
        if self.hysteresis_intervals < 1 or self.bench_iters < 1:
            raise ValueError("dispatch.hysteresis_intervals and dispatch.bench_iters must be >= 1")
        # Accept "rowwise", "ROWWISE" or the enum, like the Probe config.
        self.scalings = tuple(Scaling(str(getattr(s, "value", s)).lower()).value for s in self.scalings)
        self.fmt_forward = Fp8Format(self.fmt_forward).value
        self.fmt_backward = Fp8Format(self.fmt_backward).value
        bad_roles = set(self.fp8_roles) - set(ROLES)
        if bad_roles:
            raise ValueError(f"dispatch.fp8_roles has unknown roles {sorted(bad_roles)}; use {ROLES}")
        if not self.backends or not self.cpu_backends:
            raise ValueError("dispatch.backends and dispatch.cpu_backends must each name a backend")


@dataclass(frozen=True)
class PlanChange:
    """One GEMM's plan changed at `step`, and why (logged, counted, kept in the history and in
    checkpoints as plain strings).

    Example:
        >>> str(PlanChange(99, "over_arch.0", "forward", "high", "fp8:e4m3/rowwise@triton", "safe"))
        'step 99 over_arch.0/forward: high -> fp8:e4m3/rowwise@triton (safe)'
    """

    step: int
    site: str
    role: str
    old: str
    new: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step} {self.site}/{self.role}: {self.old} -> {self.new} ({self.reason})"
