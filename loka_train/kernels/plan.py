"""Numerics plans: how each GEMM of a linear site is computed.

A :class:`GemmPlan` says how one GEMM runs (high precision, or FP8 with a format, a scaling
granularity, a backend and an accumulation mode); a :class:`LinearPlan` holds one per GEMM of
a linear layer (forward ``y = x W^T``, grad-input ``dX = dY W``, grad-weight ``dW = dY^T X``).
Plans are plain data: frozen, validated at construction, serializable with ``to_dict`` /
``from_dict`` (they are part of the checkpoint).

Operand naming: every GEMM is computed as ``a @ b^T`` (see ``registry.Backend``):
forward ``a = x``, ``b = W``; grad-input ``a = dY``, ``b = W^T``; grad-weight ``a = dY^T``,
``b = X^T``. ``GemmPlan.fmt`` is the format of ``a``, ``GemmPlan.fmt_b`` that of ``b``
(defaults to ``fmt``): the usual hybrid recipe keeps gradients in E5M2 and weights and
activations in E4M3, and cuBLASLt has no E5M2 x E5M2 GEMM.

Example:
    >>> plan = LinearPlan.fp8(backend="emulated")
    >>> str(plan.grad_input)
    'fp8:e5m2xe4m3/rowwise@emulated'
    >>> LinearPlan.from_dict(plan.to_dict()) == plan
    True
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from loka_train.kernels.formats import Fp8Format, Scaling

__all__ = ["Precision", "GemmPlan", "LinearPlan", "BACKEND_CONSTRAINTS"]


class Precision(enum.StrEnum):
    """Precision of a GEMM."""

    HIGH = "high"
    """The input dtype (fp32 on CPU, bf16 under autocast on GPU): plain ``torch.matmul``."""
    FP8 = "fp8"
    """Both operands quantized to FP8 and multiplied by a backend."""


# Static constraints of the built-in backends: (scalings, formats of a/b, scalings with a fast
# accumulation mode). Shape/device constraints are checked at run time by Backend.supports().
BACKEND_CONSTRAINTS: dict[str, tuple[frozenset[Scaling], frozenset[Fp8Format], frozenset[Scaling]]] = {
    "emulated": (frozenset(Scaling), frozenset(Fp8Format), frozenset(Scaling)),
    "torch_scaled_mm": (
        frozenset({Scaling.TENSORWISE, Scaling.ROWWISE, Scaling.BLOCK}),
        frozenset({Fp8Format.E4M3, Fp8Format.E5M2, Fp8Format.E4M3FNUZ}),
        frozenset({Scaling.TENSORWISE, Scaling.ROWWISE}),  # cuBLASLt's block-scaled FP8 has none
    ),
    "fbgemm_rowwise": (frozenset({Scaling.ROWWISE}), frozenset({Fp8Format.E4M3}), frozenset({Scaling.ROWWISE})),
    "triton": (
        frozenset({Scaling.TENSORWISE, Scaling.ROWWISE}),
        frozenset({Fp8Format.E4M3, Fp8Format.E5M2}),
        frozenset({Scaling.TENSORWISE, Scaling.ROWWISE}),
    ),
}
"""Known backend name -> (supported scalings, supported formats, scalings it accumulates fast
in: ``GemmPlan.fast_accum`` allowed).

Backends registered later (not listed) are checked only when they run."""


@dataclass(frozen=True, kw_only=True)
class GemmPlan:
    """How one GEMM is computed.

    Example:
        >>> str(GemmPlan(precision=Precision.FP8, backend="triton"))
        'fp8:e4m3/rowwise@triton'
    """

    precision: Precision = Precision.HIGH
    """HIGH: plain matmul in the input dtype; FP8: quantize both operands, call ``backend``."""
    fmt: Fp8Format = Fp8Format.E4M3
    """FP8 format of operand ``a`` (``x`` forward, ``dY`` in both backward GEMMs)."""
    fmt_b: Fp8Format | None = None
    """FP8 format of operand ``b`` (``W`` forward and grad-input, ``X`` grad-weight);
    None means the same as ``fmt``."""
    scaling: Scaling = Scaling.ROWWISE
    """Scale granularity of both operands (block: 1x128 groups for activations and
    gradients, 128x128 tiles for weights)."""
    backend: str = "emulated"
    """Registered backend name (``registry.available_backends`` lists them)."""
    fast_accum: bool = False
    """Allow the backend's fast (reduced-precision) FP8 accumulation (cuBLASLt
    ``use_fast_accum``); ignored by backends that always accumulate in fp32."""

    def __post_init__(self) -> None:
        # Accept the string values too (from YAML / to_dict) and store the enums.
        try:
            object.__setattr__(self, "precision", Precision(self.precision))
            object.__setattr__(self, "fmt", Fp8Format(self.fmt))
            if self.fmt_b is not None:
                object.__setattr__(self, "fmt_b", Fp8Format(self.fmt_b))
            object.__setattr__(self, "scaling", Scaling(self.scaling))
        except ValueError as e:
            raise ValueError(f"invalid GemmPlan field: {e}") from e
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"GemmPlan.backend must be a non-empty string, got {self.backend!r}")
        if not isinstance(self.fast_accum, bool):
            raise ValueError(f"GemmPlan.fast_accum must be a bool, got {self.fast_accum!r}")
        if self.precision is Precision.HIGH:
            return
        known = BACKEND_CONSTRAINTS.get(self.backend)
        if known is None:
            return
        scalings, fmts, fast_scalings = known
        if self.scaling not in scalings:
            raise ValueError(
                f"backend {self.backend!r} does not support {self.scaling.value} scaling "
                f"(supports {sorted(s.value for s in scalings)}); use backend='emulated' or "
                "another scaling"
            )
        for f in (self.fmt, self.operand_b_fmt):
            if f not in fmts:
                raise ValueError(
                    f"backend {self.backend!r} does not support {f.value} "
                    f"(supports {sorted(x.value for x in fmts)})"
                )
        if self.fast_accum and self.scaling not in fast_scalings:
            raise ValueError(
                f"backend {self.backend!r} has no fast accumulation mode for {self.scaling.value} scaling "
                f"(has one for {sorted(s.value for s in fast_scalings)}); set fast_accum=False"
            )

    @property
    def is_fp8(self) -> bool:
        """True when this GEMM runs in FP8."""
        return self.precision is Precision.FP8

    @property
    def operand_b_fmt(self) -> Fp8Format:
        """Format of operand ``b`` with the default resolved."""
        return self.fmt if self.fmt_b is None else self.fmt_b

    def with_fast_accum(self) -> GemmPlan:
        """This plan with the backend's fast FP8 accumulation, where its backend is a built-in
        one that has it for the plan's scaling (``BACKEND_CONSTRAINTS``); itself otherwise (high
        precision, cuBLASLt's block scaling, or a backend registered later, whose modes are not
        known here).

        Example:
            >>> str(GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm").with_fast_accum())
            'fp8:e4m3/rowwise@torch_scaled_mm+fast'
        """
        known = BACKEND_CONSTRAINTS.get(self.backend)
        if not self.is_fp8 or known is None or self.scaling not in known[2]:
            return self
        return dataclasses.replace(self, fast_accum=True)

    def __str__(self) -> str:
        if not self.is_fp8:
            return "high"
        fmts = self.fmt.value
        if self.operand_b_fmt is not self.fmt:
            fmts += f"x{self.operand_b_fmt.value}"
        fast = "+fast" if self.fast_accum else ""
        return f"fp8:{fmts}/{self.scaling.value}@{self.backend}{fast}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (strings, bools, None), for checkpoints and logs."""
        return {
            "precision": self.precision.value,
            "fmt": self.fmt.value,
            "fmt_b": None if self.fmt_b is None else self.fmt_b.value,
            "scaling": self.scaling.value,
            "backend": self.backend,
            "fast_accum": self.fast_accum,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GemmPlan:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GemmPlan keys {sorted(unknown)}; expected {sorted(names)}")
        return cls(**d)


def _high() -> GemmPlan:
    return GemmPlan()


@dataclass(frozen=True, kw_only=True)
class LinearPlan:
    """One :class:`GemmPlan` per GEMM of a linear layer.

    Example:
        >>> LinearPlan.high_precision().forward.is_fp8
        False
    """

    forward: GemmPlan = field(default_factory=_high)
    """``y = x W^T``."""
    grad_input: GemmPlan = field(default_factory=_high)
    """``dX = dY W``."""
    grad_weight: GemmPlan = field(default_factory=_high)
    """``dW = dY^T X``."""
    key: str = field(init=False, repr=False, compare=False)
    """The plan as one canonical string (``LinearPlan.from_key(plan.key) == plan``), set at
    construction: what a ``torch.library`` custom op takes in place of the plan object
    (``kernels.opaque``), so that compiled code reads a constant instead of serializing."""

    def __post_init__(self) -> None:
        for name in ("forward", "grad_input", "grad_weight"):
            if not isinstance(getattr(self, name), GemmPlan):
                raise ValueError(f"LinearPlan.{name} must be a GemmPlan, got {getattr(self, name)!r}")
        object.__setattr__(self, "key", json.dumps(self.to_dict(), sort_keys=True))

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def from_key(key: str) -> LinearPlan:
        """Inverse of :attr:`key` (cached: custom ops decode their plan on every call)."""
        return LinearPlan.from_dict(json.loads(key))

    @classmethod
    def high_precision(cls) -> LinearPlan:
        """All three GEMMs in the input dtype (numerically identical to ``F.linear``)."""
        return cls()

    @classmethod
    def fp8(
        cls,
        fmt_fwd: Fp8Format = Fp8Format.E4M3,
        fmt_bwd: Fp8Format = Fp8Format.E5M2,
        scaling: Scaling = Scaling.ROWWISE,
        backend: str = "emulated",
        *,
        fast_accum_fwd: bool = False,
        fast_accum_bwd: bool = False,
        grad_weight_fp8: bool = True,
    ) -> LinearPlan:
        """All GEMMs in FP8 with the hybrid format recipe.

        Args:
            fmt_fwd: format of activations and weights.
            fmt_bwd: format of the output gradient ``dY`` (operand ``a`` of both backward GEMMs;
                operand ``b`` stays in ``fmt_fwd``).
            scaling: granularity of all operands.
            backend: backend of all three GEMMs.
            fast_accum_fwd: fast accumulation in the forward GEMM.
            fast_accum_bwd: fast accumulation in the backward GEMMs.
            grad_weight_fp8: False keeps the grad-weight GEMM in high precision (its operands
                need column-wise scales, and weight gradients are the most sensitive).
        """
        fwd = GemmPlan(
            precision=Precision.FP8,
            fmt=fmt_fwd,
            scaling=scaling,
            backend=backend,
            fast_accum=fast_accum_fwd,
        )
        bwd = GemmPlan(
            precision=Precision.FP8,
            fmt=fmt_bwd,
            fmt_b=fmt_fwd,
            scaling=scaling,
            backend=backend,
            fast_accum=fast_accum_bwd,
        )
        return cls(forward=fwd, grad_input=bwd, grad_weight=bwd if grad_weight_fp8 else _high())

    def __str__(self) -> str:
        return f"fwd={self.forward} dgrad={self.grad_input} wgrad={self.grad_weight}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return {
            "forward": self.forward.to_dict(),
            "grad_input": self.grad_input.to_dict(),
            "grad_weight": self.grad_weight.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinearPlan:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        unknown = set(d) - {"forward", "grad_input", "grad_weight"}
        if unknown:
            raise ValueError(f"unknown LinearPlan keys {sorted(unknown)}")
        return cls(**{k: GemmPlan.from_dict(v) for k, v in d.items()})
