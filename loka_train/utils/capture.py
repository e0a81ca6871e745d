"""Shared CUDA-graph capture housekeeping (Dispatch's graphed timing, ``runtime.graphs``)."""

from __future__ import annotations

import logging
import warnings

import torch

__all__ = ["reset_capture_state"]

logger = logging.getLogger(__name__)


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
