"""A served model's dense towers as ``torch.export`` programs (and AOTInductor packages).

The embedding lookup takes TorchRec's ``KeyedJaggedTensor`` and stays a module (the trained
tables, unsharded); the dense submodules of the DLRM family (``dense_arch``, ``inter_arch``,
``over_arch``) take and return tensors, and each becomes one ``ExportedProgram``:

* :func:`export_dense` records each dense submodule's inputs on one call of the served model and
  exports it under ``torch.no_grad()`` (the served path: FP8 weights quantized once, only the
  activations quantized at each call), the batch dimension dynamic by default;
* :func:`save_programs` / :func:`load_programs` write and read them (``<name>.pt2``,
  ``torch.export.save``); :func:`install_programs` puts the programs' modules in place of a
  model's dense submodules, so that ``model(dense, sparse)`` runs them;
* :func:`aoti_package` compiles one program with AOTInductor into a package
  (``torch._inductor.aoti_compile_and_package``), loaded with ``torch._inductor.aoti_load_package``;
* :func:`compile_served` compiles the served towers in place with ``torch.compile`` instead (as
  training compiles them, with inductor's CUDA graphs on request), and :class:`SkipGuards` calls
  such a model without re-checking dynamo's guards on its frozen state for calls like earlier ones.

A program holds the LoKA custom ops its sites call (the quantizers, the Triton and emulated
GEMMs): load it in a process that imported ``loka_train`` (which registers them). It computes
what the served model computes under ``torch.compile`` on the device it was exported on (the
code ``torch.export`` traces is the code ``torch.compile`` traces: where a site's quantizer is
traced rather than an opaque op, as the emulated backend's on a CPU, its tensor-wise cast takes
its dynamic scale, not a static one, ``loka.mods.static_scales``).

Example:
    >>> programs = export_dense(served_model, batch)            # after serve(...)
    >>> save_programs(programs, "export/dense")
    >>> install_programs(fresh_model, load_programs("export/dense"))
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_train.runtime.compile import compile_options
from loka_train.runtime.graphs import DENSE_SUBMODULES, dense_submodules

logger = logging.getLogger(__name__)

__all__ = [
    "ProgramModule", "SkipGuards", "aoti_package", "compile_served", "export_dense", "install_programs", "load_programs",
    "save_programs",
]

SUFFIX = ".pt2"


def _batch_dims(args: tuple[Any, ...], batch: int, dim: Any) -> tuple[Any, ...]:
    """``dynamic_shapes`` for `args`: dim 0 of each tensor whose first size is the batch."""
    return tuple({0: dim} if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch else None for a in args)


class _Autocast(nn.Module):
    """`module` under autocast to `dtype`: exported, the program records the autocast region,
    so it computes the same whatever autocast state it is called in."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module = module
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args: Any) -> Any:
        if self.dtype is None:
            with torch.autocast(self.device_type, enabled=False):
                return self.module(*args)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args)


class ProgramModule(nn.Module):
    """An exported program's module in place of the submodule it was exported from: called as
    that submodule was (positional or keyword arguments, `names` its parameters in order), it
    passes them to the program in that order."""

    def __init__(self, program: torch.export.ExportedProgram, names: list[str]) -> None:
        super().__init__()
        self.program = program.module()
        self.names = names

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        given = dict(zip(self.names, args))
        given.update(kwargs)
        missing = [n for n in self.names if n not in given]
        if missing or len(given) != len(self.names):
            raise TypeError(f"the exported program takes {self.names}; got {len(args)} positional and {sorted(kwargs)}")
        return self.program(*(given[n] for n in self.names))


def export_dense(
    model: nn.Module, batch: Any, *, dynamic_batch: bool = True, autocast: torch.dtype | None = torch.bfloat16,
) -> dict[str, torch.export.ExportedProgram]:
    """Export each dense submodule of a served DLRM-family `model` (``dense_arch``,
    ``inter_arch``, ``over_arch``) with the inputs one call on `batch` gives it.

    Args:
        model: a served model (:func:`~loka_train.export.serve`), called as
            ``model(batch.dense_features, batch.sparse_features)``.
        batch: a batch of the model's data (its size is the example batch size).
        dynamic_batch: the programs take any batch size >= 2 (the batch dimension symbolic);
            False: only the example's.
        autocast: the autocast dtype the model is served under (None: no autocast); each
            program runs its submodule under it, whatever autocast state its caller is in.

    Raises:
        ValueError: where the model has no dense submodule, or a submodule takes non-tensor inputs.
    """
    found = dense_submodules(model, DENSE_SUBMODULES, setting="export_dense", verb="export")
    inputs: dict[str, dict[str, Any]] = {}

    def record(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # By parameter name: the caller may pass them either way.
            bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
            inputs.setdefault(name, {k: a.detach() if isinstance(a, Tensor) else a for k, a in bound.items()})
        return hook

    handles = [m.register_forward_pre_hook(record(n), with_kwargs=True) for n, m in found.items()]
    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else torch.autocast(device.type, enabled=False)
    try:
        with torch.no_grad(), ctx:
            model(batch.dense_features, batch.sparse_features)
    finally:
        for h in handles:
            h.remove()
    size = int(batch.dense_features.shape[0])
    programs = {}
    for name, module in found.items():
        if name not in inputs:
            raise ValueError(f"export_dense: the model's call on the example batch did not reach {name}")
        bound = inputs[name]  # in the order of the submodule's parameters
        bad = {k: type(a).__name__ for k, a in bound.items() if not isinstance(a, Tensor)}
        if bad:
            raise ValueError(f"export_dense: {name} takes {bad}; only submodules of tensors are exported")
        args = tuple(bound.values())
        dims = _batch_dims(args, size, torch.export.Dim("batch", min=2)) if dynamic_batch else None
        with torch.no_grad():
            # The wrapper takes *args: its one input is the tuple of the submodule's.
            programs[name] = torch.export.export(_Autocast(module, device.type, autocast), args,
                                                 dynamic_shapes=None if dims is None else (dims,))
        logger.info("export_dense: %s (%s batch)", name, "dynamic" if dynamic_batch else f"static {size}")
    return programs


def save_programs(programs: Mapping[str, torch.export.ExportedProgram], directory: str | Path) -> list[Path]:
    """Write each program to ``<directory>/<name>.pt2``; the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, program in programs.items():
        path = out / f"{name}{SUFFIX}"
        torch.export.save(program, path)
        paths.append(path)
    return paths


def load_programs(directory: str | Path) -> dict[str, torch.export.ExportedProgram]:
    """The programs :func:`save_programs` wrote to `directory`, by name.

    Raises:
        FileNotFoundError: where `directory` holds none.
    """
    import loka_train.kernels  # noqa: F401  (registers the custom ops the programs call)

    paths = sorted(Path(directory).glob(f"*{SUFFIX}"))
    if not paths:
        raise FileNotFoundError(f"{directory}: no *{SUFFIX} program; write them with save_programs (or the export)")
    return {p.name[: -len(SUFFIX)]: torch.export.load(p) for p in paths}


def install_programs(model: nn.Module, programs: Mapping[str, torch.export.ExportedProgram]) -> nn.Module:
    """Put each program's module in place of `model`'s dense submodule of that name, in place;
    returns `model`.

    Raises:
        ValueError: where a program names no dense submodule of `model`.
    """
    found = dense_submodules(model, DENSE_SUBMODULES, setting="install_programs", verb="replace")
    unknown = sorted(set(programs) - set(found))
    if unknown:
        raise ValueError(f"install_programs: {unknown} name no dense submodule; the model has {sorted(found)}")
    for name, program in programs.items():
        target = found[name]
        # The parameters the program was exported with: the first ones of the tower's forward
        # (export_dense passes those the example call bound), or a program module's own.
        taken = sum(spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
                    for spec in program.graph_signature.input_specs)
        names = target.names if isinstance(target, ProgramModule) else \
            list(inspect.signature(target.forward).parameters)[:taken]
        # Its parent found by identity: the names above have wrapper prefixes (DMP, DDP) stripped.
        parent, attr = next((m, child_name) for m in model.modules()
                            for child_name, child in m.named_children() if child is target)
        setattr(parent, attr, ProgramModule(program, names))
    return model


def aoti_package(program: torch.export.ExportedProgram, path: str | Path) -> Path:
    """Compile `program` with AOTInductor into the package `path` (``.pt2``); load it with
    ``torch._inductor.aoti_load_package(path)``."""
    from torch._inductor import aoti_compile_and_package

    # Inductor's options as trainer.compile_dense sets them (emulate_precision_casts: the FP8
    # quantizer's rounding kept, the same codes as the program).
    options = compile_options("inductor")["options"]
    return Path(aoti_compile_and_package(program, package_path=str(path), inductor_configs=options))


def compile_served(model: nn.Module, *, graphs: bool = False) -> list[str]:
    """Compile a served model's dense towers in place for inference: ``torch.compile`` on each
    of ``dense_arch``, ``inter_arch`` and ``over_arch`` with the training runtime's options
    (inductor, static shapes: one graph per batch size), with inductor's CUDA graphs where
    ``graphs``; the embedding lookup stays eager. Their names. Serve
    (:func:`~loka_train.export.serve`) first: plans served after the compile recompile the
    towers. Each batch size a tower is called with is one more entry of dynamo's cache; past its
    ``recompile_limit`` (8 by default) dynamo runs the tower eagerly: serve a few batch sizes, or
    raise ``torch._dynamo.config.recompile_limit``.

    Raises:
        ValueError: where the model has none of those towers, or one holds a sharded module.
    """
    options = compile_options("inductor")
    if graphs:
        options["options"] = {**options.get("options", {}), "triton.cudagraphs": True}
    found = dense_submodules(model, DENSE_SUBMODULES, setting="compile_served", verb="compile")
    for module in found.values():
        module.compile(**options)
    return list(found)


class _Unkeyed(Exception):
    """An argument :func:`_signature` cannot tell calls apart by: the call runs with every guard."""


_CONSTANTS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


def _signature(value: Any) -> Any:
    """What of a call's argument decides which of dynamo's cache entries runs it: a tensor's
    shape, strides, dtype, device and ``requires_grad``; a ``KeyedJaggedTensor``'s keys and batch
    size (the pooled embeddings the towers see take their shapes from those); a sequence's or a
    mapping's items'; an immutable constant's value. Anything else (an object whose attributes a
    graph may read) raises :class:`_Unkeyed`."""
    if isinstance(value, Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, KeyedJaggedTensor):
        return (KeyedJaggedTensor, tuple(value.keys()), value.stride(), value.values().device)
    if isinstance(value, (tuple, list)):
        return (type(value), *map(_signature, value))
    if isinstance(value, Mapping):
        return (type(value), *((_signature(k), _signature(v)) for k, v in value.items()))
    if isinstance(value, _CONSTANTS):
        return (type(value), value)
    raise _Unkeyed(type(value).__name__)


class SkipGuards(nn.Module):
    """A compiled served model (:func:`compile_served`) whose repeated calls skip most of dynamo's
    guard evaluation, as a server calls it. A call like one already made (:func:`_signature` of
    each argument, grad and inference mode, the autocast state of the arguments' device, the
    training flag; an argument other than tensors, jagged tensors, their sequences and mappings
    and immutable constants makes a call never known) runs under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, where dynamo checks only the
    guards that tell its cache entries apart (those that failed when a tower recompiled, and the
    non-parameter tensors'), not the hundreds each tower's graph holds.
    A call unlike any before runs with every guard (compiling where it must) and makes its kind
    known. Where a known call fails without its guards (dynamo finds no graph for it and refuses
    to compile under that stance, as torch 2.11 does where the model or the process changed
    since: another model compiled code the towers share, a global setting changed), it runs
    again with every guard, logged and counted (``guard_fallbacks``), and an error of the
    model's own raises there. Counts ``warm_calls``, ``cold_calls`` and ``guard_fallbacks``.

    For a frozen model only: the guards skipped are those on the model's own state. After the
    wrapped model changes (plans served again, weights loaded, a submodule replaced) call
    :meth:`reset`, or its next calls may run a graph of the model as it was."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._known: set[Any] = set()
        self.warm_calls = 0
        self.cold_calls = 0
        self.guard_fallbacks = 0

    def reset(self) -> None:
        """Forget the calls made: every next kind of call runs once more with all of its guards."""
        self._known.clear()

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call's kind (see the class docstring); raises :class:`_Unkeyed` for an argument no
        signature describes."""
        devices = {a.device.type for a in args if isinstance(a, Tensor)} or {"cpu"}
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in sorted(devices))
        return (self.model.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                _signature(args), tuple(sorted((k, _signature(v)) for k, v in kwargs.items())))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            key = self._key(args, kwargs)
        except _Unkeyed:  # an argument that no signature describes: never a known call
            key = None
        # Under another stance (force_eager, fail_on_recompile, ...) the caller's stance holds.
        stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
        if key in self._known and stance == "default":
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = self.model(*args, **kwargs)
            except Exception as exc:
                # Dynamo found no graph for the call without its guards and refuses to compile
                # there (torch 2.11: the model or the process changed since this kind of call
                # ran, e.g. another model compiled code the towers share), or the call failed
                # otherwise: run it with every guard, where an error of the model's own raises.
                self.guard_fallbacks += 1
                logger.warning("SkipGuards: a known call failed without its guards (%s: %s); running it with "
                               "every guard (%d such calls)", type(exc).__name__, str(exc).split(".")[0],
                               self.guard_fallbacks)
            else:
                self.warm_calls += 1
                return out
        out = self.model(*args, **kwargs)
        if key is not None:
            self._known.add(key)
        self.cold_calls += 1
        return out
