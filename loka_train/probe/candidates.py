"""What the Probe measures for every GEMM: the FP8 candidates and the operand conventions.

A *site* is one dense GEMM of the model (a Linear of an MLP, an interaction); each site has
three GEMMs, called *roles* (:data:`~loka_train.kernels.roles.ROLES`). Each role has two
operands, ``a`` and ``b`` (:data:`OPERANDS`); a *candidate* is one (format of ``a``, scaling)
pair, and the format of ``b`` follows from the role (:func:`operand_b_format`).

Example:
    >>> from loka_train.kernels.formats import Fp8Format, Scaling
    >>> Candidate(Fp8Format.E4M3, Scaling.ROWWISE).name
    'e4m3_rowwise'
    >>> operand_b_format("grad_input", Fp8Format.E5M2, Fp8Format.E4M3).value
    'e4m3'
"""

from __future__ import annotations

from dataclasses import dataclass

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES
from loka_train.probe.config import ProbeConfig

__all__ = ["OPERANDS", "ROLE_INDEX", "Candidate", "candidates_of", "operand_b_format"]

OPERANDS: tuple[str, str] = ("a", "b")
"""The two operands of a GEMM, in the order of ``observe(site, role, a, b)``."""

ROLE_INDEX: dict[str, int] = {role: i for i, role in enumerate(ROLES)}
"""Index of each role along the ``R`` axis of the window buffers."""


@dataclass(frozen=True)
class Candidate:
    """One FP8 configuration the Probe evaluates for every GEMM."""

    fmt: Fp8Format
    """Format of operand a (and of b in the forward GEMM)."""
    scaling: Scaling
    """Scale granularity of both operands."""

    @property
    def name(self) -> str:
        """Short name used in metric keys, e.g. ``e4m3_rowwise``."""
        return f"{self.fmt.value}_{self.scaling.value}"


def candidates_of(config: ProbeConfig) -> tuple[Candidate, ...]:
    """The product ``formats x scalings`` of ``config``, formats outermost.

    Args:
        config: the Probe's configuration.

    Example:
        >>> [c.name for c in candidates_of(ProbeConfig(formats=("e4m3",)))]
        ['e4m3_tensorwise', 'e4m3_rowwise']
    """
    return tuple(Candidate(fmt, scaling) for fmt in config.formats for scaling in config.scalings)


def operand_b_format(role: str, fmt: Fp8Format, backward_fmt_b: Fp8Format | None) -> Fp8Format:
    """Format of operand ``b`` for a candidate whose operand ``a`` is in ``fmt``.

    Args:
        role: the GEMM role.
        fmt: the candidate's format (of operand ``a``).
        backward_fmt_b: ``ProbeConfig.backward_fmt_b``; None uses ``fmt`` in every role.

    Returns:
        ``fmt`` in the forward GEMM, else ``backward_fmt_b`` when set.
    """
    return fmt if role == "forward" or backward_fmt_b is None else backward_fmt_b
