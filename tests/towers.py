"""A model with the DLRM family's dense submodule names (``dense_arch``, ``over_arch``) around two
MLPs, for tests of the export of served towers on the CPU and the GPU."""

from __future__ import annotations

import torch
from torch import nn


class Towers(nn.Module):
    """``over_arch(relu(dense_arch(dense)) + sparse)``: ``width`` in, one logit out."""

    def __init__(self, width: int, hidden: int, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense_arch = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
        self.over_arch = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.over_arch(torch.relu(self.dense_arch(dense)) + sparse)
