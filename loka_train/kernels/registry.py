"""The GEMM backend registry.

A backend multiplies two FP8 operands that were quantized along the contraction dim:
``out = (a_q @ b_q^T)`` with ``a_q`` of shape ``(M, K)`` and ``b_q`` of shape ``(N, K)``, each
carrying its scales (:class:`~loka_train.kernels.formats.QTensor`). Each backend says whether
it can run a :class:`GemmProblem` and, if not, why; Dispatch picks among those that can.

Built-in backends (registered on first use of the registry, see ``backends.py``):
``emulated`` (dequantize + fp32 matmul, the numerical oracle, runs anywhere), ``bf16``
(dequantize to bf16 + bf16 matmul, the high-precision baseline), ``torch_scaled_mm``,
``fbgemm_rowwise`` and ``triton``.

Nothing here touches hardware at import; capability checks run lazily and are cached.

Example:
    >>> from loka_train.kernels.formats import Fp8Format, Scaling
    >>> p = GemmProblem(m=64, k=32, n=16, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE,
    ...                 device_type="cpu", out_dtype=torch.float32, role="forward")
    >>> available_backends(p)["emulated"] is None
    True
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from loka_train.kernels.formats import Fp8Format, QTensor, Scaling

logger = logging.getLogger(__name__)

__all__ = [
    "GemmProblem",
    "Backend",
    "register_backend",
    "get_backend",
    "registered_backends",
    "available_backends",
    "fp8_available",
]


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
        object.__setattr__(self, "fmt", Fp8Format(self.fmt))
        object.__setattr__(self, "scaling", Scaling(self.scaling))
        if self.fmt_b is not None:
            object.__setattr__(self, "fmt_b", Fp8Format(self.fmt_b))
        if min(self.m, self.k, self.n) < 0:
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


_LOCK = threading.Lock()
_REGISTRY: dict[str, Backend] = {}
_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if _BUILTINS_LOADED:
            return
        from loka_train.kernels import backends

        for backend in backends.builtin_backends():
            _REGISTRY.setdefault(backend.name, backend)
        _BUILTINS_LOADED = True


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry under ``backend.name``.

    Args:
        backend: object following the :class:`Backend` protocol.
        replace: allow overriding an already registered name.

    Raises:
        ValueError: if the name is taken and ``replace`` is False, or the object is not a Backend.
    """
    if not isinstance(backend, Backend):
        raise ValueError(f"{backend!r} does not follow the Backend protocol (name, supports, __call__)")
    _ensure_builtins()
    with _LOCK:
        if backend.name in _REGISTRY and not replace:
            raise ValueError(f"backend {backend.name!r} is already registered (pass replace=True)")
        _REGISTRY[backend.name] = backend
    logger.info("registered GEMM backend %r", backend.name)
    return backend


def registered_backends() -> list[str]:
    """Names of all registered backends."""
    _ensure_builtins()
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        KeyError: naming the registered backends when ``name`` is unknown.
    """
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown GEMM backend {name!r}; registered: {', '.join(sorted(_REGISTRY))}"
        ) from None


def available_backends(problem: GemmProblem) -> dict[str, str | None]:
    """Every registered backend mapped to None (can run ``problem``) or the reason it cannot."""
    _ensure_builtins()
    out: dict[str, str | None] = {}
    for name, backend in sorted(_REGISTRY.items()):
        ok, why = backend.supports(problem)
        out[name] = None if ok else (why or "unsupported")
    return out


def _device_key(device: torch.device | str | None) -> tuple[str, int | None]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    index = dev.index
    if dev.type == "cuda" and index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return dev.type, index


@functools.cache
def _fp8_available(device_type: str, index: int | None) -> tuple[bool, str]:
    if device_type == "cpu":
        return False, (
            "CPU has no FP8 matrix hardware: the emulated backend and torch._scaled_mm's CPU "
            "reference run for testing, not for speed"
        )
    if device_type != "cuda":
        return False, f"FP8 GEMMs are only wired up for CUDA devices, not {device_type!r}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this process"
    if torch.version.hip is not None:
        return False, "ROCm FP8 (e4m3fnuz) backends are not wired up"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, (
            f"{torch.cuda.get_device_name(index)} is sm_{major}{minor}; FP8 tensor cores need "
            "sm_89 (Ada) or sm_90+ (Hopper)"
        )
    return True, ""


def fp8_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``device`` has FP8 tensor cores, and why not. Checked once per device, lazily.

    Example:
        >>> fp8_available("cpu")[0]
        False
    """
    if torch.compiler.is_compiling():  # dynamo does not trace through functools caches
        return _fp8_available.__wrapped__(*_device_key(device))
    return _fp8_available(*_device_key(device))
