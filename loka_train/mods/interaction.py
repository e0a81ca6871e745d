"""The DLRM dot interaction and the DCN low-rank cross network, with their GEMMs as sites.

* :class:`DotInteraction` replaces TorchRec's ``InteractionArch``: the batched ``E E^T`` of the
  combined embeddings is a :class:`~loka_train.mods.bmm_site.BmmSite` (child ``bmm``).
* :class:`CrossNet` replaces TorchRec's ``LowRankCrossNet``, which computes its layers with
  ``F.linear`` on ``ParameterList`` entries (no module swap reaches them). It keeps the same
  ``W_kernels`` / ``V_kernels`` / ``bias`` ParameterLists (state dict unchanged) and makes each
  layer's two GEMMs separate sites, children ``layer<i>.V`` (``x V^T``: ``N`` in, rank out) and
  ``layer<i>.W`` (``(x V^T) W^T``: rank in, ``N`` out), so site names read
  ``...crossnet.layer0.V`` and ``...crossnet.layer0.W``.

DCN epilogue fusion (``epilogue_fusion=True``): layer ``l`` computes
``x_{l+1} = x0 * (W (V x_l) + b) + x_l`` as the second GEMM with the bias in its epilogue,
then one ``torch.addcmul(x_l, x0, z)``: one elementwise kernel instead of three (bias add,
multiply, residual add). The backward is that of the formula: ``dZ = x0 * g``, the bias
gradient its column sum, traced beside the FP8 op for inductor to fuse, or, where ``W``'s
grad-weight runs in high precision and the rank is at most about half the width, a column of
that GEMM (``kernels.linear.folds_bias_grad``).
It applies to layers whose ``W`` GEMM runs an FP8 plan; a layer in high precision keeps
TorchRec's formula op for op, so a converted model without FP8 is bit-identical to the
original, also under bf16 autocast.
Numerics: identical math, but ``addcmul`` may use a fused multiply-add and a GEMM with bias may
round ``acc + b`` once, so results can differ from the unfused formula in the last bit (the
tests bound it; on exactly representable data they are equal). Under bf16 autocast the bias is
added in the GEMM's bf16 output instead of in fp32.

With ``tail_in_gemm`` (``mods.dcn_tail_in_gemm``, off by default), a layer whose ``W`` forward runs tensor-wise
FP8 where Triton runs computes ``x0 * z + x`` in that GEMM's epilogue (``kernels.triton_cross``)
and its bf16 copy, which the next layer's ``V`` GEMM reads (and the over-arch, after the last
layer: the net then returns the copy, the values its first GEMM takes under bf16 autocast);
``z`` is written for the backward and not read back. The tail's backward is the ``addcmul``'s,
traced (:class:`_CrossTail`); the copy's gradient flows to the fp32 stream (:class:`_Bf16Copy`).
Elsewhere (``GemmSite.linear_cross_tail``: a sampled step, a plan or call it does not take) the
layer runs the ``addcmul``.

Shape legend: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N`` = (F + 1) * D the
cross-net width, ``R`` the low rank.

Example:
    >>> from torchrec.modules.crossnet import LowRankCrossNet
    >>> cn = CrossNet.from_crossnet(LowRankCrossNet(in_features=24, num_layers=2, low_rank=4))
    >>> sorted(n for n, _ in cn.named_modules() if n)
    ['layer0', 'layer0.V', 'layer0.W', 'layer1', 'layer1.V', 'layer1.W']
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.models.dlrm import InteractionArch
from torchrec.modules.crossnet import LowRankCrossNet

from loka_train.kernels.plan import LinearPlan
from loka_train.mods.bmm_site import BmmSite
from loka_train.mods.site import GemmSite
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

__all__ = ["DotInteraction", "CrossNet", "CrossLayerSites"]


class _CrossTail(torch.autograd.Function):
    """``x_l + x0 * z`` whose value the GEMM's epilogue computed (``out``): returns ``out``,
    differentiates as ``torch.addcmul(x_l, x0, z)`` does (``dz = g * x0`` in ``z``'s dtype,
    ``d x0 = g * z``, ``d x_l = g``), in code the compiler traces and fuses. ``xl`` None: the
    first layer, whose ``x_l`` is ``x0`` (``d x0 = g * z + g``). Handed the same tensor in two
    of its inputs, a Function compiled by torch 2.11's dynamo keeps only one of their gradients
    (pytorch/pytorch#181146; later releases break the graph there instead)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, x0: Tensor, xl: Tensor | None, out: Tensor) -> Tensor:
        ctx.save_for_backward(z, x0)
        ctx.xl_is_x0 = xl is None
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        z, x0 = ctx.saved_tensors
        need_z, need_x0, need_xl = ctx.needs_input_grad[:3]
        dx0 = None
        if need_x0:
            dx0 = g * z + g if ctx.xl_is_x0 else g * z
        return (g * x0).to(z.dtype) if need_z else None, dx0, g if need_xl else None, None


class _Bf16Copy(torch.autograd.Function):
    """The bf16 copy of ``x`` that the epilogue wrote (``copy``): returns it, its gradient
    flowing to ``x`` in ``x``'s dtype (as ``x.to(torch.bfloat16)``'s)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, copy: Tensor) -> Tensor:
        ctx.x_dtype = x.dtype
        return copy

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g.to(ctx.x_dtype), None


class DotInteraction(InteractionArch):
    """TorchRec's ``InteractionArch`` with its ``bmm`` as a site (child ``bmm``).

    Example:
        >>> inter = DotInteraction.from_interaction(InteractionArch(num_sparse_features=3))
        >>> inter(torch.randn(4, 8), torch.randn(4, 3, 8)).shape
        torch.Size([4, 14])
    """

    def __init__(self, num_sparse_features: int, *, plan: LinearPlan | None = None) -> None:
        super().__init__(num_sparse_features)
        self.bmm = BmmSite(plan=plan)

    @classmethod
    def from_interaction(
        cls, arch: InteractionArch, *, plan: LinearPlan | None = None
    ) -> DotInteraction:
        """A converted copy of ``arch`` (it has no parameters; its index buffer is reused)."""
        new = cls(arch.F, plan=plan)
        new.triu_indices = arch.triu_indices
        return new

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        # Same ops as InteractionArch.forward, with torch.bmm replaced by the site.
        if self.F <= 0:
            return dense_features
        combined_values = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        interactions = self.bmm(combined_values, torch.transpose(combined_values, 1, 2))
        interactions_flat = interactions[:, self.triu_indices[0], self.triu_indices[1]]
        return torch.cat((dense_features, interactions_flat), dim=1)


class CrossLayerSites(nn.Module):
    """The two GEMM sites of one cross layer (no parameters of its own)."""

    def __init__(self, *, in_features: int, low_rank: int, plan: LinearPlan | None, pad_to_multiple: int) -> None:
        super().__init__()
        self.V = GemmSite(weight_shape=(low_rank, in_features), plan=plan, pad_to_multiple=pad_to_multiple)
        self.W = GemmSite(weight_shape=(in_features, low_rank), plan=plan, pad_to_multiple=pad_to_multiple)


class CrossNet(LowRankCrossNet):
    """``LowRankCrossNet`` with each layer's two GEMMs as sites and an optional fused epilogue.

    Args:
        W_kernels: the original ``W_kernels`` ParameterList (``(N, R)`` each); reused, not copied.
        V_kernels: the original ``V_kernels`` (``(R, N)`` each).
        bias: the original ``bias`` (``(N,)`` each).
        epilogue_fusion: compute ``x0 * (z + b) + x`` as bias-in-GEMM plus one ``addcmul``.
        tail_in_gemm: with ``epilogue_fusion``, that ``addcmul`` in the ``W`` GEMM's epilogue
            where the layer's call allows it (module docstring).
        plan: initial plan of every site.
        pad_to_multiple: pad multiple for FP8 GEMMs.
    """

    def __init__(
        self,
        *,
        W_kernels: nn.ParameterList,
        V_kernels: nn.ParameterList,
        bias: nn.ParameterList,
        epilogue_fusion: bool = True,
        tail_in_gemm: bool = False,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
    ) -> None:
        nn.Module.__init__(self)
        if not (len(W_kernels) == len(V_kernels) == len(bias)):
            raise ValueError("W_kernels, V_kernels and bias must have one entry per layer")
        self._num_layers = len(W_kernels)
        self._low_rank = int(V_kernels[0].shape[0]) if self._num_layers else 0
        self.W_kernels = W_kernels
        self.V_kernels = V_kernels
        self.bias = bias
        self.epilogue_fusion = bool(epilogue_fusion)
        self.tail_in_gemm = bool(tail_in_gemm)
        in_features = int(V_kernels[0].shape[1]) if self._num_layers else 0
        for i in range(self._num_layers):
            self.add_module(
                f"layer{i}",
                CrossLayerSites(
                    in_features=in_features, low_rank=self._low_rank, plan=plan,
                    pad_to_multiple=pad_to_multiple,
                ),
            )

    @classmethod
    def from_crossnet(
        cls,
        crossnet: LowRankCrossNet,
        *,
        epilogue_fusion: bool = True,
        tail_in_gemm: bool = False,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
    ) -> CrossNet:
        """Take over ``crossnet``'s ParameterLists (``new.W_kernels is crossnet.W_kernels``)."""
        return cls(
            W_kernels=crossnet.W_kernels,
            V_kernels=crossnet.V_kernels,
            bias=crossnet.bias,
            epilogue_fusion=epilogue_fusion,
            tail_in_gemm=tail_in_gemm,
            plan=plan,
            pad_to_multiple=pad_to_multiple,
        )

    def layer_sites(self, i: int) -> CrossLayerSites:
        """The sites of layer ``i``."""
        sites = getattr(self, f"layer{i}")
        assert isinstance(sites, CrossLayerSites)
        return sites

    def site_weights(self) -> list[tuple[GemmSite, tuple[nn.ParameterList, int]]]:
        """Each site of the layers with where the weight it is called with lives
        (``V_kernels[i]``, ``W_kernels[i]``): what ``loka_train.export.serve`` quantizes once."""
        out: list[tuple[GemmSite, tuple[nn.ParameterList, int]]] = []
        for i in range(self._num_layers):
            sites = self.layer_sites(i)
            out += [(sites.V, (self.V_kernels, i)), (sites.W, (self.W_kernels, i))]
        return out

    def forward(self, input: Tensor) -> Tensor:
        x0_BN = input
        x_BN = x0_BN
        read_BN = x_BN  # what the next GEMM reads: x_BN, or its bf16 copy from a fused tail
        for i in range(self._num_layers):
            sites = self.layer_sites(i)
            xv_BR = sites.V.linear(read_BN, self.V_kernels[i])
            if self.epilogue_fusion and sites.W.has_fp8():
                with profiled("loka/mods/dcn_epilogue"):
                    first = x_BN is x0_BN  # x_l is x0: handed once (_CrossTail)
                    fused = (sites.W.linear_cross_tail(xv_BR, self.W_kernels[i], self.bias[i], x0_BN,
                                                       None if first else x_BN)
                             if self.tail_in_gemm else None)
                    if fused is not None:
                        z_BN, out_BN, copy_BN = fused
                        x_BN = _CrossTail.apply(z_BN, x0_BN, None if first else x_BN, out_BN)
                        read_BN = _Bf16Copy.apply(x_BN, copy_BN)
                        continue
                    z_BN = sites.W.linear(xv_BR, self.W_kernels[i], self.bias[i])
                    x_BN = torch.addcmul(x_BN, x0_BN, z_BN)
            else:
                # The unfused formula, op for op as LowRankCrossNet.forward.
                xw_BN = sites.W.linear(xv_BR, self.W_kernels[i])
                x_BN = x0_BN * (xw_BN + self.bias[i]) + x_BN
            read_BN = x_BN
        return read_BN

    def extra_repr(self) -> str:
        return (f"num_layers={self._num_layers}, low_rank={self._low_rank}, epilogue_fusion={self.epilogue_fusion}, "
                f"tail_in_gemm={self.tail_in_gemm}")
