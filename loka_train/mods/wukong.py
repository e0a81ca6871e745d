"""Converted Wukong-style layers (``loka_train.models.wukong``): FM block, LCB and residual as sites.

Sites of one converted :class:`~loka_train.models.wukong.WukongLayer` at ``<layer>``:

* ``<layer>.fmb.bmm``: the FM interaction ``X (X^T Y)`` (:class:`BmmSite`);
* ``<layer>.fmb.mlp.0`` and ``<layer>.fmb.mlp.2``: the FM block's MLP (:class:`Fp8Linear`);
  with ``fused_norm_quant`` the FM LayerNorm, ``mlp.0`` and its ReLU run as one fused op
  (``Fp8Linear.forward_layernorm``), where on the ``triton`` FP8 backend the LayerNorm kernel
  emits the GEMM's FP8 input directly;
* without horizontal fusion: ``<layer>.fmb.proj``, ``<layer>.lcb.mix`` and, when the layer has
  one, ``<layer>.residual`` (:class:`Fp8Linear` each);
* with horizontal fusion: those three read the same ``X^T`` and run as ONE GEMM site
  ``<layer>.xt_proj`` (:class:`FusedLinearSite`); the three ``nn.Linear`` modules stay where
  they were as plain parameter holders (state dict unchanged) and are not sites.

Numerics: with high-precision plans and both fusions off, a converted layer is bit-identical
to the original (same op sequence). The fused LayerNorm op is bit-identical too (it uses the
same aten ops forward and backward). Horizontal fusion computes the same dot products, but the
gradient of ``X`` sums the three members' contributions inside one GEMM instead of three GEMMs
plus autograd's accumulation of three results already rounded to the compute dtype, so the
gradient of ``X`` differs from the original by reassociation: about 1e-6 relative in fp32,
about 1e-3 under bf16 autocast (one fp32 sum, then one rounding: not less accurate, but not
bit-identical). The tests bound both.

Shape legend: ``B`` batch, ``N`` embeddings entering a layer, ``D`` embedding dim, ``K`` FM rank,
``L`` LCB outputs, ``O`` layer outputs (residual width), ``T`` = K + L (+ O) fused width.

Example:
    >>> from loka_train.models.wukong import WukongLayer
    >>> layer = WukongLayer(num_in=5, dim=8, rank=4, num_fm_out=3, num_lcb_out=3, hidden=16)
    >>> conv = Fp8WukongLayer.from_layer(layer, horizontal_fusion=True)
    >>> conv(torch.randn(2, 5, 8)).shape
    torch.Size([2, 6, 8])
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from loka_train.kernels.plan import LinearPlan
from loka_train.models.wukong import FactorizationMachineBlock, WukongLayer
from loka_train.mods.bmm_site import BmmSite
from loka_train.mods.site import FoldedRelu, Fp8Linear, FusedLinearSite
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

__all__ = ["Fp8FMBlock", "Fp8WukongLayer"]


class Fp8FMBlock(FactorizationMachineBlock):
    """FM block with its ``bmm`` as a site and an optional fused LayerNorm -> Linear -> ReLU.

    Keeps the original ``proj``, ``norm`` and ``mlp`` submodules (their Linears may already be
    :class:`Fp8Linear` sites), so parameter names do not change.
    """

    def __init__(
        self,
        block: FactorizationMachineBlock,
        *,
        fused_norm_quant: bool = True,
        plan: LinearPlan | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.num_out = block.num_out
        self.dim = block.dim
        self.proj = block.proj
        self.norm = block.norm
        self.mlp = block.mlp
        self.bmm = BmmSite(plan=plan)
        self.fused_norm_quant = bool(fused_norm_quant)

    def _fusable(self) -> bool:
        mlp = self.mlp
        return (
            self.fused_norm_quant
            and isinstance(self.norm, nn.LayerNorm)
            and isinstance(mlp, nn.Sequential)
            and len(mlp) == 3
            and isinstance(mlp[0], Fp8Linear)
            and isinstance(mlp[1], nn.ReLU | FoldedRelu)
        )

    def forward(self, x_BND: Tensor) -> Tensor:
        xt_BDN = x_BND.transpose(1, 2)
        proj_BDK = self.proj(xt_BDN)
        return self.forward_from_proj(x_BND, proj_BDK)

    def forward_from_proj(self, x_BND: Tensor, proj_BDK: Tensor) -> Tensor:
        """The block after its projection (horizontal fusion computes the projection)."""
        fm_BNK = self.bmm(x_BND, proj_BDK)
        flat = fm_BNK.flatten(1)
        first = self.mlp[0]
        if self._fusable() and isinstance(first, Fp8Linear):
            second = self.mlp[2]
            folded = isinstance(self.mlp[1], FoldedRelu) and isinstance(second, Fp8Linear)
            # A ReLU folded into mlp.2 (mods.fold_relu) is applied by the fused op where it runs
            # (free in its GEMM's epilogue and its backward's cast), else by mlp.2's cast.
            in_op = not folded or first.runs_fused_norm(flat)
            with profiled("loka/mods/fused_norm_linear"):
                h = first.forward_layernorm(flat, self.norm, activation="relu" if in_op else "none")
            out = second(h, input_relu=False) if folded and in_op else second(h)
        else:
            out = self.mlp(self.norm(flat))
        return out.view(-1, self.num_out, self.dim)

    def extra_repr(self) -> str:
        return f"fused_norm_quant={self.fused_norm_quant}"


class Fp8WukongLayer(WukongLayer):
    """A :class:`WukongLayer` whose GEMMs are sites, optionally horizontally fused.

    Built by :meth:`from_layer`; keeps ``fmb``, ``lcb``, ``residual`` and ``norm`` under their
    names. With ``xt_proj`` set (horizontal fusion), the FM projection, LCB mix and residual
    projection are computed by it in one GEMM.
    """

    fmb: Fp8FMBlock
    xt_proj: FusedLinearSite | None

    def __init__(
        self,
        layer: WukongLayer,
        *,
        fmb: Fp8FMBlock,
        xt_proj: FusedLinearSite | None,
    ) -> None:
        nn.Module.__init__(self)
        self.fmb = fmb
        self.lcb = layer.lcb
        self.residual = layer.residual
        self.norm = layer.norm
        self.xt_proj = xt_proj

    @classmethod
    def from_layer(
        cls,
        layer: WukongLayer,
        *,
        horizontal_fusion: bool = True,
        fused_norm_quant: bool = True,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
        convert_linear: bool = True,
        drop_bias: bool = False,
    ) -> Fp8WukongLayer:
        """Convert ``layer`` (in place for its submodules), taking over every Parameter.

        Args:
            layer: the layer to convert.
            horizontal_fusion: one GEMM site for the projections of ``X^T``.
            fused_norm_quant: fused LayerNorm -> Linear -> ReLU in the FM block.
            plan: initial plan of every site.
            pad_to_multiple: pad multiple for FP8 GEMMs.
            convert_linear: convert the FM MLP Linears (``convert`` passes its filter's answer
                through :func:`loka_train.mods.convert`; here all or nothing).
            drop_bias: drop the biases of the converted FM MLP Linears.
        """
        fmb = layer.fmb
        if convert_linear:
            for idx in (0, 2):
                lin = fmb.mlp[idx]
                if isinstance(lin, nn.Linear) and not isinstance(lin, Fp8Linear):
                    fmb.mlp[idx] = Fp8Linear.from_linear(
                        lin, plan=plan, pad_to_multiple=pad_to_multiple, drop_bias=drop_bias
                    )
        new_fmb = Fp8FMBlock(fmb, fused_norm_quant=fused_norm_quant, plan=plan)
        members = [fmb.proj, layer.lcb.mix]
        if isinstance(layer.residual, nn.Linear):
            members.append(layer.residual)
        xt_proj = None
        if horizontal_fusion:
            xt_proj = FusedLinearSite(members, plan=plan, pad_to_multiple=pad_to_multiple)
        else:
            new_fmb.proj = Fp8Linear.from_linear(fmb.proj, plan=plan, pad_to_multiple=pad_to_multiple)
            layer.lcb.mix = Fp8Linear.from_linear(layer.lcb.mix, plan=plan, pad_to_multiple=pad_to_multiple)
            if isinstance(layer.residual, nn.Linear):
                layer.residual = Fp8Linear.from_linear(
                    layer.residual, plan=plan, pad_to_multiple=pad_to_multiple
                )
        return cls(layer, fmb=new_fmb, xt_proj=xt_proj)

    def forward(self, x_BND: Tensor) -> Tensor:
        if self.xt_proj is None:
            # Op for op as WukongLayer.forward (keeps gradients bit-identical).
            out_BND = torch.cat([self.fmb(x_BND), self.lcb(x_BND)], dim=1)
            if isinstance(self.residual, nn.Identity):
                res_BND = x_BND
            else:
                res_BND = self.residual(x_BND.transpose(1, 2)).transpose(1, 2)
            return self.norm(out_BND + res_BND)
        xt_BDN = x_BND.transpose(1, 2)
        parts = self.xt_proj(xt_BDN)
        proj_BDK, mix_BDL = parts[0], parts[1]
        fm_BFD = self.fmb.forward_from_proj(x_BND, proj_BDK)
        out_BND = torch.cat([fm_BFD, mix_BDL.transpose(1, 2)], dim=1)
        res_BND = x_BND if len(parts) == 2 else parts[2].transpose(1, 2)
        return self.norm(out_BND + res_BND)
