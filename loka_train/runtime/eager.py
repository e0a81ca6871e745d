"""Which dense submodules run eagerly on the current step, and what keys a module's forward.

A loop that compiles or graphs its dense submodules (``trainer.compile_dense``,
``trainer.cuda_graphs``) runs a submodule's uncompiled forward on the steps where a callback does
host work inside it that compiled code or a replay would skip; unreplayed, unless every
requesting callback defers that host work to replays (``replayable``; the graphs then capture
and replay the uncompiled forward as its own variant). The callbacks
name those modules once per step (:meth:`Callback.eager_modules
<loka_train.runtime.callbacks.Callback.eager_modules>`); :class:`EagerSteps` turns that into one
answer per watched submodule, which :class:`~loka_train.runtime.graphs.DenseGraphs` and the
compiled forwards (:mod:`loka_train.runtime.compile`) read on every call. Nothing else decides
it.

A module whose forward depends on state other than its parameters and inputs (a plan, say)
declares it with ``forward_key()`` (:class:`Keyed`): the graphs re-capture a module when a key
inside it changes, and compiled code keeps one cache entry per key.

Example:
    >>> eager = EagerSteps()
    >>> eager.watch(model.dense_arch)
    >>> eager.begin_step(callbacks.eager_modules(trainer, step))   # every step
    >>> eager.runs_eagerly(model.dense_arch)
    False
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["EagerSteps", "Keyed", "RequestAware", "keyed_modules"]


@runtime_checkable
class Keyed(Protocol):
    """A module whose forward depends on state besides its parameters and inputs."""

    def forward_key(self) -> Hashable:
        """That state, hashable: two calls with equal keys (and equal inputs and parameters)
        compute the same."""
        ...


@runtime_checkable
class RequestAware(Protocol):
    """A module told at every step start whether the watched module holding it runs as
    requested on the step (a LoKA site: its compiled code then holds the Probe's taps)."""

    def module_requested(self, on: bool) -> None:
        """Whether the watched module holding it is requested on the step about to run."""
        ...


def keyed_modules(module: nn.Module) -> tuple[Keyed, ...]:
    """The :class:`Keyed` modules in `module` (itself included), in ``modules()`` order."""
    return tuple(m for m in module.modules() if isinstance(m, Keyed))


class EagerSteps:
    """The watched submodules that run eagerly on the current step.

    A watched submodule runs eagerly when a module named in :meth:`begin_step` is inside it
    (or is it). Until the first :meth:`begin_step`, none does.
    """

    def __init__(self) -> None:
        self._members: dict[nn.Module, frozenset[nn.Module]] = {}
        self._aware: dict[nn.Module, tuple[RequestAware, ...]] = {}
        self._eager: frozenset[nn.Module] = frozenset()
        self._told: frozenset[nn.Module] | None = None
        """The requested set the RequestAware members were last told (None: tell at the next step)."""
        self.replayable = False
        """Whether the current step's requests allow a graphed loop to capture and replay the
        requested modules' uncompiled forwards (the requesting callbacks defer their host work
        to replays: :func:`loka_train.utils.capture.after_replay`)."""
        self.compiled_requests = False
        """Whether a requested module runs its compiled forward (not replayed) instead of its
        uncompiled one (``trainer.compile_sampled``): for callbacks whose host work reaches
        compiled code as opaque ops, as the LoKA Probe's does (``mods.probe_tap``)."""

    def watch(self, module: nn.Module) -> None:
        """Answer :meth:`runs_eagerly` for `module` from the next :meth:`begin_step` on, and tell
        its :class:`RequestAware` members at each :meth:`begin_step` whether it is requested."""
        self._members[module] = frozenset(module.modules())
        self._aware[module] = tuple(m for m in module.modules() if isinstance(m, RequestAware))
        self._told = None

    def begin_step(self, requested: Iterable[nn.Module], *, replayable: bool = False) -> None:
        """The modules that must run eagerly on the step about to run (the callbacks'
        ``eager_modules``), and whether their uncompiled forwards may be replayed
        (``replayable``: every requesting callback defers its host work to replays)."""
        self.replayable = replayable
        wanted = set(requested)
        self._eager = frozenset(
            module for module, members in self._members.items() if not members.isdisjoint(wanted)
        )
        if self._eager != self._told:  # most steps request what the last one did: nothing to tell
            self._told = self._eager
            for module, aware in self._aware.items():
                on = module in self._eager
                for member in aware:
                    member.module_requested(on)

    def runs_eagerly(self, module: nn.Module) -> bool:
        """Whether the watched `module` runs eagerly on the current step."""
        return module in self._eager

    def runs_uncompiled(self, module: nn.Module) -> bool:
        """Whether the watched `module` runs its uncompiled forward on the current step: it is
        requested, and requested modules do not run compiled (:attr:`compiled_requests`)."""
        return module in self._eager and not self.compiled_requests
