"""A trained model's dense towers made ready to serve: each site in the precision its plan
chose for the forward GEMM, FP8 weights quantized once.

In inference the weights are fixed, so an FP8 site need not quantize its weight at every
call, as its training forward does (the weight changes at every optimizer step there).
:func:`serve` prepares a model that :func:`loka_train.mods.convert` converted (the trained one,
with the plans Dispatch chose, or plans given) for inference, in place:

* every site keeps its plan's forward GEMM (the backward roles are set to high precision:
  nothing runs them without autograd) and stops reporting to a Probe;
* an :class:`~loka_train.mods.site.Fp8Linear` whose forward is FP8 gets a
  :class:`ServedWeight`: its weight's FP8 payload, quantized once as the training forward
  quantizes it (the same quantizer, format, scaling and zero padding, from the weight rounded
  to the compute dtype), so that a call under ``torch.no_grad()`` quantizes only its input,
  with the kernel the training forward uses (Triton's one-pass quantizers where they run,
  the ReLU a folded site applies taken in the cast, the LayerNorm kernel emitting the FP8
  input where the training forward fuses it). On the device and backends the site trained
  on, with its scale slots as they are, such a call computes what the trained site's forward
  computes;
* a DCN cross layer's sites, whose weights live in the cross net, get theirs the same way
  (the cross net names them, ``CrossNet.site_weights``; the bias comes with each call);
* the other sites (batched ``bmm`` sites with two activations, horizontally fused ones whose
  weight is concatenated at call time) run their training forward with the forward plan,
  quantizing their weight at every call: :func:`served_sites` says which site runs how.

A call with autograd on runs the site's training path (its weight quantized per call, its
backward GEMMs in high precision); a weight changed after :func:`serve` is seen by calls
without autograd only after serving it again, and a site given another plan
(``Site.set_plan``) drops its served weight. Example::

    model = serve(trained_model)                # after training, or with plans=...
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model.model(dense, sparse)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loka_train.export.config import ServeConfig
from loka_train.kernels.formats import QTensor, Scaling
from loka_train.kernels.fused import apply_activation, fuses_quantizer, layernorm_linear_served
from loka_train.kernels.gemm import GemmProblem
from loka_train.kernels.linear import (
    compute_dtype,
    inductor_quantizes,
    quantize_operand,
    run_backend,
)
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend
from loka_train.mods.convert import sites as find_sites
from loka_train.mods.interaction import CrossNet
from loka_train.mods.planned import fp8_padding
from loka_train.mods.site import Fp8Linear, GemmSite

logger = logging.getLogger(__name__)

__all__ = ["ServedWeight", "serve", "serve_embeddings", "served_sites"]

_GEMMS: dict[str, GemmPlan] = {}
"""Served forward plans by their key, append-only (a plan, once interned, never changes).
Compiled code reads a served weight's plan through this one table: every site serving a plan
reads it from the same place, where reading it from each site's own attribute would be, for
dynamo, one object (and its enum members) reached from several places, a guard per place
evaluated at every call."""

_X = 0
"""Row of a site's static-scale slots that holds its input ``x`` (``kernels.static_scales``)."""


class ServedWeight(nn.Module):
    """One site's weight quantized once for its FP8 forward plan, and the forward that takes
    it (``y = x W^T + b``, only ``x`` quantized per call): the site's
    :class:`~loka_train.mods.site.ServedForward`.

    Its buffers (``w_data``, ``w_scale``, ``bias``) are the site's state-dict entries
    ``<site>.served.*``; the site's own parameters stay as they were. It serves the calls that
    pass the weight it was made from (that tensor, :meth:`serves`).

    Args:
        site: the site, with the FP8 forward plan it will serve.
        dtype: the compute dtype calls run in (the weight is rounded to it, then quantized).
        source: where the ``(N, K)`` weight the site is called with lives: ``(module, name)``
            or ``(ParameterList, index)``; default: an :class:`~loka_train.mods.site.Fp8Linear`'s
            own ``weight``, whose bias it then holds too (a source given: the bias comes with
            each call, as a DCN cross layer's). Looked up at each call, by place rather than by
            object, so that a deep copy serves its own weight and ``torch.export``'s traced
            parameters are recognised.

    Raises:
        ValueError: for a high-precision forward plan.
    """

    w_data: Tensor
    w_scale: Tensor
    bias: Tensor | None

    def __init__(self, site: GemmSite, dtype: torch.dtype, source: tuple[Any, str | int] | None = None) -> None:
        super().__init__()
        gemm = site.plan.forward
        if not gemm.is_fp8:
            raise ValueError(f"{site.site_name}: ServedWeight needs an FP8 forward plan, got {gemm}")
        self.owns_bias = source is None
        if source is None:
            if not isinstance(site, Fp8Linear):
                raise ValueError(f"{site.site_name}: a {type(site).__name__} takes its weight at call time: "
                                 "give its source")
            source = (site, "weight")
        # Kept out of the module's registries (no second state-dict entry, no submodule).
        self.__dict__["source"] = source
        weight = self.weight_source()
        bias = site.active_bias() if isinstance(site, Fp8Linear) and self.owns_bias else None
        self.gemm: GemmPlan = gemm
        # Built once: a LinearPlan's construction is not traceable (a graph break per call).
        self.forward_plan = LinearPlan(forward=gemm)
        self.gemm_key = self.forward_plan.key
        _GEMMS.setdefault(self.gemm_key, gemm)
        self.dtype = dtype
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        # The site's setting, as its training forward (eager code) reads it.
        self.reference_quantizer = inductor_quantizes(site.compiled_quantizer)
        # The zero columns of K and rows of N the backend needs at the shapes the site trained
        # at (M only where grad-weight runs FP8, which serving never does).
        m = site.gemm_shapes()["forward"][0] or 16
        pad = fp8_padding(self.forward_plan, m, self.k, self.n, site.pad_to_multiple, weight.device.type, dtype, False)
        self.pad_k, self.pad_n = (0, 0) if pad is None else (pad[1], pad[2])
        with torch.no_grad():
            w = F.pad(weight.detach().to(dtype), (0, self.pad_k, 0, self.pad_n))
            q = quantize_operand(w, gemm.operand_b_fmt, gemm, is_weight=True,
                                 reference_quantizer=self.reference_quantizer)
            b = None if bias is None else F.pad(bias.detach().to(dtype), (0, self.pad_n))
        if q.fmt is not gemm.operand_b_fmt or q.scaling is not gemm.scaling:  # weight_q takes them from the plan
            raise AssertionError(f"{site.site_name}: weight quantized as {q.fmt}/{q.scaling} for {gemm}")
        self.w_axis = q.axis
        self.w_block_size, self.w_block_2d = q.block_size, q.block_2d
        self.register_buffer("w_data", q.data)
        self.register_buffer("w_scale", q.scale)
        self.register_buffer("bias", b)
        # The padding of K and N, and whether the backend takes the GEMM, depend on the rows only
        # under block scaling; otherwise they are decided here (and again where the weight moves
        # to another device or is loaded), so that compiled code reads flags instead of tracing
        # the backends' checks (guards that dynamo evaluates at every call).
        self.rows_matter = gemm.scaling is Scaling.BLOCK
        self.pad_to_multiple = site.pad_to_multiple
        self._check_backend()

    def _check_backend(self) -> None:
        """Whether, on the weight's device now, the backend takes the GEMM (``backend_ok``) and
        asks for the padding the weight was quantized with (``pads_ok``), at any number of rows
        (scalings other than block do not read it)."""
        device = self.w_data.device.type
        pad = fp8_padding(self.forward_plan, 16, self.k, self.n, self.pad_to_multiple, device, self.dtype, False)
        self.pads_ok = pad is not None and (pad[1], pad[2]) == (self.pad_k, self.pad_n)
        problem = GemmProblem(
            m=16, k=self.k + self.pad_k, n=self.n + self.pad_n, fmt=self.gemm.fmt, fmt_b=self.gemm.operand_b_fmt,
            scaling=self.gemm.scaling, device_type=device, out_dtype=self.dtype, fast_accum=self.gemm.fast_accum,
        )
        self.backend_ok, self.backend_why = get_backend(self.gemm.backend).supports(problem)

    def weight_source(self) -> Tensor:
        """The weight at its source now (the tensor the site is called with)."""
        holder, key = self.__dict__["source"]
        return holder[key] if isinstance(key, int) else getattr(holder, key)

    def serves(self, weight: Tensor, site: GemmSite) -> bool:
        """Whether `weight` is the one at this payload's source (`site`'s own weight where it
        is its source: read from the site, not through the source, which compiled code would
        guard as the site reached from a second place)."""
        if self.owns_bias:
            return weight is getattr(site, self.__dict__["source"][1])
        return weight is self.weight_source()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _GEMMS.setdefault(self.gemm_key, self.gemm)  # a copy, or one loaded in another process
        self._check_backend()  # where it is loaded, maybe with other devices or backends

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # model.to(dtype) / .half() / .float() would cast the FP8 codes and scales (float8 is
        # a floating dtype) and the bias: only their device may follow the model.
        kept = {"w_data": self.w_data, "w_scale": self.w_scale, "bias": self.bias}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if before is not None and after is not None and after.dtype != before.dtype:
                setattr(self, name, before.to(device=after.device))
        self._check_backend()
        return self

    def weight_q(self, gemm: GemmPlan) -> QTensor:
        """The quantized weight, as the backends take it (`gemm`: its plan, from :data:`_GEMMS`)."""
        return QTensor(data=self.w_data, scale=self.w_scale, fmt=gemm.operand_b_fmt, scaling=gemm.scaling,
                       axis=self.w_axis, block_size=self.w_block_size, block_2d=self.w_block_2d)

    def _shape_served(self, site: GemmSite, x: Tensor) -> bool:
        """Whether this call's rows take the padding the weight was quantized with (else the
        site's training path runs, logged once and counted)."""
        m = x.numel() // self.k if self.k else 0
        pad = fp8_padding(self.forward_plan, m, self.k, self.n, site.pad_to_multiple,
                          x.device.type, self.dtype, False)
        if pad is not None and (pad[1], pad[2]) == (self.pad_k, self.pad_n):
            return True
        site.note_fallback(
            "served_padding",
            f"M={m} takes padding {pad} where the served weight has (K {self.pad_k}, N {self.pad_n}): "
            "this call quantizes the weight as in training",
        )
        return False

    def _check_dtype(self, site: GemmSite, x: Tensor) -> torch.dtype:
        cdtype = compute_dtype(x)
        if cdtype != self.dtype:
            raise ValueError(
                f"{site.site_name}: served for {self.dtype} (its FP8 weight quantized from the weight in "
                f"that dtype) but called in {cdtype}: call it with {self.dtype} inputs or under autocast "
                "to it (bf16), or without autocast (fp32), or serve it with ServeConfig(dtype=...) for "
                f"{cdtype}"
            )
        return cdtype

    def forward(self, site: GemmSite, x: Tensor, *, relu: bool, bias: Tensor | None = None) -> Tensor:
        """``site``'s forward on ``x`` (of ``relu(x)`` with ``relu``) with the served weight;
        `bias`: the call's, where the site takes its bias at call time (else its own)."""
        cdtype = self._check_dtype(site, x)
        if (self.rows_matter or not self.pads_ok) and not self._shape_served(site, x):
            return site.linear_as_trained(x, self.weight_source(), bias, input_relu=relu)
        k, n = self.k, self.n
        site._set_mkn((x.numel() // k if k else 0, k, n))  # the shape served (what a ledger times)
        bias_N = self.bias if self.owns_bias else (
            None if bias is None else F.pad(bias.to(cdtype), (0, self.pad_n)))
        with torch.autocast(x.device.type, enabled=False):
            x_MK = x.reshape(-1, k).to(cdtype)
            if self.pad_k:
                x_MK = F.pad(x_MK, (0, self.pad_k))
            slots = site.static_slots
            gemm = _GEMMS[self.gemm_key]
            x_q = quantize_operand(
                x_MK, gemm.fmt, gemm, is_weight=False, reference_quantizer=self.reference_quantizer,
                count_fallbacks=True, static=None if slots is None else slots[_X], relu=relu,
            )
            y_MN = self._gemm(gemm, x_q, cdtype, bias_N)
        if self.pad_n:
            y_MN = y_MN[:, :n]
        return y_MN.reshape(*x.shape[:-1], n)

    def _gemm(self, gemm: GemmPlan, x_q: QTensor, cdtype: torch.dtype, bias_N: Tensor | None) -> Tensor:
        """The forward GEMM on the quantized input and weight: through ``run_backend``'s checks
        eagerly, under block scaling, and where :meth:`_check_backend` found the backend refusing
        it (``run_backend`` then raises, naming the fix); compiled, the backend's call itself."""
        if self.rows_matter or not self.backend_ok or not torch.compiler.is_compiling():
            return run_backend(gemm, x_q, self.weight_q(gemm), out_dtype=cdtype, role="forward", bias_N=bias_N)
        backend: Any = get_backend(gemm.backend)
        return backend(x_q, self.weight_q(gemm), out_dtype=cdtype, bias=bias_N, fast_accum=gemm.fast_accum)

    def forward_layernorm(self, site: Fp8Linear, x: Tensor, norm: nn.LayerNorm, activation: str) -> Tensor | None:
        """``act(site(norm(x)))`` with the LayerNorm kernel emitting the FP8 input, where the
        training forward fuses them (``Fp8Linear.forward_layernorm``); None where it does not
        (the caller then runs the separate modules)."""
        cdtype = self._check_dtype(site, x)
        k = self.k
        x_MK = x.reshape(-1, k)
        gemm = _GEMMS[self.gemm_key]
        if self.pad_k or not fuses_quantizer(gemm, x_MK, self.reference_quantizer):
            return None
        if (self.rows_matter or not self.pads_ok) and not self._shape_served(site, x):  # counted there
            return apply_activation(
                site.linear_as_trained(norm(x), site.weight, site.active_bias(), input_relu=False), activation)
        site._set_mkn((x_MK.shape[0], k, self.n))
        with torch.autocast(x.device.type, enabled=False):
            lnw = None if norm.weight is None else norm.weight.to(cdtype)
            lnb = None if norm.bias is None else norm.bias.to(cdtype)
            y_MN = layernorm_linear_served(
                x_MK.to(cdtype), lnw, lnb, norm.eps, self.weight_q(gemm), self.bias, gemm,
                activation=activation, out_dtype=cdtype,
            )
        if self.pad_n:
            y_MN = y_MN[:, : self.n]
        return y_MN.reshape(*x.shape[:-1], self.n)

    def extra_repr(self) -> str:
        return f"{self.gemm}, {self.dtype}, weight {tuple(self.w_data.shape)} quantized once"


def serve(
    model: nn.Module, *, config: ServeConfig | None = None, plans: Mapping[str, LinearPlan] | None = None
) -> nn.Module:
    """Prepare `model`'s LoKA sites for inference, in place (see the module docstring); returns
    `model`, in eval mode.

    Args:
        model: a model :func:`loka_train.mods.convert` converted (wrappers such as
            ``DistributedModelParallel`` included), with its trained weights.
        config: the compute dtype and whether FP8 weights are quantized once
            (:class:`~loka_train.export.config.ServeConfig`).
        plans: site name -> plan (the forward GEMM's is served), e.g. Dispatch's
            ``export()`` read back with ``LinearPlan.from_dict``; default: each site's
            current plan.

    Raises:
        ValueError: where `model` has no site, or `plans` names a site it does not have.
    """
    cfg = config or ServeConfig()
    found = find_sites(model)
    if not found:
        raise ValueError(
            "serve: the model has no LoKA site; convert it with loka_train.mods.convert (as the "
            "LoKA callback does before sharding) and load its trained weights first"
        )
    unknown = sorted(set(plans or {}) - set(found))
    if unknown:
        raise ValueError(f"serve: plans name sites the model does not have: {unknown}; its sites: {sorted(found)}")
    model.eval()
    fast = 0
    for name, site in found.items():
        plan = (plans or {}).get(name, site.plan)
        site.detach_observer()
        site.set_sampling(False)
        forward = plan.forward.with_fast_accum() if cfg.fast_accum else plan.forward
        fast += forward.fast_accum
        site.set_plan(LinearPlan(forward=forward))
        if "served" in site._modules:
            del site._modules["served"]  # served before: quantized anew for this plan and dtype
        if isinstance(site, Fp8Linear) and plan.forward.is_fp8 and cfg.quantize_weights_once:
            site.served = ServedWeight(site, cfg.torch_dtype)
    if cfg.quantize_weights_once:
        # Sites whose weight lives in their parent (DCN's cross layers): the parent names it.
        for module in model.modules():
            if isinstance(module, CrossNet):
                for site, source in module.site_weights():
                    if site.plan.forward.is_fp8:
                        site.served = ServedWeight(site, cfg.torch_dtype, source=source)
    if cfg.embeddings != "trained":
        serve_embeddings(model, cfg.embeddings)
    logger.info(
        "serve: %d sites, %d FP8 forwards (%d with fast accumulation), %d with their weight quantized once "
        "(%s; embedding tables %s)",
        len(found), sum(s.plan.forward.is_fp8 for s in found.values()), fast,
        sum("served" in s._modules for s in found.values()), cfg.dtype, cfg.embeddings,
    )
    return model


def serve_embeddings(model: nn.Module, embeddings: str) -> int:
    """`model`'s TorchRec embedding bag collections replaced, in place, by TorchRec's inference
    modules with their tables in `embeddings` ("fp16", or "int8": row-wise, a scale and bias per
    row; ``torchrec.inference.modules.quantize_embeddings``), in eval mode. Collections served so
    before in the same format are left as they are. Returns how many collections serve quantized
    tables now.

    Raises:
        ValueError: for another `embeddings`, a model with no TorchRec embedding bag collection,
            or one whose tables were served in another format before.
    """
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.embedding_configs import DataType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    from loka_train.export.config import EMBEDDINGS

    dtype = EMBEDDINGS.get(embeddings)
    if dtype is None:
        raise ValueError(f"serve_embeddings: embeddings={embeddings!r}: choose one of "
                         f"{sorted(k for k, v in EMBEDDINGS.items() if v is not None)}")
    want = {"fp16": DataType.FP16, "int8": DataType.INT8}[embeddings]
    for module in model.modules():
        if isinstance(module, QuantEmbeddingBagCollection):
            other = sorted({c.data_type.value for c in module.embedding_bag_configs()} - {want.value})
            if other:
                raise ValueError(f"serve_embeddings: the tables already serve in {other}, not {embeddings}: serve "
                                 "the trained model again (load_trained) to serve them in another format")
    if any(isinstance(m, EmbeddingBagCollection) for m in model.modules()):
        quantize_embeddings(model, dtype=dtype, inplace=True)
    served = [m for m in model.modules() if isinstance(m, QuantEmbeddingBagCollection)]
    if not served:
        raise ValueError("serve_embeddings: the model has no TorchRec EmbeddingBagCollection to serve; serve it "
                         "with embeddings='trained'")
    for module in served:
        module.eval()
    logger.info("serve: %d embedding bag collections in TorchRec's inference modules, tables in %s",
                len(served), embeddings)
    return len(served)


def weight_servable_sites(model: nn.Module) -> set[str]:
    """The sites whose weight :func:`serve` can find and quantize once under an FP8 forward
    plan (``ServeConfig.quantize_weights_once``): an ``Fp8Linear``'s own weight, a DCN cross
    layer's (its cross net names it). The others (batched ``bmm`` sites, horizontally fused
    ones) take their weight at call time and quantize it there."""
    crossed = {id(site) for module in model.modules() if isinstance(module, CrossNet)
               for site, _ in module.site_weights()}
    return {name for name, site in find_sites(model).items() if isinstance(site, Fp8Linear) or id(site) in crossed}


def served_sites(model: nn.Module) -> dict[str, str]:
    """How each site of a served model runs its forward: site name -> description."""
    servable = weight_servable_sites(model)
    out: dict[str, str] = {}
    for name, site in find_sites(model).items():
        gemm = site.plan.forward
        if not gemm.is_fp8:
            out[name] = "high precision"
        elif "served" in site._modules:
            out[name] = f"{gemm}, weight quantized once"
        elif site.kind == "bmm":
            out[name] = f"{gemm}, two activations quantized at every call"
        elif name in servable:
            out[name] = f"{gemm}, weight quantized at every call (ServeConfig.quantize_weights_once is off)"
        else:
            out[name] = f"{gemm}, weight quantized at every call (its weight reaches it at call time)"
    return out
