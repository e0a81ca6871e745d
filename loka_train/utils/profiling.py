"""Profiler ranges that cost nothing when no profiler runs.

``torch.profiler.record_function`` costs several microseconds per range even with no profiler
active (``python bench/site_overhead.py`` prints it: 7-9 us on the 2-core CPU dev machine,
torch 2.13), which adds up on a launch-bound step with a range per GEMM.
:func:`profiled` opens the range only while a profiler is recording.

Example:
    >>> with profiled("loka/gemm/forward/triton"):
    ...     pass
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["profiled"]

_NULL = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records; a no-op context otherwise."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return _NULL
    return torch.profiler.record_function(name)
