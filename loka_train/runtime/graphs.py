"""CUDA graphs of the dense towers: one replay per forward and per backward.

An eager TorchRec step on an H100 is bound by the host: a dense-heavy model issues
1,700 aten calls per step in bf16 and 3,400 with FP8 sites (quantizers, scales), and the GPU
waits for them (``docs/performance.md``). :class:`DenseGraphs` captures the forward and
the backward of each dense submodule (bottom MLP, interaction, top MLP) as two CUDA graphs
and replays them, so a step launches a handful of graphs instead of thousands of kernels.
The sharded embeddings, their all-to-all, the loss and the optimizer stay eager.

What runs eagerly, and why (every call is counted by reason in :meth:`DenseGraphs.stats`):

* ``eval`` / ``no_grad``: evaluation and no-grad forwards (graphs hold training forwards);
* ``requested``: a step on which a callback asked for the module to run eagerly
  (:meth:`Callback.eager_modules <loka_train.runtime.callbacks.Callback.eager_modules>`, through
  :class:`~loka_train.runtime.eager.EagerSteps`: the LoKA Probe samples one of its FP8 sites,
  whose statistics and gradient hooks are host work that a replay would skip);
* ``warmup``: the first ``warmup_calls`` calls of each new signature, so lazy set-up (cuBLAS
  handles, Triton compilation and autotuning, allocator growth) happens outside a capture
  (with ``compile``, the capture's own compiled variant compiles in the capture's warm-up
  iterations, ``capture_warmup_iters >= 1``);
* ``unchained``: a module captured reading a producer's shared output buffer
  (``shared_outputs``) in place, fed a view of that buffer at another address. A consumer's
  signature names the producer buffer each input is, so an input that is another tensor (the
  producer did not replay: a requested step or its warm-up) or another capture's buffer is
  another signature, warmed up and captured like any other;
* fallbacks (logged once, counted, listed in the run report): an input that is not a tensor,
  or a capture that failed (e.g. an op that synchronises with the host); the module then
  stays eager for the run.

With ``compile``, a ``requested`` call runs the module's own uncompiled forward (its compiled
one, not replayed, with ``EagerSteps.compiled_requests``), and every other unreplayed call the
compiled one (:func:`loka_train.runtime.compile.eager_or_compiled`
says why: host work inside a layer loop made dynamo skip the whole frame).

A signature is: autocast state, the input shapes / dtypes / requires-grad, the
``forward_key()`` of the module's :class:`~loka_train.runtime.eager.Keyed` submodules (an FP8
site's plan, whether it is sampled), the parameters' storage, which producer buffer each input
is, and whether the step requested the module. A new signature (a plan switched, the batch
shape changed) is warmed up and captured; each module keeps its last ``max_variants``
captures, in one memory pool, so switching back replays without capturing again.

Replays compute exactly what the eager module computes with the same kernels (with
``compile``, what the variant compiled for the capture computes, which may round apart from the
compiled code of eager calls). The inputs are copied into the graph's static buffers, except an
input that is a graphed producer's shared output buffer (below). Outputs are returned as copies of the static
buffers, except for modules in ``shared_outputs`` (``install``: the bottom MLP and the
interaction, whose outputs only the model's next submodule reads), whose replays return the
buffers themselves. Gradients of parameters, and of inputs whose gradient may reach a leaf's
``.grad`` unchanged or as a view (a leaf, a view of one), are copies; those of other inputs are
the static buffers, which the backward in progress reads (a ``torch.autograd.grad`` call on such
an input, or a tensor hook that keeps its argument, gets the buffer: copy it to keep it).
So in DCN at batch 32768 the interaction's 32768 x 3456 output is copied once a step (its
gradient, into the interaction's backward graph) instead of four times, and the embeddings'
gradient is not copied at all. A graphed module takes one training forward, then its
backward (a second forward replay before that backward makes the backward raise). Limits:
a shared output is valid until its module's next training forward and must not be changed in
place (its backward graph may read it: the backward raises if it was); module hooks (refused
at capture: a replay would skip them); parameters used but owned outside the module get no
gradient from a replay; parameter objects replaced mid-run need
:meth:`DenseGraphs.invalidate`; the capture's warm-up runs advance stateful modules (none in
the DLRM family: no BatchNorm or dropout).

Example:
    >>> graphs = DenseGraphs.install(model)          # after sharding, on a CUDA device
    >>> for step in range(steps):
    ...     callbacks.call("on_step_start", trainer, step)
    ...     graphs.eager.begin_step(callbacks.eager_modules(trainer, step))
    ...     ...                                      # forward, backward, optimizer step
    >>> graphs.stats()["replays"], graphs.fallbacks
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from loka_train.runtime.eager import EagerSteps, Keyed, keyed_modules
from loka_train.runtime.graph_capture import (
    CaptureFn,
    Graphed,
    PoolShare,
    capture_cuda_graphs,
    unflatten_output,
)
from loka_train.utils.names import strip_wrapper_prefixes
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

DENSE_SUBMODULES = ("dense_arch", "inter_arch", "over_arch")
"""Attribute names of the dense parts of the DLRM family (TorchRec DLRM, DLRM_DCN, Wukong)."""

INNER_SUBMODULES = ("dense_arch", "inter_arch")
"""The dense parts whose output only the model's own forward reads (the interaction, the top
MLP), never its caller: their replays share their output buffers (see `DenseGraphs`)."""

EAGER_REASONS = ("eval", "no_grad", "requested", "warmup", "unchained", "unsupported_input", "capture_failed")
"""Why a call ran eagerly; the last two are fallbacks."""


def dense_submodules(
    model: nn.Module, names: Iterable[str], *, setting: str, verb: str
) -> dict[str, nn.Module]:
    """The outermost submodules of `model` whose attribute name is in `names`, by name without
    wrapper prefixes (what ``trainer.compile_dense`` compiles and ``trainer.cuda_graphs``
    graphs; `setting` and `verb` name that feature in the errors).

    Raises:
        ValueError: if there is none, or one holds a sharded module.
    """
    from torchrec.distributed.types import ShardedModule

    wanted = set(names)
    found: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        name = strip_wrapper_prefixes(fqn)
        if fqn.rsplit(".", 1)[-1] not in wanted or any(name.startswith(f + ".") for f in found):
            continue
        if any(isinstance(m, ShardedModule) for m in module.modules()):
            raise ValueError(
                f"{setting}: {name} holds a sharded module; only dense submodules "
                f"({', '.join(sorted(wanted))}) can be {verb}ed"
            )
        found[name] = module
    if not found:
        raise ValueError(
            f"{setting}=true but the model has no submodule named {' / '.join(sorted(wanted))} to {verb}"
        )
    return found


@dataclass
class _Variant:
    """One capture of a module: for one signature."""

    graphed: Graphed
    chain: tuple[tuple[int, int, int], ...] = ()
    """Inputs that `graphed` reads in place from a producer's shared output buffer: (input
    index, its address, the buffer's storage address)."""


@dataclass
class _Entry:
    name: str
    module: nn.Module
    forward: Callable[..., Any]
    """The module's own forward (compiled when :class:`DenseGraphs` got ``compile``): what
    captures and the unreplayed calls of steps that do not request it eagerly run."""
    eager: Callable[..., Any]
    """The module's own forward, never compiled: what a requested step runs."""
    keyed: tuple[Keyed, ...]
    """Its submodules whose ``forward_key()`` is part of the signature."""
    shadowed: Any
    """An instance-level ``forward`` the module had before install (restored by `remove`)."""
    params: tuple[nn.Parameter, ...] = ()
    """Trainable parameters, read at install and at every capture."""
    param_names: tuple[str, ...] = ()
    variants: dict[Hashable, _Variant] = field(default_factory=dict)
    """Captures by signature, least recently replayed first (at most ``max_variants``)."""
    share: PoolShare = field(default_factory=PoolShare)
    """The memory pool (and replay count) that all of the module's captures share."""
    capturing: Callable[..., Any] | None = None
    """The forward a capture in progress records (the router calls it directly), or None."""
    shares_outputs: bool = False
    """Its replays return their output buffers (`DenseGraphs`' `shared_outputs`)."""
    seen: dict[Hashable, int] = field(default_factory=dict)
    """Eager calls per signature not captured yet (the warm-up before a capture)."""
    disabled: str = ""
    """Why this module stays eager for the run (a failed capture), or ''."""
    requested_disabled: str = ""
    """Why its requested steps run eagerly for the run (their capture failed), or ''."""
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def range_name(self) -> str:
        return f"loka/graphs/{self.name}"

    def refresh_params(self) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = tuple(p for _, p in named)
        self.param_names = tuple(n for n, _ in named)

    def refresh_params_changed(self) -> bool:
        """`refresh_params`, and whether the parameter objects changed."""
        before = self.params
        self.refresh_params()
        return len(before) != len(self.params) or any(a is not b for a, b in zip(before, self.params))


_MAX_SEEN = 64
"""Signatures whose warm-up calls an entry counts (the oldest is forgotten beyond)."""


class DenseGraphs:
    """Replays the forward and backward of dense submodules as CUDA graphs.

    Args:
        modules: name -> module to graph (each must take and return tensors).
        warmup_calls: eager calls with a new signature before it is captured (>= 1); a
            replayable request's signature is captured on its first call.
        capture_warmup_iters: forward + backward runs on a side stream before each capture.
        capture: the capture function (default:
            :func:`~loka_train.runtime.graph_capture.capture_cuda_graphs`, which needs a
            CUDA device: on the CPU every capture fails, a logged fallback); tests pass a
            stand-in to check the routing on CPU.
        compile: applied to each module's own forward (e.g. ``torch.compile``): eager calls
            and captures then run the compiled code, and this router stays outside it.
        shared_outputs: names of modules whose output only a later module of the same step
            reads. Their replays return the graph's output buffers instead of copies, and a
            graphed module captured on such a buffer reads it in place (the copies took 1.59
            ms of DCN's 14 ms step at batch 32768 on an H100; see the module docstring). A
            buffer is valid until its module's next training forward (the next step): keep no
            reference to it across steps.
        eager: which modules run eagerly on the current step (default: a fresh one, that the
            loop updates as ``graphs.eager.begin_step(callbacks.eager_modules(...))`` at every
            step start); the graphed modules are watched in it. When it says the requests of
            the step are replayable (``EagerSteps.begin_step(..., replayable=True)``), a
            requested module's uncompiled forward is captured and replayed like any other
            signature (its own variant), instead of running eagerly.
        max_variants: captures kept per module (one per signature: a plan, a requested step's
            sampled sites), the least recently replayed dropped beyond. They share one memory
            pool (:class:`~loka_train.runtime.graph_capture.PoolShare`).

    Use :meth:`install` on a model; :meth:`remove` restores the modules' own forwards.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        *,
        warmup_calls: int = 2,
        capture_warmup_iters: int = 3,
        capture: CaptureFn | None = None,
        compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
        shared_outputs: Iterable[str] = (),
        eager: EagerSteps | None = None,
        max_variants: int = 4,
    ) -> None:
        if max_variants < 1:
            raise ValueError(f"max_variants={max_variants} must be >= 1")
        if warmup_calls < 1 or capture_warmup_iters < (1 if compile is not None else 0):
            # With `compile`, the capture's own variant compiles in those iterations: without
            # one it would compile inside the capture, which fails (and falls back to eager).
            raise ValueError(
                f"warmup_calls={warmup_calls} must be >= 1 and capture_warmup_iters="
                f"{capture_warmup_iters} >= {1 if compile is not None else 0}"
                + (" (with compile)" if compile is not None else "")
            )
        shared_outputs = set(shared_outputs)
        unknown = shared_outputs - set(modules)
        if unknown:
            raise ValueError(f"shared_outputs names modules that are not graphed: {sorted(unknown)}")
        self.warmup_calls = warmup_calls
        self.max_variants = max_variants
        self.capture_warmup_iters = capture_warmup_iters
        self._capture: CaptureFn = capture or partial(capture_cuda_graphs, warmup_iters=capture_warmup_iters)
        self._shared: dict[int, str] = {}
        """Storage address -> module, of every live shared output buffer."""
        self.fallbacks: list[str] = []
        """One line per fallback kind and module (also logged)."""
        self.num_captures = 0
        self.eager = EagerSteps() if eager is None else eager
        """Which graphed modules run eagerly on the current step."""
        self._entries: list[_Entry] = []
        for name, module in modules.items():
            self.eager.watch(module)
            entry = _Entry(
                name=name,
                module=module,
                forward=module.forward if compile is None else compile(module.forward),
                eager=module.forward,
                shadowed=vars(module).get("forward"),
                keyed=keyed_modules(module),
                shares_outputs=name in shared_outputs,
            )
            entry.refresh_params()
            self._entries.append(entry)
            # An instance attribute shadows the class's forward: nn.Module.__call__ (and every
            # wrapper around it) calls this router; `remove` deletes it again.
            module.forward = self._router(entry)  # type: ignore[method-assign]

    @classmethod
    def install(
        cls,
        model: nn.Module,
        *,
        names: Iterable[str] = DENSE_SUBMODULES,
        inner: Iterable[str] = INNER_SUBMODULES,
        **kwargs: Any,
    ) -> DenseGraphs:
        """Graph the submodules of `model` whose attribute name is in `names` (outermost only);
        those whose attribute name is in `inner` share their outputs (``shared_outputs``).

        Raises:
            ValueError: if no such submodule exists, or one holds a sharded module.
        """
        found = dense_submodules(model, names, setting="trainer.cuda_graphs", verb="graph")
        logger.info("cuda_graphs: graphing %s", ", ".join(found))
        inner = set(inner)
        shared = [name for name in found if name.rsplit(".", 1)[-1] in inner]
        return cls(found, shared_outputs=shared, **kwargs)

    @property
    def names(self) -> list[str]:
        """The graphed modules, by name."""
        return [entry.name for entry in self._entries]

    def remove(self) -> None:
        """Restore the modules' own forwards and free every graph."""
        for entry in self._entries:
            self._drop(entry)
            if entry.shadowed is not None:
                entry.module.forward = entry.shadowed  # type: ignore[method-assign]
            elif "forward" in vars(entry.module):
                del entry.module.forward
        self._entries = []

    def invalidate(self) -> None:
        """Drop every capture (the next calls warm up and capture again). Call it after
        replacing a graphed module's parameter objects (in-place updates need nothing)."""
        for entry in self._entries:
            self._drop(entry)
            entry.seen.clear()

    # ------------------------------------------------------------------------- report
    def stats(self) -> dict[str, Any]:
        """Captures, replays and eager calls by reason, in total and per module."""
        total: Counter[str] = Counter()
        per_module = {}
        for entry in self._entries:
            total.update(entry.counts)
            per_module[entry.name] = {"disabled": entry.disabled, **dict(entry.counts)}
        return {
            "captures": self.num_captures,
            "replays": total["replay"],
            "requested_replays": total["requested_replay"],
            "eager": {r: total[r] for r in EAGER_REASONS if total[r]},
            "modules": per_module,
        }

    # ------------------------------------------------------------------------ routing
    def _router(self, entry: _Entry) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(entry, args, kwargs)

        return forward

    def _call(self, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if entry.capturing is not None:
            return entry.capturing(*args, **kwargs)
        reason = self._eager_reason(entry)
        if reason:
            entry.counts[reason] += 1
            return self._unreplayed(entry, reason, args, kwargs)
        # A requested module whose requests are replayable: its uncompiled forward, graphed.
        requested = self.eager.runs_eagerly(entry.module)
        flat, spec = _flatten_inputs(args, kwargs)
        if not all(isinstance(t, Tensor) for t in flat):
            kinds = sorted({type(t).__name__ for t in flat if not isinstance(t, Tensor)})
            self._fallback(entry, "unsupported_input", f"takes non-tensor inputs ({', '.join(kinds)})")
            return self._unreplayed(entry, "unsupported_input", args, kwargs)
        inputs: tuple[Tensor, ...] = tuple(flat)
        key = self._signature(entry, inputs, spec, requested=requested)
        variant = entry.variants.get(key)
        if variant is not None:
            if self._unchained(variant, inputs):
                entry.counts["unchained"] += 1
                return self._unreplayed(entry, "unchained", args, kwargs)
            entry.variants[key] = entry.variants.pop(key)  # the most recently replayed last
        else:
            seen = entry.seen.pop(key, 0) + 1
            # A requested step's capture comes on its first call: its own warm-up runs (before
            # the capture) do the lazy set-up, and a sampled set of sites may recur only
            # after many steps, so an eager first call would be the only one in most runs.
            if seen <= (0 if requested else self.warmup_calls):
                entry.seen[key] = seen
                if len(entry.seen) > _MAX_SEEN:
                    del entry.seen[next(iter(entry.seen))]
                entry.counts["warmup"] += 1
                return self._unreplayed(entry, "warmup", args, kwargs)
            variant = self._new_variant(entry, inputs, spec, requested=requested)
            if variant is None:
                return self._unreplayed(entry, "capture_failed", args, kwargs)
        entry.counts["requested_replay" if requested else "replay"] += 1
        with profiled(entry.range_name):
            return unflatten_output(variant.graphed.forward(inputs), variant.graphed.out_spec)

    def _unreplayed(self, entry: _Entry, reason: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that is not replayed: on a step that requests the module (also when its
        capture failed, or in a replayable request's warm-up), its own uncompiled forward, or its
        compiled one with ``eager.compiled_requests`` (``trainer.compile_sampled``); otherwise
        its (compiled) forward, the variant that the capture compiles and records."""
        if self.eager.runs_uncompiled(entry.module) and reason not in ("eval", "no_grad"):
            return entry.eager(*args, **kwargs)
        return entry.forward(*args, **kwargs)

    def _eager_reason(self, entry: _Entry) -> str:
        if entry.disabled:
            return "capture_failed"
        if not entry.module.training:
            return "eval"
        if not torch.is_grad_enabled():
            return "no_grad"
        if self.eager.runs_eagerly(entry.module) and (not self.eager.replayable or entry.requested_disabled):
            return "requested"
        return ""

    def _signature(self, entry: _Entry, inputs: tuple[Tensor, ...], spec: _InputSpec, *, requested: bool) -> Hashable:
        device_type = inputs[0].device.type if inputs else "cuda"
        autocast = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None,
        )
        return (
            autocast,
            spec,
            tuple((t.shape, t.dtype, t.device, t.requires_grad, t.stride()) for t in inputs),
            tuple(m.forward_key() for m in entry.keyed),
            tuple((p.data_ptr(), p.requires_grad) for p in entry.params),
            requested,  # the uncompiled forward, with the callbacks' host work deferred to replays
            # Which producer's shared buffer each input is (a capture reads those in place): a
            # producer's other capture (another plan, a sampled step) writes another buffer.
            tuple(_storage(t) if self._is_shared(t) else None for t in inputs),
        )

    def _new_variant(
        self, entry: _Entry, inputs: tuple[Tensor, ...], spec: _InputSpec, *, requested: bool
    ) -> _Variant | None:
        """Capture `entry` for a signature it has no capture of (dropping the least recently
        replayed capture beyond ``max_variants``); None when it failed."""
        while len(entry.variants) >= self.max_variants:
            self._drop(entry, next(iter(entry.variants)))
        fresh_params = entry.refresh_params_changed()
        if fresh_params:
            # Parameter objects were replaced: captures of the old ones read stale storage.
            self._drop(entry)
        hooked = [n or "(top)" for n, m in entry.module.named_modules() if _has_hooks(m)]
        if hooked:
            entry.disabled = f"has module hooks (on {', '.join(hooked[:3])}), which a replay would skip"
            self._fallback(entry, "capture_failed", f"{entry.disabled}; it runs eagerly for the rest of the run")
            return None
        forward = entry.eager if requested else entry.forward

        def run(params: tuple[Tensor, ...], *flat: Tensor) -> Any:
            args, kwargs = _unflatten_inputs(flat, spec)
            entry.capturing = forward  # functional_call goes through module.__call__: no routing
            try:
                # Unrequested: captured on a step that does not request the module (see
                # _eager_reason), so no host work of a callback runs inside it. Requested: the
                # callbacks defer their host work to the replays (utils.capture.after_replay).
                return torch.func.functional_call(entry.module, dict(zip(entry.param_names, params)), args, kwargs)
            finally:
                entry.capturing = None

        chained = tuple(self._is_shared(t) for t in inputs)
        try:
            graphed = self._capture(
                run, inputs, entry.params, shared_outputs=entry.shares_outputs, chained=chained, share=entry.share
            )
        except Exception as exc:  # a capture failure must not end the run: eager from now on
            if requested:  # the requested steps run eagerly again; the other captures stay
                entry.requested_disabled = f"capture failed: {type(exc).__name__}: {exc}"
                self._fallback(entry, "capture_failed", f"{entry.requested_disabled} on a requested step; "
                               "requested steps run eagerly for the rest of the run")
                return None
            self._drop(entry)
            entry.disabled = f"capture failed: {type(exc).__name__}: {exc}"
            self._fallback(entry, "capture_failed", f"{entry.disabled}; it runs eagerly for the rest of the run")
            return None
        # Re-read after the capture: a key taken before refresh_params would miss a
        # parameter replaced since install.
        key = self._signature(entry, inputs, spec, requested=requested)
        chain = tuple((i, t.data_ptr(), _storage(t)) for i, (t, c) in enumerate(zip(inputs, chained)) if c)
        variant = entry.variants[key] = _Variant(graphed, chain)
        for buffer in graphed.shared_buffers:
            self._shared[_storage(buffer)] = entry.name
        self.num_captures += 1
        entry.counts["capture"] += 1
        logger.info("cuda_graphs: captured %s%s (%d keyed submodules, %d captures kept)", entry.name,
                    " for a requested step" if requested else "", len(entry.keyed), len(entry.variants))
        return variant

    def _is_shared(self, t: Tensor) -> bool:
        """Whether `t` lives in a graphed producer's shared output buffer."""
        return bool(t.numel()) and _storage(t) in self._shared

    def _unchained(self, variant: _Variant, inputs: tuple[Tensor, ...]) -> bool:
        """Whether `variant` reads a producer's buffer in place where this call gives another
        address (a view at another offset of it): copying the input in would overwrite what the
        producer's backward graph may read. The signature names the buffer itself, so a
        producer that captured again or did not replay gives another signature instead."""
        return any(inputs[i].data_ptr() != ptr for i, ptr, _ in variant.chain)

    def _drop(self, entry: _Entry, key: Hashable = None) -> None:
        """Release `entry`'s capture for `key` (every capture when None), and the captures of
        other modules that read a shared buffer of it in place (their signature names that
        buffer: nothing would match them again, and they would keep it alive)."""
        keys = list(entry.variants) if key is None else [key] if key in entry.variants else []
        released: set[int] = set()
        for k in keys:
            graphed = entry.variants.pop(k).graphed
            for buffer in graphed.shared_buffers:
                if self._shared.get(_storage(buffer)) == entry.name:
                    del self._shared[_storage(buffer)]
                released.add(_storage(buffer))
            graphed.release()
        if not entry.variants:
            # A pool whose every capture is released may not be captured into again: the
            # module's next capture takes a fresh one.
            entry.share.reset()
        if released:
            for other in self._entries:
                stale = [k for k, v in other.variants.items() if any(st in released for _, _, st in v.chain)]
                for k in stale:
                    self._drop(other, k)

    def _fallback(self, entry: _Entry, reason: str, message: str) -> None:
        entry.counts[reason] += 1
        line = f"cuda_graphs: {entry.name} {message}"
        if line not in self.fallbacks:
            self.fallbacks.append(line)
            logger.warning("%s", line)


def _storage(t: Tensor) -> int:
    """The address of `t`'s storage (views of one buffer share it)."""
    return t.untyped_storage().data_ptr()


def _has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or module._backward_pre_hooks
    )


# ---------------------------------------------------------------------------- flattening
_InputSpec = tuple[int, tuple[str, ...]]
"""(number of positional arguments, keyword names in order)."""


def _flatten_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[list[Any], _InputSpec]:
    """Positional then keyword arguments (sorted by name), and how to rebuild them."""
    names = tuple(sorted(kwargs))
    return [*args, *(kwargs[k] for k in names)], (len(args), names)


def _unflatten_inputs(flat: tuple[Tensor, ...], spec: _InputSpec) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    num_args, names = spec
    return flat[:num_args], dict(zip(names, flat[num_args:]))
