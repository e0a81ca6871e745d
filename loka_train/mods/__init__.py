"""loka_train.mods: FP8 model adaptations, installed by ``convert``.

Modules:
    config: ``ModsConfig`` (which site families, which adaptations, the initial plan).
    site: ``Site`` (the base of every converted module: plan, observer, GEMM shapes),
        ``Fp8Linear``, ``GemmSite``, ``FusedLinearSite`` (horizontal fusion), ``mark_sampled``,
        ``forwards_high`` (the FP8 forwards in high precision inside a block).
    bmm_site: ``BmmSite`` (a batched GEMM of two activations).
    planned: ``planned_linear``, ``planned_bmm`` (the GEMMs as a plan says, FP8 dims padded).
    interaction: ``DotInteraction`` (DLRM dot ``bmm``), ``CrossNet`` (DCN low-rank cross net
        with per-layer ``V``/``W`` sites and the fused epilogue).
    wukong: ``Fp8FMBlock``, ``Fp8WukongLayer`` (FM block, LCB, residual; horizontal fusion).
    convert: ``convert`` and ``sites``.

Registering the sites with a Probe (the LoKA callback)::

    for name, site in sites(model).items():
        probe.register_site(name, **site.probe_spec())
        site.attach_observer(probe)
    # at every step start: which sites report (and must run eagerly) on this step
    sampled = mark_sampled(sites(model).values(), step)

Example:
    >>> from loka_train.mods import ModsConfig, convert, sites
    >>> convert(model, config=ModsConfig(initial_plan="fp8_rowwise"))
    >>> for name, site in sites(model).items():
    ...     print(name, site.plan)
"""

from loka_train.mods.bmm_site import BmmSite
from loka_train.mods.config import INITIAL_PLANS, SITE_FAMILIES, ModsConfig
from loka_train.mods.convert import ConvertReport, convert, fold_relus, sites
from loka_train.mods.interaction import CrossNet, DotInteraction
from loka_train.mods.planned import planned_bmm, planned_linear
from loka_train.mods.site import (
    FoldedRelu,
    Fp8Linear,
    FusedLinearSite,
    GemmSite,
    Site,
    forwards_high,
    mark_sampled,
)
from loka_train.mods.wukong import Fp8FMBlock, Fp8WukongLayer

__all__ = [
    "FoldedRelu",
    "fold_relus",
    "INITIAL_PLANS",
    "SITE_FAMILIES",
    "BmmSite",
    "ConvertReport",
    "CrossNet",
    "DotInteraction",
    "Fp8FMBlock",
    "Fp8Linear",
    "Fp8WukongLayer",
    "FusedLinearSite",
    "GemmSite",
    "ModsConfig",
    "Site",
    "convert",
    "forwards_high",
    "planned_bmm",
    "mark_sampled",
    "planned_linear",
    "sites",
]
