"""Shared CUDA-graph capture housekeeping (Dispatch's graphed timing, ``runtime.graphs``), and
host work that belongs to a graph's replays (:func:`after_replay`).

Host work inside a captured region runs once, at capture time; a replay runs only the recorded
kernels. Code that must do host work on every run of the region (the Probe writing a sample into
its window and counting it) calls :func:`after_replay`: outside a capture it runs the function at
once; inside a capture that :func:`replay_hooks` collects, it hands the function to the capture,
whose owner runs it after every replay; inside a capture's warm-up runs (``keep=False``) it drops
it (those runs are not steps). The function must read what it needs from tensors the captured
kernels write (their addresses are fixed) and from host state that is current at replay time.

Example:
    >>> with replay_hooks() as hooks:        # around the capture
    ...     with torch.cuda.graph(graph):
    ...         y = run()                   # run() may call after_replay(fn)
    >>> graph.replay()
    >>> for fn in hooks:
    ...     fn()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["after_replay", "capture_stream", "deferring", "replay_hooks", "reset_capture_state"]

logger = logging.getLogger(__name__)

ReplayHook = Callable[[], None]

_capture_streams: dict[int, torch.cuda.Stream] = {}
_capture_streams_lock = threading.Lock()


def capture_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """The side stream that LoKA's captures and their warm-up runs use on `device` (default: the
    current one): one per device for the whole process.

    PyTorch keeps a cuBLAS workspace for every (handle, stream) that runs a GEMM, allocated
    through its caching allocator and held until the process ends, whatever is deleted. A fresh
    stream per capture would keep one more workspace (megabytes each) allocated at every capture:
    at each re-capture after a plan change and each new Probe measurement graph. Graphs
    captured on one stream share its workspace, which is safe for LoKA's graphs: every capture
    and warm-up waits for the current stream's queued work and is waited for by it, and every
    replay runs on the current stream, so none of them overlap.

    Raises without CUDA (before any state changes).
    """
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, int):
        index = device
    elif device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    with _capture_streams_lock:
        stream = _capture_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _capture_streams[index] = stream
    return stream

# One capture runs at a time in a process, and its backward runs on autograd's device threads:
# the collector is process-wide (not thread-local), guarded by a lock.
_lock = threading.Lock()
_collectors: list[tuple[list[ReplayHook], bool]] = []


@contextlib.contextmanager
def replay_hooks(*, keep: bool = True) -> Iterator[list[ReplayHook]]:
    """Collect the :func:`after_replay` functions of the code run inside (a capture): the list
    yielded holds them, to run after every replay. ``keep=False`` (a capture's warm-up runs,
    which are not steps) drops them instead of running them."""
    hooks: list[ReplayHook] = []
    with _lock:
        _collectors.append((hooks, keep))
    try:
        yield hooks
    finally:
        with _lock:
            _collectors.pop()


def deferring() -> bool:
    """Whether code runs inside :func:`replay_hooks` (a capture or its warm-up): host work that
    :func:`after_replay` defers must then also avoid what a capture forbids (nested graphs,
    host syncs)."""
    return bool(_collectors)


def after_replay(fn: ReplayHook) -> None:
    """Run `fn` now, or after every replay of the graph being captured (inside
    :func:`replay_hooks`), or never (inside a warm-up run, ``keep=False``)."""
    with _lock:
        target = _collectors[-1] if _collectors else None
    if target is None:
        fn()
    elif target[1]:
        target[0].append(fn)


def reset_capture_state() -> None:
    """After a failed capture: a capture that never ended leaves the default CUDA generator in
    capture mode (the next random op outside a graph raises "Offset increment outside graph
    capture"); an empty capture that ends normally takes it out again.

    Example:
        >>> try:
        ...     with torch.cuda.graph(graph):
        ...         run()
        ... except Exception:
        ...     reset_capture_state()
        ...     raise
    """
    try:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty": that is the point
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                pass
        graph.reset()
    except Exception as exc:  # the original failure is raised by the caller
        logger.warning("could not reset the CUDA capture state after a failed capture: %s", exc)
