"""LoKA's FP8 autograd Functions as opaque ``torch.library`` custom ops, for compiled code.

``torch.compile`` traces into an ``autograd.Function``: its forward and, at the same time, its
backward. Traced, LoKA's FP8 Functions (``kernels.linear``, ``kernels.fused``, the sites'
batched GEMM) broke the graph inside their backward on torch 2.11 (an enum call in the backend
check), which inside DCN's loop over cross layers made dynamo run the whole cross network
eagerly for good, and the traced backward's high-precision GEMMs ran as fp32 SIMT kernels
(on an H100, ``bench/results/e2e_rotated_batches_h100_2026-11-24b/NOTES.md``). As custom ops, dynamo and AOTAutograd see one
op for a Function's forward and one for its backward and never look inside: there is nothing
in them to break on, and inside, the Function's own ``forward`` and ``backward`` run exactly
as in eager code (the same kernels, dtypes and numerics).

How one Function becomes two ops:

* its **forward op** (one per Function, with a typed schema; :func:`define` registers it) runs
  ``Fn.forward`` with a stand-in ctx, under the autocast state the caller passes (so fake and
  real runs pick the same compute dtype), and returns the output (the Function's outputs,
  where it returns a tuple whose first alone is differentiable) followed by the tensors the
  forward saved that are neither inputs nor views of the output (a custom op may not return
  aliases); :func:`run_forward` is its body;
* its ``setup_context`` rebuilds the saved tensors (views of the op's inputs and outputs, from
  their sizes and strides) and encodes the ctx's other attributes (plans, dtypes, flags) as a
  string;
* one shared **backward op**, ``loka::fn_backward(fn, grad, saved, state)``, runs
  ``Fn.backward`` with a ctx rebuilt from them; the gradients of the arguments named in
  :func:`define`'s ``traced_grads`` (a linear's bias: a sum of the output gradient's rows) are
  computed instead by traced code in the op's registered backward, which the compiler fuses.

The fake implementation of both ops is the op itself run on fake tensors: every kernel the
Functions call is an aten op or a custom op with its own fake implementation, which the
Triton wrappers call through ``torch.ops`` while :func:`tracing` holds. The ctx's
attributes must therefore be plain data (plans, dtypes, bools, numbers, strings, tuples of
them); a shape among them must be static (``torch.compile(dynamic=False)``, as
``trainer.compile_dense`` compiles).

Eager code keeps calling ``Fn.apply`` (no op overhead); :func:`opaque` says when to take the
ops instead: under ``torch.compile``, unless the caller's ``compiled_quantizer`` is
``"inductor"`` (``settings.KernelSettings.compiled_quantizer``), which asks for the Functions to
be traced so that inductor can fuse their quantizers.

Example (what ``kernels.linear`` does)::

    def _planned_linear(x: Tensor, ..., relu_mask: Tensor | None, producer_masks: bool,
                        autocast_dtype: torch.dtype | None, needs_grad: list[bool]) -> list[Tensor]:
        return run_forward("planned_linear", (x, ...), needs_grad, autocast_dtype, x.device.type)

    _planned_linear_op = define("planned_linear", _PlannedLinearFn, _planned_linear,
                                num_extra_args=4, masked_grads={0: (12, _relu_grad)},
                                output_mask=(7, _relu_grad))
    ...
    if opaque(compiled_quantizer):
        y = _planned_linear_op(x, weight, bias, plan.key, ...)[0]
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loka_train.kernels.plan import LinearPlan

__all__ = ["autocast_dtype", "define", "needs_grad", "opaque", "run_forward", "tracing"]


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}
"""Registered name -> the autograd Function its ops run."""


def opaque(compiled_quantizer: str) -> bool:
    """Whether LoKA's FP8 Functions run as their custom ops here: inside code that
    ``torch.compile`` traces, when ``compiled_quantizer`` is ``"custom"``
    (``settings.KernelSettings.compiled_quantizer``)."""
    if not torch.compiler.is_compiling():
        return False  # eager code: the Functions themselves, nothing more on the hot path
    return compiled_quantizer == "custom"


_faking = threading.local()


def tracing() -> bool:
    """Whether kernels must be called through ``torch.ops`` (not their Python implementations,
    which launch Triton on real data): while dynamo traces, and while an opaque op's fake
    implementation runs a Function on fake tensors."""
    return torch.compiler.is_compiling() or getattr(_faking, "active", False)


def _as_fake(impl: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
    """``impl`` as a fake implementation: the same body, with :func:`tracing` on."""

    @functools.wraps(impl)
    def fake(*args: Any) -> list[Tensor]:
        before, _faking.active = getattr(_faking, "active", False), True
        try:
            return impl(*args)
        finally:
            _faking.active = before

    return fake


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype on ``device_type``, or None when autocast is off there."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def needs_grad(*tensors: Tensor | None) -> list[bool]:
    """``ctx.needs_input_grad`` of a Function applied to ``tensors`` in the current grad mode."""
    grad = torch.is_grad_enabled()
    return [grad and t is not None and t.requires_grad for t in tensors]


class _Ctx:
    """What the Functions use of an autograd ctx: ``needs_input_grad``, ``save_for_backward`` /
    ``saved_tensors`` and plain attributes."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[Tensor | None, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        """The op marks every output after the first non-differentiable (``define``)."""

    def set_materialize_grads(self, value: bool) -> None:
        """The op's backward gets only the first output's gradient (``define``)."""


_CTX_SLOTS = ("needs_input_grad", "saved_tensors")


@dataclass(frozen=True)
class _Ref:
    """Where a saved tensor comes from: ``source`` ``"input"`` (the op's ``index``-th tensor
    input) or ``"output"`` (its ``index``-th output), as a view with ``geometry`` (sizes,
    strides, storage offset), or the tensor itself when ``geometry`` is None."""

    source: str
    index: int
    geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None


@dataclass
class _Forward:
    """What a forward op call leaves for its ``setup_context`` (the next call on its thread)."""

    fn: str
    attrs: dict[str, Any]
    refs: tuple[_Ref | None, ...]
    needs_input_grad: tuple[bool, ...]
    device_type: str


_last = threading.local()


def _same_storage(a: Tensor, b: Tensor) -> bool:
    # torch keeps one Python object per storage, fake tensors included.
    return a.untyped_storage() is b.untyped_storage()


def _ref_to(t: Tensor, candidates: Sequence[Tensor], source: str) -> _Ref | None:
    for i, c in enumerate(candidates):
        if c.dtype == t.dtype and _same_storage(t, c):
            same = t.shape == c.shape and t.stride() == c.stride() and t.storage_offset() == c.storage_offset()
            geometry = None if same else (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
            return _Ref(source, i, geometry)
    return None


def run_forward(
    fn: str,
    args: tuple[Any, ...],
    needs_grad: Sequence[bool],
    autocast: torch.dtype | None,
    device_type: str,
) -> list[Tensor]:
    """The body of a forward op (real and fake): ``Fn.forward(ctx, *args)`` under the given
    autocast state; returns ``[output, *saved tensors that are not inputs or views]``. A
    Function may return a tuple: its first output is the differentiable one, the others (which
    it marks non-differentiable) follow it, before the saved tensors."""
    fn_cls = _FUNCTIONS[fn]
    ctx = _Ctx(tuple(needs_grad) + (False,) * (len(args) - len(needs_grad)))
    state = torch.autocast(device_type, dtype=autocast, enabled=autocast is not None)
    with state, torch.no_grad():
        result = fn_cls.forward(ctx, *args)
    inputs = [a for a in args if isinstance(a, Tensor)]
    outputs = [o.clone() if any(_same_storage(o, t) for t in inputs) else o
               for o in (result if isinstance(result, tuple) else (result,))]
    refs: list[_Ref | None] = []
    for t in ctx.saved_tensors:
        if t is None:
            refs.append(None)
            continue
        ref = _ref_to(t, inputs, "input") or _ref_to(t, outputs, "output")
        if ref is None:
            outputs.append(t)
            ref = _Ref("output", len(outputs) - 1, None)
        refs.append(ref)
    attrs = {k: v for k, v in vars(ctx).items() if k not in _CTX_SLOTS}
    _last.forward = _Forward(fn, attrs, tuple(refs), ctx.needs_input_grad, device_type)
    return outputs


def _rebuild(ref: _Ref | None, inputs: list[Tensor], outputs: Sequence[Tensor]) -> Tensor | None:
    if ref is None:
        return None
    base = inputs[ref.index] if ref.source == "input" else outputs[ref.index]
    if ref.geometry is None:
        return base
    size, stride, offset = ref.geometry
    return base.as_strided(size, stride, offset)


# ------------------------------------------------------------------------ ctx state codec


def _encode(v: Any) -> Any:
    if isinstance(v, LinearPlan):
        return {"plan": v.key}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, tuple | list | torch.Size):
        return {"tuple": [_encode(x) for x in v]}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise ValueError(
        f"a compiled FP8 op cannot carry {type(v).__name__} {v!r} from its forward to its "
        "backward: compile with dynamic=False (trainer.compile_dense does), or report this"
    )


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        if "plan" in v:
            return LinearPlan.from_key(v["plan"])
        if "dtype" in v:
            return getattr(torch, v["dtype"])
        return tuple(_decode(x) for x in v["tuple"])
    return v


@dataclass(frozen=True)
class _State:
    fn: str
    attrs: tuple[tuple[str, Any], ...]
    saved_none: tuple[bool, ...]
    needs_input_grad: tuple[bool, ...]
    device_type: str


@functools.lru_cache(maxsize=4096)
def _state(text: str) -> _State:
    d = json.loads(text)
    return _State(
        fn=d["fn"],
        attrs=tuple((k, _decode(v)) for k, v in d["attrs"].items()),
        saved_none=tuple(d["saved_none"]),
        needs_input_grad=tuple(d["needs_input_grad"]),
        device_type=d["device_type"],
    )


# ----------------------------------------------------------------------------- backward op


def _fn_backward_impl(grad: Tensor, saved: list[Tensor], state: str) -> list[Tensor]:
    """``Fn.backward`` of a forward op's Function; returns its gradients that are not None
    (which ones are None follows from ``state``; the caller reads it from the thread)."""
    st = _state(state)
    ctx = _Ctx(st.needs_input_grad)
    for k, v in st.attrs:
        setattr(ctx, k, v)
    it = iter(saved)
    ctx.saved_tensors = tuple(None if none else next(it) for none in st.saved_none)
    with torch.autocast(st.device_type, enabled=False), torch.no_grad():
        grads = _FUNCTIONS[st.fn].backward(ctx, grad)
    out: list[Tensor] = []
    for g in grads:
        if g is None:
            continue
        if _same_storage(g, grad) or any(_same_storage(g, s) for s in saved) or any(
            _same_storage(g, o) for o in out
        ):
            g = g.clone()
        out.append(g)
    _last.backward = tuple(g is not None for g in grads)
    return out


_fn_backward = torch.library.custom_op("loka::fn_backward", _fn_backward_impl, mutates_args=())
_fn_backward.register_fake(_as_fake(_fn_backward_impl))


def define(
    name: str,
    fn_cls: type[torch.autograd.Function],
    impl: Callable[..., list[Tensor]],
    *,
    num_extra_args: int,
    traced_grads: Mapping[int, Callable[[Mapping[str, Any], Tensor], Tensor]] | None = None,
    masked_grads: Mapping[int, tuple[int, Callable[[Tensor, Tensor], Tensor]]] | None = None,
    output_mask: tuple[int, Callable[[Tensor, Tensor], Tensor]] | None = None,
) -> Any:
    """Define the custom op ``loka::<name>`` as the opaque form of ``fn_cls`` and return it.

    ``impl`` is the op's body (real and fake): it takes ``fn_cls.forward``'s arguments in order
    (non-tensors in a custom op's types: a plan as its ``key``), then ``num_extra_args`` more
    that get no gradient (autocast dtype, needs-grad flags), and returns :func:`run_forward`
    ``(name, ...)``. The op's gradient is ``fn_cls.backward``'s, through ``loka::fn_backward``,
    except for the arguments in ``traced_grads``: argument ``i``'s gradient is
    ``traced_grads[i](attrs, grad_output)`` (``attrs``: what the forward set on its ctx), traced
    into the backward graph where the compiler can fuse it, and ``fn_cls.backward`` is told
    that argument needs none; unless the forward named ``i`` in ``ctx.own_grads`` (a tuple of
    argument indices): then ``fn_cls.backward`` computes that gradient itself.

    ``masked_grads`` ``{i: (j, mask)}``: argument ``i``'s gradient, however computed, becomes
    ``mask(gradient, argument j)`` in traced code (``j`` one of the extra arguments, a tensor or
    None: None leaves the gradient as it is); the op keeps argument ``j`` for its backward where
    argument ``i`` needs a gradient. What a separate autograd Function around the op's input
    would do (a folded ReLU's mask, ``kernels.linear``), without one: such a Function's output
    is a view of its input, and where the compiled graph is split between it and the op (the
    DDP optimizer's buckets), the compiled code recreates that view outside
    autograd and the Function's backward is lost.

    ``output_mask`` ``(k, mask)``: where the forward saved a tensor at position ``k`` of its saved
    tensors (not None), the output's gradient is ``mask(gradient, that tensor)``: the traced
    gradients are computed from the masked one, and so is ``fn_cls.backward``'s, which gets it
    masked in traced code (its ctx's ``output_grad_masked`` set) unless its forward set
    ``ctx.fuses_output_mask`` (it applies the mask itself, as its quantizer reads the gradient).
    A ReLU folded into the next layer whose backward the layer before applies
    (``kernels.linear``'s ``output_relu``).
    """
    traced = dict(traced_grads or {})
    masked = dict(masked_grads or {})
    if name in _FUNCTIONS:
        raise ValueError(f"opaque Function {name!r} is already defined")
    _FUNCTIONS[name] = fn_cls
    op = torch.library.custom_op(f"loka::{name}", impl, mutates_args=())
    op.register_fake(_as_fake(impl))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
        fwd: _Forward = _last.forward
        assert fwd.fn == name, f"setup_context of {name} after a forward of {fwd.fn}"
        tensors = [a for a in inputs if isinstance(a, Tensor)]
        saved = [_rebuild(r, tensors, output) for r in fwd.refs]
        needs = list(fwd.needs_input_grad)
        attrs = dict(fwd.attrs)
        ctx.loka_output_mask = None  # its position among the tensors saved below
        if output_mask is not None and output_mask[0] >= len(saved):
            raise ValueError(f"{name}: output_mask names saved tensor {output_mask[0]}, but the forward saved "
                             f"{len(saved)}")
        if output_mask is not None and saved[output_mask[0]] is not None:
            ctx.loka_output_mask = sum(s is not None for s in saved[:output_mask[0]])
            if not attrs.get("fuses_output_mask", False):
                attrs["output_grad_masked"] = True
        masks = [(i, inputs[j]) for i, (j, _) in sorted(masked.items())
                 if i < len(needs) and needs[i] and isinstance(inputs[j], Tensor)]
        ctx.loka_masks = [i for i, _ in masks]
        ctx.save_for_backward(*(s for s in saved if s is not None), *(m for _, m in masks))
        ctx.mark_non_differentiable(*output[1:])
        own = fwd.attrs.get("own_grads", ())  # the Function computes these itself this time
        ctx.loka_traced = [i for i in sorted(traced) if i < len(needs) and needs[i] and i not in own]
        for i in ctx.loka_traced:
            needs[i] = False  # computed in the traced backward below, not by the Function
        ctx.loka_attrs = attrs
        ctx.loka_state = json.dumps({
            "fn": name,
            "attrs": {k: _encode(v) for k, v in attrs.items()},
            "saved_none": [s is None for s in saved],
            "needs_input_grad": needs,
            "device_type": fwd.device_type,
        })
        ctx.loka_num_args = len(inputs)

    def backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
        grad = grads[0]
        num_fn_args = ctx.loka_num_args - num_extra_args
        if grad is None:
            return (None,) * ctx.loka_num_args
        saved = list(ctx.saved_tensors)
        kept = len(saved) - len(ctx.loka_masks)
        saved, masks = saved[:kept], dict(zip(ctx.loka_masks, saved[kept:], strict=True))
        grad_out = grad  # the output's gradient, with output_mask's mask where the forward saved one
        if ctx.loka_output_mask is not None:
            assert output_mask is not None
            grad_out = output_mask[1](grad, saved[ctx.loka_output_mask])
        # The traced gradients first: traced before the op, inductor can fuse them with the code
        # that produces ``grad`` (on the CPU it does; a GPU's split reduction may stay apart);
        # after it, they became passes of their own.
        traced_grads = {i: traced[i](ctx.loka_attrs, grad_out) for i in ctx.loka_traced}
        given = iter(_fn_backward(grad_out if ctx.loka_attrs.get("output_grad_masked") else grad, saved,
                                  ctx.loka_state))
        present: tuple[bool, ...] = _last.backward
        fn_grads = list(next(given) if p else None for p in present)[:num_fn_args]
        fn_grads += [None] * (num_fn_args - len(fn_grads))
        for i, g in traced_grads.items():
            fn_grads[i] = g
        for i, mask in masks.items():
            g = fn_grads[i]
            if g is not None:
                fn_grads[i] = masked[i][1](g, mask)
        return tuple(fn_grads) + (None,) * num_extra_args

    op.register_autograd(backward, setup_context=setup_context)
    return op

