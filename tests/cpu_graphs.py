"""A CPU stand-in for ``runtime.graph_capture._CudaGraphed``: the static-buffer protocol of
``_Replay`` with "graphs" that compute ``y = x * w`` (unit and 2-rank DDP tests)."""

from __future__ import annotations

import torch
from torch import nn

from loka_train.runtime.graph_capture import PoolShare


class CpuGraphs:
    """The static-buffer protocol of `_Replay` with "graphs" that compute y = x * w on the CPU."""

    def __init__(self, w: nn.Parameter, *, shared_outputs: bool = False) -> None:
        self.params = (w,)
        self.share = PoolShare()
        self.fwd_hooks = self.bwd_hooks = ()
        self.shared_outputs = shared_outputs
        self.static_inputs = (torch.zeros(3),)
        self.static_outputs = (torch.zeros(3),)
        self.differentiable = (True,)
        self.static_grad_outputs = (torch.zeros(3),)
        self.static_grads = (torch.zeros(3), torch.zeros(3))
        self.grad_targets = [0, 1]
        outer = self

        class Fwd:
            def replay(self) -> None:
                outer.static_outputs[0].copy_(outer.static_inputs[0] * w.detach())

        class Bwd:
            def replay(self) -> None:
                dy = outer.static_grad_outputs[0]
                outer.static_grads[0].copy_(dy * w.detach())
                outer.static_grads[1].copy_(dy * outer.static_inputs[0])

        self.fwd, self.bwd = Fwd(), Bwd()
