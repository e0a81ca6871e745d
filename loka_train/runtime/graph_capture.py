"""Capturing one module's forward and backward as two CUDA graphs, and replaying them.

:func:`capture_cuda_graphs` is the capture function that
:class:`~loka_train.runtime.graphs.DenseGraphs` uses by default (tests pass a stand-in with the
same contract, :data:`CaptureFn`). Each replay is one autograd node (``_Replay``): the forward
graph now, the backward graph in the backward pass; see the :mod:`loka_train.runtime.graphs`
docstring for which buffers are shared and which gradients are copies.

Example:
    >>> graphed = capture_cuda_graphs(run, inputs, params, warmup_iters=3)
    >>> outputs = graphed.forward(inputs)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from loka_train.utils.capture import ReplayHook, capture_stream, replay_hooks, reset_capture_state

__all__ = ["CaptureFn", "Graphed", "PoolShare", "capture_cuda_graphs", "flatten_output", "unflatten_output"]


class PoolShare:
    """One memory pool for the captures of one module (its variants: another plan, the steps
    a callback requests uncompiled), and the order check that sharing it needs.

    A later capture into the pool may take memory that an earlier one uses only inside its
    replays (temporaries, the activations its backward reads), which is safe while the
    captures never interleave: each forward replay of the module is followed by the backward
    of that same replay. ``generation`` counts the module's forward replays, of every variant;
    a backward whose forward is not the latest one raises instead of reading overwritten
    activations. So a sampled step's variant costs the memory of its own static buffers (and
    of whatever it needs beyond the other variants), not a second set of activations.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self.generation = 0
        """Forward replays of the module so far (every variant)."""

    @property
    def handle(self) -> Any:
        """The CUDA graph pool handle (made on first use: it needs a CUDA device)."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def reset(self) -> None:
        """Forget the pool (every capture into it was released): the next capture takes a new
        one, as the allocator may not let a pool whose captures are all gone take more."""
        self._handle = None


def _run_hooks(hooks: tuple[ReplayHook, ...]) -> None:
    for hook in hooks:
        hook()


class Graphed(Protocol):
    """A captured forward + backward of one module (what a capture function returns)."""

    out_spec: Any
    """Pytree spec of the module's output (`forward` returns it flattened)."""

    @property
    def shared_buffers(self) -> tuple[Tensor, ...]:
        """The buffers that `forward` returns as outputs themselves (shared outputs), else ()."""
        ...

    def forward(self, flat_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        """Outputs (flattened) for `flat_inputs`, with autograd to the inputs and parameters."""
        ...

    def release(self) -> None:
        """Free the graphs and their memory pool."""
        ...


CaptureFn = Callable[..., Graphed]
"""``capture(run, sample_inputs, params, *, shared_outputs, chained, share) -> Graphed`` (the arguments
of :func:`capture_cuda_graphs`): ``run(param_values, *flat_inputs)`` calls the module's forward
(compiled when :class:`DenseGraphs` got ``compile``) with `param_values` in place of `params`
(same order); gradients flow to the inputs that require grad and to the parameters."""


def flatten_output(out: Any) -> tuple[list[Tensor], Hashable]:
    """A tensor, or a tuple / list of tensors, as a list and how to rebuild it."""
    if isinstance(out, Tensor):
        return [out], None
    if isinstance(out, tuple | list) and all(isinstance(o, Tensor) for o in out):
        return list(out), type(out)
    raise TypeError(
        f"a graphed module must return a tensor or a tuple / list of tensors, got {type(out).__name__}"
    )


def unflatten_output(flat: list[Tensor], spec: Hashable) -> Any:
    return flat[0] if spec is None else spec(flat)  # type: ignore[operator]


# ----------------------------------------------------------------------------- capture
class _Replay(torch.autograd.Function):
    """Autograd node of one replay: forward graph now, backward graph in backward."""

    @staticmethod
    def forward(ctx: Any, graphs: _CudaGraphed, *inputs_and_params: Tensor) -> tuple[Tensor, ...]:
        graphs.share.generation += 1
        ctx.graphs, ctx.generation = graphs, graphs.share.generation
        inputs = inputs_and_params[: len(graphs.static_inputs)]
        # A gradient that may become a leaf's .grad (directly or through views) gets a copy of
        # the static buffer; an inner node's gradient is consumed within this backward.
        ctx.copy_grad = tuple(_grad_may_reach_a_leaf(t) for t in inputs)
        for static, given in zip(graphs.static_inputs, inputs):
            if static.data_ptr() != given.data_ptr():  # equal: chained to a producer's output
                static.copy_(given)
        graphs.fwd.replay()
        _run_hooks(graphs.fwd_hooks)
        # Shared outputs are the static buffers themselves (valid until this module's next
        # training forward); fresh ones are copies the caller may keep.
        outs = tuple(o.detach() if graphs.shared_outputs else o.clone() for o in graphs.static_outputs)
        # A shared output changed in place would corrupt this module's backward (e.g. a ReLU's
        # reads its output): its version counter, shared with the buffer, tells.
        ctx.versions = tuple(o._version for o in outs) if graphs.shared_outputs else ()
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, graphs.differentiable) if not d))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        graphs: _CudaGraphed = ctx.graphs
        if ctx.generation != graphs.share.generation:
            # The activations this backward needs were overwritten by a later replay (of this
            # capture, or of another one sharing its pool).
            raise RuntimeError(
                "cuda_graphs: a graphed module ran its forward again before the backward of an "
                "earlier forward; graphed modules take one forward, then its backward. Call the "
                "module once per step, or set trainer.cuda_graphs=false"
            )
        if ctx.versions and ctx.versions != tuple(o._version for o in graphs.static_outputs):
            raise RuntimeError(
                "cuda_graphs: an output of a graphed module that shares its outputs (the bottom "
                "MLP or the interaction) was changed in place before its backward, which reads "
                "it; change a copy (out = out.clone()) instead"
            )
        diff_grads = [g for g, d in zip(grads, graphs.differentiable) if d]
        for static, g in zip(graphs.static_grad_outputs, diff_grads):
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
        graphs.bwd.replay()
        _run_hooks(graphs.bwd_hooks)
        num_inputs = len(graphs.static_inputs)
        result: list[Tensor | None] = [None] * (num_inputs + len(graphs.params))
        for index, grad in zip(graphs.grad_targets, graphs.static_grads):
            if grad is None:
                continue
            # Copies for parameters and inputs whose gradient may reach a leaf through views:
            # a leaf's .grad must not be (a view of) the static buffer, which the next replay
            # overwrites (and adds to itself when .grad is kept, e.g. with
            # zero_grad(set_to_none=False) or gradient accumulation). An inner node's gradient
            # is read by the backward in progress: no copy (DCN at batch 32768: 32768 x 3456
            # values per graphed module and step).
            inner = index < num_inputs and not ctx.copy_grad[index]
            result[index] = grad if inner else grad.clone()
        return (None, *result)


_PASS_THROUGH = re.compile(
    r"(View|UnsafeView|Reshape\w*|Alias|Transpose|T|Permute|Expand|Squeeze\w*|Unsqueeze\w*|Clone|"
    r"ToCopy|AsStrided|Detach|Unfold|ViewAs\w*|Conj|Flatten\w*|Cat|Stack|Add|Sub)Backward\d*"
)
"""Autograd nodes that may hand their gradient on as the same memory: views of it (view,
transpose, cat's slices, ...) or the tensor itself (clone, add, same-dtype ``to``)."""


def _grad_may_reach_a_leaf(t: Tensor, depth: int = 8) -> bool:
    """Whether the gradient returned for `t` may become a leaf's ``.grad`` without a copy: `t`
    is a leaf, or a leaf is reached through nodes that pass the gradient on unchanged or as a
    view (view, reshape, transpose, clone, same-dtype ``to``, ...). Past `depth` such nodes,
    yes (a copy is always safe)."""
    if not t.requires_grad:
        return False
    if t.grad_fn is None:
        return True
    frontier: list[Any] = [t.grad_fn]
    seen: set[int] = set()
    for _ in range(depth):
        next_frontier: list[Any] = []
        for node in frontier:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad":
                return True
            if _PASS_THROUGH.fullmatch(type(node).__name__):
                next_frontier.extend(n for n, _ in node.next_functions if n is not None)
        if not next_frontier:
            return False
        frontier = next_frontier
    return True


class _CudaGraphed:
    """The two CUDA graphs of one module and their static buffers.

    Warm-up and both captures run on one side stream, on fresh leaf aliases of the inputs and
    parameters (``detach()``: the same storage, no copy). Autograd binds a leaf's gradient
    accumulator to the stream it was created on; the parameters' own accumulators live on the
    default stream (and DDP keeps them alive), and a backward captured into them would wait
    on that stream, which invalidates the capture."""

    def __init__(
        self,
        run: Callable[..., Any],
        inputs: tuple[Tensor, ...],
        params: tuple[nn.Parameter, ...],
        *,
        warmup_iters: int,
        shared_outputs: bool = False,
        chained: tuple[bool, ...] = (),
        share: PoolShare | None = None,
    ) -> None:
        self.params = params
        self.share = PoolShare() if share is None else share
        """The pool and the replay count this capture shares with the module's other captures."""
        self.fwd_hooks: tuple[ReplayHook, ...] = ()
        """Host work that code inside the forward capture deferred to every replay
        (:func:`loka_train.utils.capture.after_replay`), run after each forward replay."""
        self.bwd_hooks: tuple[ReplayHook, ...] = ()
        """Likewise for the backward capture."""
        self.shared_outputs = shared_outputs
        """Replays return the static output buffers themselves, not copies (see `capture_cuda_graphs`)."""
        chained = chained or (False,) * len(inputs)
        # A chained input is another graph's shared output buffer: the capture reads it in
        # place, so a replay fed that buffer copies nothing.
        self.static_inputs = tuple(t.detach() if c else t.detach().clone() for t, c in zip(inputs, chained, strict=True))
        needs_grad = tuple(t.requires_grad for t in inputs)
        self.grad_targets = [i for i, g in enumerate(needs_grad) if g] + [
            len(inputs) + j for j in range(len(params))
        ]

        def leaves() -> tuple[tuple[Tensor, ...], list[Tensor], list[Tensor]]:
            ins = tuple(t.detach().requires_grad_(g) for t, g in zip(self.static_inputs, needs_grad))
            ps = [p.detach().requires_grad_() for p in params]
            return ins, ps, [t for t in ins if t.requires_grad] + ps

        stream = capture_stream()  # raises without CUDA, before any state changes
        stream.wait_stream(torch.cuda.current_stream())
        # Autocast's cast cache would keep weight casts made during the capture (stale after
        # the first optimizer step): the graphs cast inside, as the eager forward does.
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            # Warm-up runs are not steps: host work deferred inside them is dropped.
            with torch.cuda.stream(stream), replay_hooks(keep=False):
                for _ in range(warmup_iters):
                    ins, ps, targets = leaves()
                    outs = [o for o in flatten_output(run(tuple(ps), *ins))[0] if o.requires_grad]
                    if outs and targets:
                        torch.autograd.grad(outs, targets, [torch.ones_like(o) for o in outs],
                                            allow_unused=True)
                    del outs
            self.pool = self.share.handle
            self.fwd = torch.cuda.CUDAGraph()
            with replay_hooks() as fwd_hooks, torch.cuda.graph(
                self.fwd, pool=self.pool, stream=stream, capture_error_mode="thread_local"
            ):
                ins, ps, targets = leaves()
                flat_out, spec = flatten_output(run(tuple(ps), *ins))
            self.static_outputs = tuple(flat_out)
            self.differentiable = tuple(o.requires_grad for o in flat_out)
            diff_outs = [o for o in flat_out if o.requires_grad]
            self.static_grad_outputs = tuple(torch.empty_like(o) for o in diff_outs)
            self.bwd = torch.cuda.CUDAGraph()
            with replay_hooks() as bwd_hooks, torch.cuda.graph(
                self.bwd, pool=self.pool, stream=stream, capture_error_mode="thread_local"
            ):
                grads = torch.autograd.grad(
                    diff_outs, targets, self.static_grad_outputs, allow_unused=True
                ) if diff_outs and targets else ()
            self.static_grads = tuple(grads)
            self.fwd_hooks, self.bwd_hooks = tuple(fwd_hooks), tuple(bwd_hooks)
        except BaseException:
            reset_capture_state()
            raise
        finally:
            torch.set_autocast_cache_enabled(cache)
            torch.cuda.current_stream().wait_stream(stream)
        self.out_spec = spec

    @property
    def shared_buffers(self) -> tuple[Tensor, ...]:
        return self.static_outputs if self.shared_outputs else ()

    def forward(self, flat_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        return list(_Replay.apply(self, *flat_inputs, *self.params))

    def release(self) -> None:
        for graph in (self.fwd, self.bwd):
            graph.reset()
        self.static_outputs = self.static_grads = self.static_inputs = self.static_grad_outputs = ()
        self.fwd_hooks = self.bwd_hooks = ()  # they hold the captured statistics' buffers


def capture_cuda_graphs(
    run: Callable[..., Any],
    inputs: tuple[Tensor, ...],
    params: tuple[nn.Parameter, ...],
    *,
    warmup_iters: int = 3,
    shared_outputs: bool = False,
    chained: tuple[bool, ...] = (),
    share: PoolShare | None = None,
) -> Graphed:
    """Capture ``run(*inputs)``'s forward and its backward (to `inputs` that require grad and
    `params`) as two CUDA graphs sharing one private memory pool (`share`'s, when given: the
    pool of the module's other captures).

    Host work that `run` defers with :func:`loka_train.utils.capture.after_replay` runs after
    every replay of the graph it was captured in; in the warm-up runs before the capture it is
    dropped.

    Args:
        shared_outputs: replays return the static output buffers, not copies of them: valid
            until the module's next training forward (for outputs that only the model's next
            graphed module reads).
        chained: per input, whether it is another graph's shared output buffer, which this
            capture then reads in place (no copy on replay while the producer keeps it).
    """
    return _CudaGraphed(run, inputs, params, warmup_iters=warmup_iters, shared_outputs=shared_outputs,
                        chained=chained, share=share)
