"""``convert``: install FP8-capable sites in a DLRM-family model; ``sites``: find them again.

``convert(model, config=..., module_filter_fn=...)`` walks the model once, in place:

=============================  ==========  ===============================================
module                         family      becomes
=============================  ==========  ===============================================
``nn.Linear`` (MLPs)           mlp         :class:`Fp8Linear` (takes over weight and bias)
TorchRec ``InteractionArch``   interaction :class:`DotInteraction` (site ``<fqn>.bmm``)
TorchRec ``LowRankCrossNet``   dcn         :class:`CrossNet` (sites ``<fqn>.layer<i>.V/W``)
``WukongLayer``                wukong      :class:`Fp8WukongLayer` (see ``mods.wukong``)
embedding modules              -           untouched (``DistributedModelParallel`` shards
                                           them by type)
=============================  ==========  ===============================================

Every replacement reuses the original ``Parameter`` objects, so the state dict keeps its keys
and tensors, and an optimizer built afterwards sees the same parameters. ``module_filter_fn
(module, fqn) -> bool`` is asked about every candidate (each Linear, and each interaction,
cross-net and Wukong layer as a whole); False leaves it alone. With ``keep_last_layer_high``
the last ``nn.Linear`` registered in the model (the logit layer of the DLRM family's over
arch) is left alone. Every conversion and every skip is logged once with its reason; a summary
:class:`ConvertReport` is stored on the model as ``model.loka_mods_report``.

Site names are the fully qualified names in the model given to ``convert``;
:func:`sites` returns them also through ``DistributedModelParallel`` / DDP wrappers.

Example:
    >>> model = build_model(ModelConfig(kind="dcn"), feature_names=["f0"],
    ...                     num_embeddings_per_feature=[10], num_dense=13, seed=0)
    >>> convert(model, config=ModsConfig(initial_plan="fp8_rowwise"))
    >>> sorted(sites(model))[:2]
    ['model.dense_arch.model._mlp.0._linear', 'model.dense_arch.model._mlp.1._linear']
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import InteractionArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.mlp import Perceptron

from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.settings import KernelSettings
from loka_train.models.wukong import WukongLayer
from loka_train.mods.config import ModsConfig
from loka_train.mods.interaction import CrossNet, DotInteraction
from loka_train.mods.site import FoldedRelu, Fp8Linear, Site
from loka_train.mods.wukong import Fp8FMBlock, Fp8WukongLayer
from loka_train.utils.names import strip_wrapper_prefixes

logger = logging.getLogger(__name__)

__all__ = ["ConvertReport", "convert", "sites"]

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass
class ConvertReport:
    """What one ``convert`` call did (stored as ``model.loka_mods_report``)."""

    converted: dict[str, str] = field(default_factory=dict)
    """Site name -> family."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Module fqn -> why it was left alone."""
    fallbacks: list[str] = field(default_factory=list)
    """Sites that could not take the initial plan and start in high precision, with why."""
    folded_relus: list[str] = field(default_factory=list)
    """Sites that apply the ReLU before them (``mods.fold_relu``)."""
    logit_feeder: str | None = None
    """The site whose output feeds the logit layer (the model's last ``nn.Linear``): the last
    site inside the nearest module before that layer in their container that holds a site
    (the DLRM family's top-MLP layer before the logit); None where there is none."""


def _is_embedding(module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return True
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return isinstance(module, EmbeddingBagCollection | EmbeddingCollection)


def _last_linear_fqn(model: nn.Module) -> str | None:
    last = None
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, Site):
            last = fqn
    return last


def _feeder_of(model: nn.Module, fqn: str) -> str | None:
    """The last site inside the nearest module registered before ``fqn`` in ``fqn``'s container
    that holds one (activations between them hold none: in a ``Sequential`` that is the module
    whose output reaches ``fqn``), or None."""
    parent_fqn, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    names = list(parent._modules)
    if child not in names:
        return None
    for before in reversed(names[: names.index(child)]):
        sibling = parent._modules[before]
        if sibling is None:
            continue
        prefix = f"{parent_fqn}.{before}" if parent_fqn else before
        found = [name for name, module in sibling.named_modules(prefix=prefix) if isinstance(module, Site)]
        if found:
            return found[-1]
    return None


class _Converter:
    def __init__(self, config: ModsConfig, module_filter_fn: ModuleFilter | None, last_linear: str | None) -> None:
        self.cfg = config
        self.filter = module_filter_fn
        self.last_linear = last_linear
        self.plan = config.initial_linear_plan()
        self.pad = config.padding
        kernels = KernelSettings(compiled_quantizer=config.compiled_quantizer).with_env_overrides()
        self.compiled_quantizer = kernels.compiled_quantizer
        self.report = ConvertReport()

    # -------------------------------------------------------------------- decisions
    def _skip(self, fqn: str, reason: str) -> None:
        self.report.skipped[fqn] = reason
        logger.info("mods: left %s alone: %s", fqn or "<root>", reason)

    def _wanted(self, module: nn.Module, fqn: str, family: str) -> bool:
        if family not in self.cfg.sites:
            self._skip(fqn, f"site family {family!r} is not in mods.sites={self.cfg.sites}")
            return False
        if self.filter is not None and not self.filter(module, fqn):
            self._skip(fqn, "module_filter_fn returned False")
            return False
        return True

    def _register(self, site: Site, name: str, family: str) -> None:
        site.site_name = name
        site.compiled_quantizer = self.compiled_quantizer
        site.relu_mask_bits = self.cfg.relu_mask_bits
        ok, why = site.supports_plan(self.plan)
        if not ok:
            site.set_plan(LinearPlan.high_precision())
            msg = f"{name}: initial plan not supported ({why}); starts in high precision"
            self.report.fallbacks.append(msg)
            logger.warning("mods: %s", msg)
        elif site.plan != self.plan:
            site.set_plan(self.plan)
        self.report.converted[name] = family
        logger.info("mods: converted %s (%s) -> %s [%s]", name, family, type(site).__name__, site.plan)

    def _name_sites(self, module: nn.Module, fqn: str, family: str) -> None:
        for sub, m in module.named_modules():
            if isinstance(m, Site) and not m.site_name:
                self._register(m, f"{fqn}.{sub}" if sub else fqn, family)

    # ------------------------------------------------------------------------- walk
    def walk(self, module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            new = self.convert_one(child, fqn)
            if new is not child:
                setattr(module, name, new)

    def convert_one(self, child: nn.Module, fqn: str) -> nn.Module:
        if isinstance(child, Site) or isinstance(child, DotInteraction | CrossNet | Fp8WukongLayer):
            self._skip(fqn, "already converted")
            return child
        if _is_embedding(child):
            self._skip(fqn, "embedding module: left to DistributedModelParallel")
            return child
        if type(child) is InteractionArch:
            if not self._wanted(child, fqn, "interaction"):
                return child
            new = DotInteraction.from_interaction(child, plan=None)
            self._name_sites(new, fqn, "interaction")
            return new
        if isinstance(child, InteractionArch):
            self._skip(fqn, f"{type(child).__name__} is not the dot interaction; its children are searched")
            self.walk(child, fqn)
            return child
        if isinstance(child, LowRankCrossNet):
            if not self._wanted(child, fqn, "dcn"):
                return child
            new = CrossNet.from_crossnet(
                child, epilogue_fusion=self.cfg.dcn_epilogue_fusion, tail_in_gemm=self.cfg.dcn_tail_in_gemm,
                pad_to_multiple=self.pad,
            )
            self._name_sites(new, fqn, "dcn")
            return new
        if isinstance(child, WukongLayer):
            return self._convert_wukong(child, fqn)
        if isinstance(child, nn.Linear):
            return self._convert_linear(child, fqn, "mlp")
        self.walk(child, fqn)
        return child

    def _convert_linear(self, lin: nn.Linear, fqn: str, family: str) -> nn.Module:
        if self.cfg.keep_last_layer_high and fqn == self.last_linear:
            self._skip(fqn, "final logit layer kept in high precision (keep_last_layer_high)")
            return lin
        if not self._wanted(lin, fqn, family):
            return lin
        site = Fp8Linear.from_linear(lin, pad_to_multiple=self.pad, drop_bias=self.cfg.drop_unstable_bias)
        if site.bias_dropped and lin.bias is not None:
            logger.info("mods: %s: bias dropped (zeroed and frozen; drop_unstable_bias)", fqn)
        self._register(site, fqn, family)
        return site

    def _convert_wukong(self, layer: WukongLayer, fqn: str) -> nn.Module:
        if not self._wanted(layer, fqn, "wukong"):
            return layer
        for idx in (0, 2):
            lin = layer.fmb.mlp[idx]
            if isinstance(lin, nn.Linear) and not isinstance(lin, Fp8Linear):
                layer.fmb.mlp[idx] = self._convert_linear(lin, f"{fqn}.fmb.mlp.{idx}", "wukong")
        new = Fp8WukongLayer.from_layer(
            layer,
            horizontal_fusion=self.cfg.horizontal_fusion,
            fused_norm_quant=self.cfg.fused_norm_quant,
            pad_to_multiple=self.pad,
            convert_linear=False,
        )
        self._name_sites(new, fqn, "wukong")
        return new


def convert(
    model: nn.Module,
    *,
    config: ModsConfig,
    module_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Replace the dense GEMMs of ``model`` by FP8-capable sites, in place (see module doc).

    Call it before ``DistributedModelParallel`` (on the unsharded model, e.g. in a callback's
    ``on_before_shard``).

    Args:
        model: the model (e.g. a ``RecTrainModel``); changed in place.
        config: which site families, adaptations and initial plan.
        module_filter_fn: ``(module, fqn) -> bool``; False leaves that candidate alone.

    Returns:
        ``model`` itself.

    Example:
        >>> convert(model, config=ModsConfig(sites=["mlp"]),
        ...         module_filter_fn=lambda m, fqn: "over_arch" not in fqn)
    """
    if not isinstance(config, ModsConfig):
        raise ValueError(f"config must be a ModsConfig, got {type(config).__name__}")
    if not config.enabled:
        logger.info("mods: disabled (mods.enabled=False); model left unchanged")
        setattr(model, "loka_mods_report", ConvertReport())  # noqa: B010 - a plain attribute
        return model
    last_linear = _last_linear_fqn(model)
    converter = _Converter(config, module_filter_fn, last_linear if config.keep_last_layer_high else None)
    if isinstance(model, Site):
        raise ValueError("convert needs a model that contains the sites, not a site itself")
    converter.walk(model, "")
    converter.report.logit_feeder = None if last_linear is None else _feeder_of(model, last_linear)
    if config.fold_relu:
        converter.report.folded_relus = fold_relus(model, grads=config.fold_relu_grad)
    for module in model.modules():
        if isinstance(module, Fp8FMBlock) and module._fusable():
            first = module.mlp[0]
            assert isinstance(first, Fp8Linear)  # _fusable checks it
            # The fused LayerNorm -> FP8 op feeds this site, not fp8_linear: nothing is reused.
            first.shares_operands = False
    report = converter.report
    setattr(model, "loka_mods_report", report)  # noqa: B010 - a plain attribute
    logger.info(
        "mods: %d sites converted, %d modules left alone, %d initial-plan fallbacks",
        len(report.converted), len(report.skipped), len(report.fallbacks),
    )
    return model


def _relu_fn(fn: object) -> bool:
    return fn is torch.relu or fn is F.relu or type(fn) is nn.ReLU


def fold_relus(model: nn.Module, *, grads: bool = False) -> list[str]:
    """Fold each ReLU that feeds a linear site straight into that site (``mods.fold_relu``):
    in every plain ``nn.Sequential`` (its own ``forward``), an ``nn.ReLU`` followed by an
    :class:`Fp8Linear`, and a TorchRec ``Perceptron`` whose activation is ``torch.relu`` (or
    ``F.relu``, ``nn.ReLU()``) followed by a ``Perceptron`` whose Linear is a site. The ReLU's
    place takes a :class:`FoldedRelu`; the site's ``input_relu`` is set. A module the model holds
    more than once (a site, or a Perceptron whose activation would change) is left alone: its
    other uses do not follow a ReLU. With ``grads`` (``mods.fold_relu_grad``), where the first
    Perceptron's Linear is a site too (used once, its width a multiple of 8), that site applies the
    ReLU's backward (its ``output_relu``; the second's ``input_relu_grad`` cleared). Returns the
    names of the sites that took a ReLU."""
    uses = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))

    def once(*modules: nn.Module) -> bool:
        return all(uses[id(m)] == 1 for m in modules)

    folded: list[str] = []
    producers: list[str] = []
    left: dict[str, str] = {}
    for seq in model.modules():
        if not isinstance(seq, nn.Sequential) or type(seq).forward is not nn.Sequential.forward:
            continue
        children = [(n, m) for n, m in seq._modules.items() if m is not None]  # every slot, repeats too
        for (name_a, a), (_, b) in zip(children, children[1:], strict=False):
            if type(a) is nn.ReLU and isinstance(b, Fp8Linear) and once(b) and not b.input_relu:
                setattr(seq, name_a, FoldedRelu())
                b.input_relu = True
                folded.append(b.site_name)
            elif (
                type(a) is Perceptron
                and type(b) is Perceptron
                and _relu_fn(a._activation_fn)
                and isinstance(b._linear, Fp8Linear)
                and once(a, b, b._linear)
                and not b._linear.input_relu
            ):
                a._activation_fn = FoldedRelu()
                b._linear.input_relu = True
                folded.append(b._linear.site_name)
                if grads:
                    producer = a._linear
                    why = _keeps_relu_grad(producer, once)
                    if why is None:
                        assert isinstance(producer, Fp8Linear)  # _keeps_relu_grad checked it
                        producer.output_relu = True
                        b._linear.input_relu_grad = False
                        producers.append(producer.site_name)
                    else:
                        left[b._linear.site_name] = why
    if folded:
        logger.info("mods: %d ReLUs folded into the next site's FP8 cast: %s", len(folded), ", ".join(folded))
    if producers:
        logger.info("mods: %d sites apply the backward of the folded ReLU after them (mods.fold_relu_grad): %s",
                    len(producers), ", ".join(producers))
    for site, why in left.items():
        logger.info("mods: %s applies its folded ReLU's backward itself (mods.fold_relu_grad): %s", site, why)
    return folded


def _keeps_relu_grad(producer: object, once: Callable[..., bool]) -> str | None:
    """Why the Linear before a folded ReLU cannot apply its backward (``mods.fold_relu_grad``),
    or None where it can."""
    if not isinstance(producer, Fp8Linear):
        return "the layer before it is not a site"
    if not once(producer):
        return "the layer before it is used more than once"
    if producer.out_features % 8:
        return f"the layer before it is {producer.out_features} wide, not a multiple of 8 (its mask's bits)"
    return None


def sites(model: nn.Module) -> dict[str, Site]:
    """Every :class:`Site` in ``model`` by ``site_name`` (also through DMP / DDP wrappers).

    A site that ``convert`` did not name gets its fqn without wrapper prefixes.

    Raises:
        ValueError: if two different sites have the same name.
    """
    out: dict[str, Site] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, Site):
            continue
        name = module.site_name or strip_wrapper_prefixes(fqn)
        if name in out and out[name] is not module:
            raise ValueError(f"two sites are named {name!r}")
        out[name] = module
    return out
