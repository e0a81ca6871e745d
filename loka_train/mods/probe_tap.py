"""The Probe's taps: a sampled site's reports as opaque ops, so that compiled code keeps them.

On a sampled step a site reports its GEMM operands to its observer (``Site._observe``): the
forward's now, the gradient roles' when its output's gradient arrives. Eager code calls the
observer directly and hooks the output. Compiled code reaches a Python call only through a
graph break, and a break inside a loop over layers (DCN's cross layers, Wukong's layers,
``nn.Sequential``) makes dynamo give up the whole module for good
(:func:`loka_train.runtime.compile.eager_or_compiled`). Under ``torch.compile`` a site therefore
reports through two custom ops that dynamo puts in the graph like any other op:

* ``loka::probe_tap(y, a, b, z, site, kind, activation, mkn)`` returns a copy of ``y``; running,
  it records the site's GEMM shape ``mkn`` and, if the site samples on this step (its
  ``sampling`` flag, read as it runs), reports the forward operands ``(a, b)``. Its gradient is
  ``loka::probe_tap_grad`` of the incoming gradient;
* ``loka::probe_tap_grad(grad, a, b, z, site, kind, activation)`` returns a copy of ``grad``;
  running, it reports the grad-input and grad-weight operands if the site samples, with ``dY``
  taken from ``grad`` as eager code takes it (through the activation of ``z`` for a fused
  LayerNorm site, as the block-diagonal of the observed batches for a batched site).

The copies are what a custom op must return (an output may not alias an input); they are made
only on the sampled steps, in the modules that hold a sampled site: dynamo guards on whether the
site's module is requested (``Site.module_requested``, told by the runtime at each step start),
so one compiled variant serves every set of sampled sites (``probe.sites_per_step``), each tap
reporting where its site samples. A site whose output nothing reads reports nothing when compiled (the graph drops the
tap with the output); eager code reports its forward. ``site`` is the integer :func:`register`
gave the site. Reports go through the same functions as the eager path's
(:func:`report_forward`, :func:`report_grads`), so a sampled step reports the same operands
compiled or not.

Example:
    >>> class Recorder:
    ...     def __init__(self): self.roles = []
    ...     def observe(self, name, role, a, b): self.roles.append(role)
    >>> class FakeSite:
    ...     site_name, observer, sampling = "top.0", Recorder(), True
    ...     def _set_mkn(self, mkn): self.mkn = mkn
    >>> site = FakeSite(); tap_id = register(site)
    >>> x, w = torch.randn(4, 3), torch.randn(2, 3)
    >>> y = (x @ w.T).requires_grad_()
    >>> out = torch.ops.loka.probe_tap(y, x, w, None, tap_id, "linear", "none", [4, 3, 2])
    >>> out.sum().backward()
    >>> site.observer.roles, site.mkn
    (['forward', 'grad_input', 'grad_weight'], (4, 3, 2))
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["KINDS", "OBSERVED_BATCHES", "activation_grad", "register", "report_forward", "report_grads"]

OBSERVED_BATCHES = 8
"""Batches of a batched (bmm) site that are reported to the observer on a sampled step (as one
block-diagonal GEMM)."""

KINDS = ("linear", "bmm")
"""How ``dY`` comes from the output's gradient: ``linear`` (rows of the gradient, through the
activation of ``z`` when one is given) or ``bmm`` (the block-diagonal of the observed batches)."""


class _Reporting(Protocol):
    site_name: str
    observer: Any
    sampling: bool

    def _set_mkn(self, mkn: tuple[int, int, int]) -> None: ...


_SITES: dict[int, weakref.ref[_Reporting]] = {}
_IDS = itertools.count()


def register(site: _Reporting) -> int:
    """The integer that names `site` in the taps (held weakly: a collected site drops out)."""
    tap_id = next(_IDS)

    def forget(_ref: weakref.ref[_Reporting]) -> None:
        _SITES.pop(tap_id, None)

    _SITES[tap_id] = weakref.ref(site, forget)
    return tap_id


def _site(tap_id: int) -> _Reporting:
    ref = _SITES.get(tap_id)
    site = None if ref is None else ref()
    if site is None:
        raise RuntimeError(f"loka probe tap {tap_id}: its site no longer exists (a compiled graph outlived its model)")
    return site


def activation_grad(z_MN: Tensor, activation: str) -> Callable[[Tensor], Tensor]:
    """Maps the gradient of ``act(z)`` to the gradient of ``z`` (``"relu"``, ``"silu"`` or none)."""

    def fn(grad: Tensor) -> Tensor:
        g_MN = grad.reshape(-1, grad.shape[-1])
        if activation == "relu":
            return torch.where(z_MN > 0, g_MN, torch.zeros_like(g_MN))
        if activation == "silu":
            sig = torch.sigmoid(z_MN)
            return g_MN * sig * (1 + z_MN * (1 - sig))
        return g_MN

    return fn


def report_forward(site: _Reporting, a: Tensor, b: Tensor) -> None:
    """Report the forward GEMM's operands ``(x_MK, w_NK)`` (``(a, b)`` of a batched site's
    observed batches, as its eager path reports them)."""
    if site.observer is not None:
        site.observer.observe(site.site_name, "forward", a, b)


def report_grads(site: _Reporting, grad: Tensor, a: Tensor, b: Tensor, z: Tensor | None, kind: str,
                 activation: str) -> None:
    """Report the grad-input ``(dy_MN, w_NK)`` and grad-weight ``(dy_MN, x_MK)`` operands, ``dY``
    from the output's gradient `grad` as `kind` says (see :data:`KINDS`)."""
    obs = site.observer
    if obs is None:
        return
    grad = grad.detach()
    if kind == "bmm":
        dy_MN = torch.block_diag(*grad[:OBSERVED_BATCHES])
    elif kind == "linear":
        dy_MN = grad.reshape(-1, grad.shape[-1]) if z is None else activation_grad(z, activation)(grad)
    else:
        raise ValueError(f"probe tap kind {kind!r}: one of {KINDS}")
    obs.observe(site.site_name, "grad_input", dy_MN, b)
    obs.observe(site.site_name, "grad_weight", dy_MN, a)


@torch.library.custom_op("loka::probe_tap", mutates_args=())
def _probe_tap(
    y: Tensor, a: Tensor, b: Tensor, z: Tensor | None, site: int, kind: str, activation: str, mkn: list[int]
) -> Tensor:
    s = _site(site)
    m, k, n = mkn
    s._set_mkn((m, k, n))
    if s.sampling:
        report_forward(s, a, b)
    return y.clone()


@_probe_tap.register_fake
def _(y: Tensor, a: Tensor, b: Tensor, z: Tensor | None, site: int, kind: str, activation: str,
      mkn: list[int]) -> Tensor:
    return torch.empty_like(y)


@torch.library.custom_op("loka::probe_tap_grad", mutates_args=())
def _probe_tap_grad(grad: Tensor, a: Tensor, b: Tensor, z: Tensor | None, site: int, kind: str,
                    activation: str) -> Tensor:
    s = _site(site)
    if s.sampling:
        report_grads(s, grad, a, b, z, kind, activation)
    return grad.clone()


@_probe_tap_grad.register_fake
def _(grad: Tensor, a: Tensor, b: Tensor, z: Tensor | None, site: int, kind: str, activation: str) -> Tensor:
    return torch.empty_like(grad)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _y, a, b, z, site, kind, activation, _mkn = inputs
    ctx.save_for_backward(a, b, z)
    ctx.tap = (site, kind, activation)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    a, b, z = ctx.saved_tensors
    site, kind, activation = ctx.tap
    return torch.ops.loka.probe_tap_grad(grad, a, b, z, site, kind, activation), None, None, None, None, None, None, None


_probe_tap.register_autograd(_backward, setup_context=_setup_context)
