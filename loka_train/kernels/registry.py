"""The GEMM backend registry: backends by name (the contract is ``kernels.gemm``).

Built-in backends (``backends.py``, registered on first use of the registry): ``emulated``
(dequantize + fp32 matmul, the numerical oracle, runs anywhere), ``bf16`` (dequantize to bf16
+ bf16 matmul, the high-precision baseline), ``torch_scaled_mm``, ``fbgemm_rowwise`` and
``triton``. They are built with the default :class:`~loka_train.kernels.settings.KernelSettings`
and its environment overrides (``LOKA_TRITON_AUTOTUNE=0``: an untuned ``triton`` backend);
``register_backend(TritonBackend(autotune=False), replace=True)`` sets it from code.

Nothing here touches hardware at import; capability checks run lazily and are cached.

Example:
    >>> from loka_train.kernels.formats import Fp8Format, Scaling
    >>> p = GemmProblem(m=64, k=32, n=16, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE,
    ...                 device_type="cpu", out_dtype=torch.float32, role="forward")
    >>> available_backends(p)["emulated"] is None
    True
"""

from __future__ import annotations

import logging
import threading

from loka_train.kernels import backends
from loka_train.kernels.gemm import Backend, GemmProblem
from loka_train.kernels.settings import KernelSettings

logger = logging.getLogger(__name__)

__all__ = [
    "register_backend",
    "get_backend",
    "registered_backends",
    "available_backends",
]


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
        for backend in backends.builtin_backends(KernelSettings().with_env_overrides()):
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
