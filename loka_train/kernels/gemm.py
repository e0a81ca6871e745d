"""The GEMM contract: the problem a backend is asked to compute, and what a backend is.

A backend multiplies two FP8 operands that were quantized along the contraction dim:
``out = (a_q @ b_q^T)`` with ``a_q`` of shape ``(M, K)`` and ``b_q`` of shape ``(N, K)``, each
carrying its scales (:class:`~loka_train.kernels.formats.QTensor`). Each backend says whether
it can run a :class:`GemmProblem` and, if not, why (``supports``); ``kernels.registry`` holds
the backends by name and Dispatch picks among those that can.

Example:
    >>> from loka_train.kernels.formats import Fp8Format, Scaling
    >>> p = GemmProblem(m=64, k=32, n=16, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE,
    ...                 device_type="cpu", out_dtype=torch.float32, role="forward")
    >>> p.operand_b_fmt
    <Fp8Format.E4M3: 'e4m3'>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from loka_train.kernels.formats import Fp8Format, QTensor, Scaling, as_format, as_scaling

__all__ = ["Backend", "GemmProblem"]


@dataclass(frozen=True, kw_only=True)
class GemmProblem:
    """What a backend is asked to compute: ``(M, K) x (N, K)^T -> (M, N)``."""

    m: int
    """Rows of ``a`` and of the output."""
    k: int
    """Contraction length."""
    n: int
    """Rows of ``b`` = columns of the output."""
    fmt: Fp8Format
    """FP8 format of ``a``."""
    scaling: Scaling
    """Scale granularity of both operands."""
    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    out_dtype: torch.dtype
    """Output dtype (bf16 / fp32 / fp16)."""
    role: str = "forward"
    """Which GEMM of the layer (one of ``kernels.roles.ROLES``, or a free-form name)."""
    fmt_b: Fp8Format | None = None
    """FP8 format of ``b``; None means the same as ``fmt``."""
    fast_accum: bool = False
    """Whether fast FP8 accumulation is requested."""

    def __post_init__(self) -> None:
        # Served sites build problems in compiled code: members pass through (formats.as_format).
        object.__setattr__(self, "fmt", as_format(self.fmt))
        object.__setattr__(self, "scaling", as_scaling(self.scaling))
        if self.fmt_b is not None:
            object.__setattr__(self, "fmt_b", as_format(self.fmt_b))
        # Each size alone: min() over a symbolic M (torch.export) would guard it against K and N.
        if self.m < 0 or self.k < 0 or self.n < 0:
            raise ValueError(f"negative GEMM size m={self.m} k={self.k} n={self.n}")

    @property
    def operand_b_fmt(self) -> Fp8Format:
        """Format of ``b`` with the default resolved."""
        return self.fmt if self.fmt_b is None else self.fmt_b

    @classmethod
    def from_operands(
        cls,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        role: str = "forward",
        fast_accum: bool = False,
    ) -> GemmProblem:
        """The problem two quantized operands pose."""
        if a_q.data.ndim != 2 or b_q.data.ndim != 2:
            raise ValueError(
                f"operands must be 2-D, got {tuple(a_q.shape)} and {tuple(b_q.shape)}"
            )
        if a_q.shape[1] != b_q.shape[1]:
            raise ValueError(f"contraction mismatch: a {tuple(a_q.shape)} vs b {tuple(b_q.shape)}")
        if a_q.scaling is not b_q.scaling:
            raise ValueError(
                f"operands must share a scaling, got {a_q.scaling.value} and {b_q.scaling.value}"
            )
        return cls(
            m=a_q.shape[0],
            k=a_q.shape[1],
            n=b_q.shape[0],
            fmt=a_q.fmt,
            fmt_b=b_q.fmt,
            scaling=a_q.scaling,
            device_type=a_q.data.device.type,
            out_dtype=out_dtype,
            role=role,
            fast_accum=fast_accum,
        )


@runtime_checkable
class Backend(Protocol):
    """An FP8 GEMM implementation."""

    name: str

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        """``(True, "")`` if the problem can run here, else ``(False, why)``."""
        ...

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        """``a @ b^T (+ bias)`` with ``a_q`` (M, K) and ``b_q`` (N, K), both scaled along K."""
        ...
