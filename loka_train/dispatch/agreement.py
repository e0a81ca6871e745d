"""The collective part of Dispatch: every rank plans from the same GEMM times.

A plan is a pure function of the config, the verdicts (from all-reduced statistics, identical
on every rank), the shapes (the same batch size everywhere) and the GEMM times
(``dispatch.planning``). Measured times differ from rank to rank, so before planning the ranks
agree on them: the union of the timing keys any rank holds (a rank measures those it lacks),
then the slowest (MAX) measurement of each. Every rank then applies the same plan at the same
step, and no rank waits on a collective the others skip. This is the only module of Dispatch
that talks to other ranks.

Example:
    >>> agree_on_timings(timer.timings, measure=timer_measure_key, device=torch.device("cuda"))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["agree_on_timings"]


def agree_on_timings(
    timings: dict[str, float], *, measure: Callable[[str], float], device: torch.device
) -> None:
    """Make ``timings`` identical on every rank, in place: the union of all ranks' keys, each
    with the largest time any rank measured. A no-op without an initialized process group of
    more than one rank, and with no timings.

    Every rank must call it at the same point (it runs ``all_gather_object`` and
    ``all_reduce``), with the keys it holds.

    Args:
        timings: timing key -> seconds (``timing.timing_key``); changed in place.
        measure: seconds of a key this rank lacks (measured here, as the others did).
        device: the device of the times' all-reduce under NCCL (gloo reduces on the CPU).
    """
    keys = sorted(timings)
    if not keys or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # Ranks may have measured different keys (cache hits); agree on the union first.
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, keys)
    union = sorted({k for ks in gathered for k in ks})
    for key in union:
        if key not in timings:
            timings[key] = measure(key)
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    vec = torch.tensor([timings[k] for k in union], dtype=torch.float64, device=where)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    for key, value in zip(union, vec.tolist()):
        timings[key] = value
