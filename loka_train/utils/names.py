"""Module names as the user's model has them, whatever wraps it.

Example:
    >>> strip_wrapper_prefixes("_dmp_wrapped_module.module.dense_arch.model")
    'dense_arch.model'
"""

from __future__ import annotations

__all__ = ["strip_wrapper_prefixes"]

_WRAPPER_PREFIXES = ("_dmp_wrapped_module.", "module.")
"""What ``DistributedModelParallel`` and DDP put in front of the wrapped model's names."""


def strip_wrapper_prefixes(fqn: str) -> str:
    """``fqn`` without leading ``_dmp_wrapped_module.`` / ``module.`` (DMP / DDP wrappers)."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if fqn.startswith(prefix):
                fqn = fqn[len(prefix) :]
                changed = True
    return fqn
