"""Sites: the FP8-capable modules that :func:`loka_train.mods.convert` installs.

A *site* is one dense GEMM of the model with its three GEMMs (roles): forward, grad-input and
grad-weight. Every site is an :class:`nn.Module` deriving from :class:`Site` and carries:

* ``site_name``: its fully qualified name in the model given to ``convert`` (wrappers such as
  ``DistributedModelParallel`` do not change it; :func:`loka_train.mods.sites` finds it);
* ``plan``: a :class:`~loka_train.kernels.plan.LinearPlan`, one ``GemmPlan`` per role, that
  Dispatch replaces between steps with :meth:`Site.set_plan` (validated, nothing reallocated);
* ``observer``: an optional :class:`~loka_train.probe.Probe`, and ``sampling``: whether the
  observer samples the site on the current step, set at every step start by
  :func:`mark_sampled` (the one place that asks the observer). On a sampled step a training
  forward (module in training mode, autograd on: evaluation forwards never take window slots)
  reports its GEMM operands as ``observer.observe(site_name, role, a, b)`` for all three roles,
  the gradient roles from a hook on the output's gradient, in the Probe's operand convention:
  ``forward (x_MK, w_NK)``, ``grad_input (dy_MN, w_NK)``, ``grad_weight (dy_MN, x_MK)``.
  Operands are the logical (unpadded) ones.

Registering sites with a Probe, and sampling them (what the LoKA callback does; it also
registers ``ConvertReport.logit_feeder`` with ``probe.logit_feeder_budget_db``'s floors)::

    for name, site in mods.sites(model).items():
        probe.register_site(name, **site.probe_spec())
        site.attach_observer(probe)
    for step in ...:
        probe.begin_step(step)
        sampled = mods.mark_sampled(mods.sites(model).values(), step)  # run these eagerly
        ...  # forward, backward

``probe_spec()`` returns the keyword arguments of ``Probe.register_site`` (``weight_shape``:
the ``(N, K)`` of the weight the forward and grad-input GEMMs see, or None for batched sites
whose second operand is an activation).

Kinds of sites (``Site.kind``):

* ``"linear"`` (:class:`GemmSite` and its subclasses): ``y = x W^T (+ b)``; every backend that
  supports the problem can run its FP8 GEMMs. All-HIGH plans call ``F.linear`` itself, so a
  high-precision site is bit-identical to the module it replaced.
* ``"bmm"`` (:class:`~loka_train.mods.bmm_site.BmmSite`): a batched GEMM ``torch.bmm(a, b)`` of two activations (DLRM dot
  interaction, Wukong FM). FP8 runs only on the ``emulated`` backend (no registered backend
  has a batched FP8 GEMM); :meth:`Site.supports_plan` says so and ``set_plan`` refuses others.

GEMM shapes (:meth:`Site.gemm_shapes`) use the backends' ``a @ b^T`` convention, i.e. the
``(m, k, n)`` of :class:`~loka_train.kernels.gemm.GemmProblem`, per role: forward
``(M, K, N)``, grad-input ``(M, N, K)``, grad-weight ``(N, M, K)``, where the layer computes
``(M, K) x (K, N)``. ``M`` is 0 until the first forward. For batched sites ``M`` counts the rows
of all batches together (``B * rows``) while ``K`` and ``N`` are per batch.

Padding (``pad_to_multiple > 1``): FP8 GEMM dims that a backend refuses are zero-padded at call
time (:mod:`loka_train.mods.planned`); high-precision GEMMs are never padded.

Shape legend: ``B`` batches, ``M`` rows, ``K`` contraction (in features), ``N`` out features.

Example:
    >>> lin = torch.nn.Linear(13, 7)
    >>> site = Fp8Linear.from_linear(lin, plan=LinearPlan.fp8(), pad_to_multiple=16)
    >>> site.weight is lin.weight
    True
    >>> site(torch.randn(4, 13)).shape
    torch.Size([4, 7])
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loka_train.kernels import static_scales
from loka_train.kernels.fused import (
    FUSED_ACTIVATIONS,
    apply_activation,
    fuses_quantizer,
    layernorm_linear,
)
from loka_train.kernels.linear import (
    _cross_tail_linear,
    compute_dtype,
    inductor_quantizes,
    takes_cross_tail,
)
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.kernels.registry import get_backend
from loka_train.mods import probe_tap
from loka_train.mods.planned import any_fp8, fp8_padding, gemm_plans, planned_linear

if TYPE_CHECKING:
    from loka_train.probe.probe import Probe

logger = logging.getLogger(__name__)

__all__ = [
    "Site",
    "GemmSite",
    "Fp8Linear",
    "FoldedRelu",
    "FusedLinearSite",
    "mark_sampled",
]

# ----------------------------------------------------------------------------------- sites


class Site(nn.Module):
    """Base of every converted module: a plan, an optional observer, GEMM shapes.

    Subclasses call ``nn.Module.__init__`` (directly or through another base) and then
    :meth:`_init_site`; this lets :class:`Fp8Linear` also be an ``nn.Linear`` without
    allocating a second weight.
    """

    kind: ClassVar[str] = "linear"
    """``"linear"`` or ``"bmm"`` (see the module docstring)."""

    shares_operands: bool = False
    """Whether its GEMMs hand tensor-wise FP8 operands to one another (the backward reuses the
    forward's ``x`` and ``W`` and grad-input's ``dY``, see ``kernels.linear``), so that Dispatch
    weighs them together. True for sites that run ``fp8_linear``; ``convert`` turns it off for
    a site fed by the fused LayerNorm op, which does not."""

    site_name: str
    plan: LinearPlan
    observer: Probe | None
    sampling: bool
    pad_to_multiple: int
    compiled_quantizer: str
    """What quantizes its FP8 GEMMs under ``torch.compile`` (``mods.compiled_quantizer``, set
    by ``convert``): ``"custom"`` (default) or ``"inductor"``."""

    def __init__(self, *, plan: LinearPlan | None = None, pad_to_multiple: int = 1) -> None:
        super().__init__()
        self._init_site(plan=plan, pad_to_multiple=pad_to_multiple)

    def _init_site(self, *, plan: LinearPlan | None, pad_to_multiple: int) -> None:
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        self.site_name = ""
        self._tap_id = probe_tap.register(self)
        self._module_requested: bool | None = None
        self.pad_to_multiple = int(pad_to_multiple)
        self.compiled_quantizer = "custom"
        self.observer = None
        self.sampling = False
        """Whether this site reports to its observer on the current step (see :func:`mark_sampled`)."""
        self._mkn = (0, 0, 0)
        self.num_fallbacks = 0
        """Times this site took a logged fallback (e.g. an unfusable padded shape)."""
        self.input_relu = False
        """Whether the site takes ``relu(x)`` for its input ``x``: the ReLU before it was folded
        into its FP8 cast (:class:`FoldedRelu`, ``mods.fold_relu``)."""
        self.relu_mask_bits = False
        """A folded ReLU's mask kept for the backward as one bit an element, not the input
        (``mods.relu_mask_bits``, set by ``convert``)."""
        self.input_relu_grad = True
        """With :attr:`input_relu`, whether this site applies the folded ReLU's backward; False
        where the site before it does (its :attr:`output_relu`, ``mods.fold_relu_grad``)."""
        self.output_relu = False
        """The site's output feeds a ReLU folded into the next site, whose backward this site
        applies (``mods.fold_relu_grad``): in its FP8 cast of ``dY`` (``kernels.fp8_linear``'s
        ``output_relu``), else as a ReLU on its output (sampled steps, plans without FP8)."""
        self.static_slots: Tensor | None = None
        """Static-scale slots ``(2, 4)`` of the FP8 ``x`` and ``dY`` (``kernels.static_scales``),
        or None (dynamic scales); see :meth:`GemmSite.enable_static_scales`."""
        self._logged_fallbacks: set[str] = set()
        self.plan = LinearPlan.high_precision()
        self.plan_fp8 = False
        """Whether the plan runs any GEMM in FP8 (kept by :meth:`set_plan`): what compiled
        forwards branch on, a plain flag, rather than on the plan's GEMMs (a guard each)."""
        if plan is not None:
            self.set_plan(plan)

    # -------------------------------------------------------------------------- plans
    def supports_plan(self, plan: LinearPlan) -> tuple[bool, str]:
        """Whether this site can run ``plan``, and why not (backend not registered, ...)."""
        if not isinstance(plan, LinearPlan):
            return False, f"plan must be a LinearPlan, got {type(plan).__name__}"
        for role, gp in gemm_plans(plan).items():
            if not gp.is_fp8:
                continue
            try:
                get_backend(gp.backend)
            except KeyError as e:
                return False, f"{role}: {e.args[0]}"
        return True, ""

    def has_fp8(self) -> bool:
        """Whether any of this site's GEMMs runs in FP8 under its current plan."""
        return self.plan_fp8

    def set_plan(self, plan: LinearPlan) -> None:
        """Replace the plan (Dispatch calls this between steps; nothing is reallocated).

        Raises:
            ValueError: if the site cannot run ``plan`` (the reason is included).
        """
        ok, why = self.supports_plan(plan)
        if not ok:
            raise ValueError(f"site {self.site_name or type(self).__name__!r} cannot take plan: {why}")
        served = self._modules.get("served")
        if served is not None and getattr(served, "gemm", None) != plan.forward:
            # A weight served for another forward plan (loka_train.export.serve): dropped, the
            # site runs its plan as in training until it is served again.
            del self._modules["served"]
        self.plan = plan
        self.plan_fp8 = any_fp8(plan)

    def gemm_shapes(self) -> dict[str, tuple[int, int, int]]:
        """role -> ``(m, k, n)`` of that GEMM as last run (see the module docstring)."""
        m, k, n = self._mkn
        return {"forward": (m, k, n), "grad_input": (m, n, k), "grad_weight": (n, m, k)}

    def weight_shape(self) -> tuple[int, int] | None:
        """``(N, K)`` of the weight operand, or None when it is an activation."""
        return None

    def probe_spec(self) -> dict[str, Any]:
        """Keyword arguments of ``Probe.register_site`` for this site."""
        return {"weight_shape": self.weight_shape()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) is a site of its own: its taps must not name the original.
        super().__setstate__(state)
        self._tap_id = probe_tap.register(self)

    # ----------------------------------------------------------------------- observer
    def attach_observer(self, probe: Probe) -> None:
        """Report operands to ``probe`` on the steps it samples this site (the site must be
        registered with it; :func:`mark_sampled` turns the reports on per step)."""
        self.observer = probe

    def detach_observer(self) -> None:
        """Stop reporting."""
        self.observer = None
        self.set_sampling(False)

    def set_sampling(self, on: bool) -> None:
        """Report (``on``) or not on the current step's training forwards (:func:`mark_sampled`
        sets it for every site at each step start)."""
        # nn.Module.__setattr__ costs microseconds; the flag changes on few steps.
        if on != self.sampling:
            self.sampling = on

    def forward_key(self) -> tuple[LinearPlan, bool]:
        """What, besides the parameters and inputs, decides what the forward does: the plan, and
        whether it reports to the observer (``sampling``). A loop that captures the forward
        captures it again (or takes the capture it keeps for that key) when it changes. (Code
        compiled for a requested module holds the taps, :meth:`module_requested`; such a module
        is not replayed from a capture of its compiled code.)"""
        return self.plan, self.sampling

    def module_requested(self, on: bool) -> None:
        """Whether the compiled module holding this site runs as requested on this step (the
        runtime's :class:`~loka_train.runtime.eager.EagerSteps` tells, at each step start): its
        compiled code then holds a tap at every site, each reporting only where its site samples,
        so the module compiles one sampled variant whichever of its sites sample. A site never
        told (no such loop) guards compiled code on its own ``sampling`` flag instead."""
        if on != self._module_requested:  # nn.Module.__setattr__ costs microseconds
            self._module_requested = on

    def _set_mkn(self, mkn: tuple[int, int, int]) -> None:
        # Not in compiled code: a module attribute written there is a guard that fails on the
        # next call (a recompile per module, and per batch shape). Eager calls record it, and
        # compiled sampled steps through their taps (which run as opaque ops): Dispatch plans
        # from the shapes the Probe's sampled steps saw.
        if torch.compiler.is_compiling():
            return
        # nn.Module.__setattr__ costs microseconds on every call; shapes rarely change.
        if mkn != self._mkn:
            self._mkn = mkn

    def _should_observe(self) -> bool:
        """Whether this forward reports to the observer: a training forward on a sampled step.

        Evaluation runs between steps (``Trainer.evaluate`` puts the model in eval mode under
        ``no_grad`` after step ``s``, while step ``s`` may still be a sampled one); its batches
        must not take the window slots of a sampled training step. All checks are plain attribute
        and grad-mode reads, which dynamo guards on like any module flag: code compiled for an
        unsampled training step or for an evaluation holds no report, and code compiled for a
        sampled step holds the taps (:meth:`_observe`), without a graph break. Compiled code
        reads whether its module is requested (:meth:`module_requested`) where a loop says so,
        instead of the site's own flag: one compiled variant per module, whichever of its sites
        sample, rather than a variant per set of sampled sites.
        """
        if not (self.training and torch.is_grad_enabled() and self.observer is not None):
            return False
        if torch.compiler.is_compiling():
            told = self._module_requested  # not a guard on self.sampling where a loop tells
            return self.sampling if told is None else told
        return self.sampling

    def _observe(
        self,
        a: Tensor,
        b: Tensor,
        y: Tensor,
        *,
        mkn: tuple[int, int, int],
        z_MN: Tensor | None = None,
        activation: str = "none",
        kind: str = "linear",
    ) -> Tensor:
        """Report the forward operands ``(a, b)`` now and both gradient roles when ``y``'s
        gradient arrives (``dY`` from it as :data:`probe_tap.KINDS` says: through the activation
        of ``z_MN``, or the block-diagonal of a batched site's observed batches); return the
        tensor to continue with. Eager code calls the observer and hooks ``y``; compiled code
        gets the ``loka::probe_tap`` op (:mod:`loka_train.mods.probe_tap`: no graph break, the
        same reports), which also records the GEMM shape ``mkn`` that eager calls record."""
        if torch.compiler.is_compiling():
            return torch.ops.loka.probe_tap(y, a, b, z_MN, self._tap_id, kind, activation, list(mkn))
        self._observe_eager(a, b, y, z_MN, activation, kind)
        return y

    def _observe_eager(
        self, a: Tensor, b: Tensor, y: Tensor, z_MN: Tensor | None, activation: str, kind: str
    ) -> None:
        probe_tap.report_forward(self, a, b)
        if not y.requires_grad:
            return

        def hook(grad: Tensor) -> None:
            probe_tap.report_grads(self, grad, a, b, z_MN, kind, activation)

        y.register_hook(hook)

    def note_fallback(self, key: str, message: str) -> None:
        """Count a fallback (``num_fallbacks``) and log it once per site and kind."""
        self.num_fallbacks += 1
        if key not in self._logged_fallbacks:
            self._logged_fallbacks.add(key)
            logger.warning("mods: site %s: %s", self.site_name or type(self).__name__, message)

    def extra_repr(self) -> str:
        return f"site={self.site_name!r}, plan=({self.plan})"


@contextlib.contextmanager
def forwards_high(sites: Mapping[str, Site]) -> Iterator[list[str]]:
    """Inside the block, every site of `sites` whose forward GEMM runs in FP8 runs it in high
    precision, its backward plans kept; the moved sites' plans are restored after, raised or
    not (a weight ``export.serve`` prepared for a site is dropped, as by any
    :meth:`Site.set_plan`: serve it again). Yields the names of the sites it moved. What an
    evaluation inside it gives against one outside is what the FP8 forwards cost the model's
    output, apart from what FP8 changed in its training.

    Example:
        >>> with forwards_high(sites(model)) as moved:
        ...     ne_high = trainer.evaluate()["eval/ne"]
    """
    saved = {name: site.plan for name, site in sites.items()}
    moved = [name for name, plan in saved.items() if plan.forward.is_fp8]
    try:
        for name in moved:
            sites[name].set_plan(dataclasses.replace(saved[name], forward=GemmPlan()))
        yield moved
    finally:
        for name in moved:
            sites[name].set_plan(saved[name])


def mark_sampled(sites: Iterable[Site], step: int) -> list[Site]:
    """Ask each site's observer whether it samples the site on ``step`` and set the site's
    ``sampling`` flag to that; return the sites that sample.

    The one place where "does this site report on this step" is decided: call it at every step
    start, after ``probe.begin_step(step)``. A loop that graphs the dense modules must not
    replay the returned sites (their reports are host work that a replay skips); compiled code
    keeps them as opaque ops (:mod:`loka_train.mods.probe_tap`). The LoKA callback hands them to
    the loop as ``eager_modules``. A site without an observer never samples.

    Example:
        >>> probe.begin_step(step)
        >>> sampled = mark_sampled(sites(model).values(), step)
    """
    sampled = []
    for site in sites:
        obs = site.observer
        on = obs is not None and obs.should_sample(step, site.site_name)
        site.set_sampling(on)
        if on:
            sampled.append(site)
    return sampled


class GemmSite(Site):
    """A linear GEMM site whose weight lives elsewhere (a DCN ``ParameterList`` entry, or the
    concatenation of a horizontal fusion): ``site.linear(x, weight, bias)``.

    Args:
        weight_shape: ``(N, K)`` of the weights it will be called with.
        plan: initial plan (default: high precision).
        pad_to_multiple: pad multiple for FP8 GEMMs.

    Example:
        >>> site = GemmSite(weight_shape=(4, 8))
        >>> site.linear(torch.randn(2, 8), torch.randn(4, 8)).shape
        torch.Size([2, 4])
    """

    shares_operands = True

    def __init__(
        self,
        *,
        weight_shape: tuple[int, int],
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
    ) -> None:
        super().__init__(plan=plan, pad_to_multiple=pad_to_multiple)
        self._weight_shape = (int(weight_shape[0]), int(weight_shape[1]))
        self._mkn = (0, self._weight_shape[1], self._weight_shape[0])

    def weight_shape(self) -> tuple[int, int] | None:
        return self._weight_shape

    def enable_static_scales(self, *, margin: float, spread: float, device: torch.device) -> None:
        """Quantize the tensor-wise FP8 ``x`` and ``dY`` with static scales from now on
        (``mods.static_scales``; ``kernels.static_scales``): slots on ``device``, seeded by the
        first call each and refreshed from the Probe's window by the plugin. Slots this site
        already has on ``device`` are kept (captured steps read their addresses), with their
        scales, the new margin and spread, and their fallback counts reset (a run counts its own).

        Raises:
            ValueError: for ``margin < 1`` or ``spread < 2``.
        """
        fresh = static_scales.new_slots(2, margin=margin, spread=spread, device=device)
        if self.static_slots is not None and self.static_slots.device == fresh.device:
            self.static_slots[:, static_scales.FALLBACKS:] = fresh[:, static_scales.FALLBACKS:]
        else:
            self.static_slots = fresh

    def linear(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *, input_relu: bool | None = None
    ) -> Tensor:
        """``y = x W^T + b`` as the plan says (of ``relu(x)`` with ``input_relu``, by default the
        site's :attr:`input_relu`); reports to the observer on sampled steps. A served site
        (``loka_train.export.serve``) called without autograd with the weight it serves takes
        that weight quantized once."""
        relu = self.input_relu if input_relu is None else input_relu
        served = cast("ServedForward | None", self._modules.get("served"))
        if served is not None and not torch.is_grad_enabled() and served.serves(weight, self):
            return served(self, x, relu=relu, bias=bias)
        return self.linear_as_trained(x, weight, bias, input_relu=relu)

    def linear_cross_tail(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, x0: Tensor, xl: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """A DCN cross layer's ``W`` GEMM with the layer's tail in its epilogue
        (``kernels.linear.cross_tail_linear``): ``(y, x_l + x0 * y, that in bf16)``, only ``y``
        differentiable; or None where this call must run as :meth:`linear` does: a sampled step
        (the Probe's taps see ``y``), a served weight without autograd, a folded ReLU, FP8 operands
        that need padding (or whose padding cannot help: :meth:`linear` then names the backend's
        reason), or where ``takes_cross_tail`` does not hold (logged once per site and reason,
        from eager calls). ``xl`` None: ``x_l`` is ``x0``."""
        if not self.plan_fp8 or self.input_relu or self.output_relu or self._should_observe():
            return None
        served = cast("ServedForward | None", self._modules.get("served"))
        if served is not None and not torch.is_grad_enabled() and served.serves(weight, self):
            return None
        n, k = weight.shape
        m = x.numel() // k if k else 0
        pad = fp8_padding(self.plan, m, k, n, self.pad_to_multiple, x.device.type, compute_dtype(x), False)
        ok, why = takes_cross_tail(x, weight, bias, self.plan, x0, xl)
        if pad != (0, 0, 0):
            ok, why = False, "its FP8 operands need padding" if pad else "no padding lets its backend run the shape"
        if not ok:
            key = f"cross_tail: {why}"
            if not torch.compiler.is_compiling() and key not in self._logged_fallbacks:
                self._logged_fallbacks.add(key)
                logger.info("mods: site %s: the cross layer's tail runs after its GEMM, not in its epilogue: %s",
                            self.site_name or type(self).__name__, why)
            return None
        self._set_mkn((m, k, n))
        return _cross_tail_linear(x, weight, bias, self.plan, x0, xl, self.compiled_quantizer, self.static_slots)

    def linear_as_trained(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *, input_relu: bool | None = None
    ) -> Tensor:
        """:meth:`linear` as training runs it: the weight quantized at the call, never a served one."""
        relu = self.input_relu if input_relu is None else input_relu
        n, k = weight.shape
        self._set_mkn((x.numel() // k if k else 0, k, n))
        observe = self._should_observe()
        # The next site's folded ReLU's backward (output_relu): in the FP8 op, or (a sampled step,
        # whose taps must see the masked gradient; a plan without FP8) a ReLU on the output. The
        # output's values feed only that site, which applies the ReLU to them either way.
        relu_out = self.output_relu and torch.is_grad_enabled()
        in_op = relu_out and self.plan_fp8 and not observe
        if not self.plan_fp8:  # planned_linear's high-precision path, without reading the plan
            y = F.linear(torch.relu(x) if relu else x, weight, bias)
        else:
            y = planned_linear(
                x, weight, bias, self.plan, pad_to_multiple=self.pad_to_multiple,
                compiled_quantizer=self.compiled_quantizer, static_slots=self.static_slots, input_relu=relu,
                mask_bits=self.relu_mask_bits, input_relu_grad=self.input_relu_grad, output_relu=in_op,
            )
        if observe:
            x_obs = torch.relu(x.detach()) if relu else x.detach()
            y = self._observe(x_obs.reshape(-1, k), weight.detach(), y, mkn=(x.numel() // k if k else 0, k, n))
        if relu_out and not in_op:
            y = torch.relu(y)
        return y


class ServedForward(Protocol):
    """What ``loka_train.export.serve`` registers as a :class:`GemmSite`'s ``served``
    submodule: the forward GEMM it serves, the weight it holds quantized, and the forwards that
    take it (called without autograd)."""

    gemm: GemmPlan

    def serves(self, weight: Tensor, site: GemmSite) -> bool:
        """Whether `weight`, passed to `site`, is the one it holds quantized."""
        ...

    def __call__(self, site: GemmSite, x: Tensor, *, relu: bool, bias: Tensor | None = None) -> Tensor: ...

    def forward_layernorm(
        self, site: Fp8Linear, x: Tensor, norm: nn.LayerNorm, activation: str
    ) -> Tensor | None: ...


class Fp8Linear(GemmSite, nn.Linear):
    """An ``nn.Linear`` whose three GEMMs follow a plan; owns the original Parameters.

    Built with :meth:`from_linear`, which takes over ``weight`` and ``bias`` (no copies).
    :meth:`forward_layernorm` runs ``act(self(layer_norm(x)))`` as one fused op
    (``kernels.fused.layernorm_linear``).

    Example:
        >>> site = Fp8Linear.from_linear(torch.nn.Linear(32, 16), plan=LinearPlan.fp8())
        >>> site(torch.randn(8, 32)).shape
        torch.Size([8, 16])
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
        bias_dropped: bool = False,
    ) -> None:
        if not isinstance(weight, nn.Parameter) or not (bias is None or isinstance(bias, nn.Parameter)):
            raise ValueError("Fp8Linear takes over nn.Parameters: weight and bias must be Parameters")
        nn.Module.__init__(self)
        self._init_site(plan=plan, pad_to_multiple=pad_to_multiple)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._weight_shape = (self.out_features, self.in_features)
        self._mkn = (0, self.in_features, self.out_features)
        self.weight = weight
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias
        self.bias_dropped = bool(bias_dropped)
        if self.bias_dropped and bias is not None:
            with torch.no_grad():
                bias.zero_()
            bias.requires_grad_(False)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
        drop_bias: bool = False,
    ) -> Fp8Linear:
        """Take over ``linear``'s Parameters (the site's ``weight is linear.weight``).

        Args:
            linear: the module to replace.
            plan: initial plan (default: high precision).
            pad_to_multiple: pad multiple for FP8 GEMMs.
            drop_bias: zero and freeze the bias and skip it (see ``ModsConfig.drop_unstable_bias``).
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        return cls(
            linear.weight,
            linear.bias,
            plan=plan,
            pad_to_multiple=pad_to_multiple,
            bias_dropped=drop_bias,
        )

    def active_bias(self) -> Tensor | None:
        """The bias the forward adds: None where ``mods.drop_unstable_bias`` dropped it."""
        return None if self.bias_dropped else self.bias

    def forward(self, x: Tensor, *, input_relu: bool | None = None) -> Tensor:
        """``y = x W^T + b``; ``input_relu``: see :meth:`GemmSite.linear` (False where the caller
        applied the folded ReLU itself; served, the weight quantized once)."""
        return self.linear(x, self.weight, self.active_bias(), input_relu=input_relu)

    def runs_fused_norm(self, x: Tensor) -> bool:
        """Whether :meth:`forward_layernorm` on ``x`` runs the fused op (its activation then
        applied in the GEMM's epilogue and its backward's cast) rather than the separate
        modules: a forward the LayerNorm kernel quantizes, at a shape that needs no padding of
        ``K`` or ``M``."""
        return self._norm_quantized(x) and self._fused_norm_padding(x) is not None

    def _norm_quantized(self, x: Tensor) -> bool:
        """Whether the LayerNorm kernel quantizes this forward's input (``kernels.fused``); a
        high-precision plan answers from the site's flag, without reading the plan."""
        return self.plan_fp8 and fuses_quantizer(self.plan.forward, x, inductor_quantizes(self.compiled_quantizer))

    def _fused_norm_padding(self, x: Tensor) -> tuple[int, int, int] | None:
        """The fused op's padding of ``(M, K, N)`` at ``x`` (only ``N`` can be padded), or None
        where its backend would need ``K`` or ``M`` padded."""
        k, n = self.in_features, self.out_features
        m = x.numel() // k if k else 0
        return fp8_padding(self.plan, m, k, n, self.pad_to_multiple, x.device.type, compute_dtype(x), True)

    def forward_layernorm(self, x: Tensor, norm: nn.LayerNorm, *, activation: str = "relu") -> Tensor:
        """``act(self(norm(x)))`` as one fused op: with a row-wise FP8 forward on a backend
        that takes the fused quantizer (``triton``, ``torch_scaled_mm``, ``fbgemm_rowwise``),
        the LayerNorm kernel emits the GEMM's FP8 input and scales (see
        ``kernels.fused.layernorm_linear`` for the backward's kernels).

        A high-precision forward, or an FP8 one the LayerNorm kernel does not quantize
        (tensor-wise, or no fused quantizer on this backend or device), runs as the separate
        modules (LayerNorm and the activation then compile with the code around them); a
        high-precision plan is bit-identical to them. When the FP8 backend
        needs padding (see the module docstring), ``N`` is padded; a ``K`` (the normalized dim)
        or ``M`` that needs padding cannot be padded inside the fused op, so the call falls
        back to the separate (padded) path, logged once and counted in ``num_fallbacks``.

        Args:
            x: input ``(..., K)``.
            norm: the LayerNorm over ``K`` that precedes this Linear.
            activation: ``"none"``, ``"relu"`` or ``"silu"``.
        """
        if activation not in FUSED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {FUSED_ACTIVATIONS}, got {activation!r}")
        if self.input_relu:
            raise ValueError(
                f"{self.site_name or 'site'}: forward_layernorm feeds the site a LayerNorm's output; a site that "
                "takes a folded ReLU (input_relu) cannot take it"
            )
        k = self.in_features
        if tuple(norm.normalized_shape) != (k,):
            raise ValueError(f"LayerNorm over {tuple(norm.normalized_shape)} cannot feed a Linear with K={k}")
        served = cast("ServedForward | None", self._modules.get("served"))
        if served is not None and not torch.is_grad_enabled():
            y = served.forward_layernorm(self, x, norm, activation)
            return apply_activation(self(norm(x)), activation) if y is None else y
        if not self._norm_quantized(x):
            # No FP8 forward GEMM: the original composition, op for op, so the forward output
            # is bit-identical also under bf16 autocast (where the fused op's LayerNorm runs in
            # bf16, autocast's in fp32). FP8 backward GEMMs still run through this site. Under
            # torch.compile with compiled_quantizer "inductor", the same composition, for
            # inductor to fuse (kernels.settings.KernelSettings.compiled_quantizer). An FP8
            # forward that the LayerNorm kernel does not quantize (tensor-wise, or a backend
            # or device without the fused quantizer) takes the same composition too: inside
            # the fused op it would run LayerNorm, the activation and their backward as eager
            # kernels of their own, where compiled code fuses them into their neighbours.
            return apply_activation(self(norm(x)), activation)
        m = x.numel() // k if k else 0
        n = self.out_features
        pad = self._fused_norm_padding(x)  # the forward is FP8 here: the LayerNorm kernel quantizes it
        if pad is None:
            self.note_fallback(
                "fused_norm_pad",
                f"the backend needs K={k} or M={m} padded, which the fused LayerNorm op cannot do; "
                "running LayerNorm and the padded FP8 Linear separately",
            )
            return apply_activation(self(norm(x)), activation)
        pad_n = pad[2]
        self._set_mkn((m, k, n))
        plan = self.plan
        weight, bias = self.weight, self.active_bias()
        if pad_n:
            y = layernorm_linear(
                x, norm.weight, norm.bias, F.pad(weight, (0, 0, 0, pad_n)),
                None if bias is None else F.pad(bias, (0, pad_n)), plan,
                activation=activation, eps=norm.eps, compiled_quantizer=self.compiled_quantizer,
            )[..., :n]
        else:
            y = layernorm_linear(
                x, norm.weight, norm.bias, weight, bias, plan, activation=activation, eps=norm.eps,
                compiled_quantizer=self.compiled_quantizer,
            )
        if self._should_observe():
            with torch.no_grad():
                h_MK = F.layer_norm(x.detach(), (k,), norm.weight, norm.bias, norm.eps).reshape(-1, k)
                z_MN = F.linear(h_MK, weight.detach(), None if bias is None else bias.detach())
            y = self._observe(h_MK, weight.detach(), y, mkn=(m, k, n), z_MN=z_MN, activation=activation)
        return y

    def extra_repr(self) -> str:
        bias = "dropped" if self.bias_dropped else self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, "
            f"pad_to_multiple={self.pad_to_multiple}, {Site.extra_repr(self)}"
        )


class FoldedRelu(nn.Module):
    """Where a ReLU was, when the site after it applies it (``mods.fold_relu``): the identity.

    The next site's FP8 cast reads the pre-activation and applies the ReLU as it quantizes
    (``kernels.fp8_linear``'s ``input_relu``), so no pass writes the ReLU's output; the site
    computes ``torch.relu`` itself where it does not quantize that way. Holds no state: a
    checkpoint is the same with or without it.
    """

    def forward(self, x: Tensor) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return "applied by the next site"


class FusedLinearSite(GemmSite):
    """Horizontal fusion: Linears that read the same input run as ONE wider GEMM site.

    The member modules keep their Parameters (state dict unchanged) and are not sites
    themselves; each call concatenates their weights (and biases) along ``N`` and splits the
    output. Cost: one copy of the (small) member weights per step forward and one split of
    their gradients backward, against the saved launches and a wider ``N`` for FP8.

    Args:
        members: the ``nn.Linear`` modules (same ``in_features``), in output order.
        plan: initial plan.
        pad_to_multiple: pad multiple for FP8 GEMMs.

    Example:
        >>> a, b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 3, bias=False)
        >>> site = FusedLinearSite([a, b])
        >>> [t.shape[-1] for t in site(torch.randn(5, 8))]
        [4, 3]
    """

    def __init__(
        self,
        members: list[nn.Linear],
        *,
        plan: LinearPlan | None = None,
        pad_to_multiple: int = 1,
    ) -> None:
        if not members:
            raise ValueError("FusedLinearSite needs at least one member")
        k = members[0].in_features
        if any(m.in_features != k for m in members):
            raise ValueError(f"fused members must share in_features, got {[m.in_features for m in members]}")
        sizes = [m.out_features for m in members]
        super().__init__(weight_shape=(sum(sizes), k), plan=plan, pad_to_multiple=pad_to_multiple)
        # A plain list: the members stay registered where they are, not under this site.
        self._members: list[nn.Linear] = list(members)
        self.split_sizes = sizes

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        weight = torch.cat([m.weight for m in self._members])
        bias = None
        if any(m.bias is not None for m in self._members):
            bias = torch.cat(
                [
                    m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                    for m in self._members
                ]
            )
        y = self.linear(x, weight, bias)
        return torch.split(y, self.split_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"split_sizes={self.split_sizes}, {super().extra_repr()}"
