"""The batched GEMM site: ``bmm(a, bt)`` of two activations (DLRM dot interaction, Wukong FM).

FP8 runs on the ``emulated`` backend only (no registered backend has a batched FP8 GEMM).

Example:
    >>> site = BmmSite()
    >>> site(torch.randn(2, 5, 8), torch.randn(2, 8, 5)).shape
    torch.Size([2, 5, 5])
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from loka_train.kernels.plan import LinearPlan
from loka_train.mods.planned import gemm_plans, planned_bmm
from loka_train.mods.probe_tap import OBSERVED_BATCHES
from loka_train.mods.site import Site

__all__ = ["OBSERVED_BATCHES", "BmmSite"]


class BmmSite(Site):
    """A batched GEMM of two activations, ``site(a, bt) == torch.bmm(a, bt)`` in high precision.

    Roles as for a linear layer with input ``a`` (B, M, K) and weight ``bt^T`` (B, N, K) per
    batch. FP8 runs on the ``emulated`` backend only. On a sampled step the observer gets
    the first ``OBSERVED_BATCHES`` batches as 2-D GEMMs: forward ``(a_rows, b_rows)`` stacked
    over those batches (the cross-batch products it adds have the same per-element error as
    the per-batch ones under row-wise scaling), and for the gradient roles ``dY`` as a
    block-diagonal matrix, so their products are exactly the per-batch ones; per-column
    scales of the second operand then span those batches.

    Example:
        >>> site = BmmSite()
        >>> site(torch.randn(2, 5, 8), torch.randn(2, 8, 5)).shape
        torch.Size([2, 5, 5])
    """

    kind: ClassVar[str] = "bmm"

    def supports_plan(self, plan: LinearPlan) -> tuple[bool, str]:
        ok, why = super().supports_plan(plan)
        if not ok:
            return ok, why
        for role, gp in gemm_plans(plan).items():
            if gp.is_fp8 and gp.backend != "emulated":
                return False, (
                    f"{role}: backend {gp.backend!r} has no batched FP8 GEMM; bmm sites run FP8 "
                    "only on 'emulated' (or keep them in high precision)"
                )
        return True, ""

    def forward(self, a_BMK: Tensor, bt_BKN: Tensor) -> Tensor:
        b, m, k = a_BMK.shape
        self._set_mkn((b * m, k, bt_BKN.shape[-1]))
        if self.plan_fp8:
            y = planned_bmm(a_BMK, bt_BKN, self.plan, compiled_quantizer=self.compiled_quantizer)
        else:  # planned_bmm's high-precision path, without reading the plan (a guard per GEMM)
            y = torch.bmm(a_BMK, bt_BKN)
        if self._should_observe():
            # The first OBSERVED_BATCHES batches, as one block-diagonal GEMM: x (s*M, K) and
            # w (s*N, K); dY is the block-diagonal of those batches' gradients.
            s = min(b, OBSERVED_BATCHES)
            x_MK = a_BMK[:s].detach().reshape(-1, k)
            w_NK = bt_BKN[:s].detach().transpose(1, 2).reshape(-1, k)
            y = self._observe(x_MK, w_NK, y, mkn=(b * m, k, bt_BKN.shape[-1]), kind="bmm")
        return y
