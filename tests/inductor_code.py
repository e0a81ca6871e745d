"""What inductor generated for a compiled function's backward: its lines, and where in them the
opaque FP8 op's backward (``loka::fn_backward``) is called (the DCN fusion test)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def backward_code(fn: Callable[..., Tensor], *args: Tensor) -> tuple[list[str], int]:
    """Compiles ``fn``, runs it forward and backward once (gradient ones) with inductor's caches
    off (a cached graph would not show a change of the op's backward), and returns the stripped
    lines of the backward's generated code and the index of the line that calls the op."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False)

    def step() -> None:
        y = compiled(*args)
        y.backward(torch.ones_like(y))

    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(step)
    lines = [ln.strip() for ln in codes[-1].splitlines()]
    op_at = next(i for i, ln in enumerate(lines) if "torch.ops.loka.fn_backward.default(" in ln)
    return lines, op_at
