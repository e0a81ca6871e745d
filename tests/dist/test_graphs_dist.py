"""Replayed dense steps under DDP (2 gloo ranks): what ``trainer.cuda_graphs`` does on several
GPUs, with the CPU stand-in of the CUDA graphs (``tests/cpu_graphs.py``).

A replay's backward hands the parameters fresh gradient copies; DDP's hooks on their
accumulators must still fire, so the gradients are averaged over the ranks and the replicas
stay identical after every optimizer step, as in an eager DDP step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.cpu_graphs import CpuGraphs
from tests.dist._multiprocess import run_multiprocess


class Replayed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.graphs = CpuGraphs(self.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from loka_train.runtime.graph_capture import _Replay

        (y,) = _Replay.apply(self.graphs, x, self.w)
        return y


def _body(rank: int, world_size: int) -> list[list[float]]:
    model = DistributedDataParallel(Replayed())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        x = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1) + step
        model(x).sum().backward()
        # d/dw sum(x * w) = x, averaged over the ranks by DDP.
        mean_x = torch.tensor([1.0, 2.0, 3.0]) * (world_size + 1) / 2 + step
        torch.testing.assert_close(model.module.w.grad, mean_x)
        assert all(model.module.w.grad.data_ptr() != g.data_ptr() for g in model.module.graphs.static_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append(model.module.w.detach().tolist())
    return seen


def test_ddp_averages_replayed_gradients_and_keeps_replicas_identical() -> None:
    first, second = run_multiprocess(_body, 2, timeout=120)
    assert first == second
    assert first[0] != [1.0, 2.0, 3.0]  # the optimizer moved the weights
