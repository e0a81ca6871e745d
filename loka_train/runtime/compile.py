"""``trainer.compile_dense``: the dense submodules under ``torch.compile``, and its fallbacks.

After sharding, the dense submodules (bottom MLP, interaction, top MLP) are compiled. Without
CUDA graphs, a submodule without :class:`~loka_train.runtime.eager.Keyed` modules inside is
compiled in place (``nn.Module.compile``), and one with them gets an instance ``forward`` from
:func:`eager_or_compiled`: the steps on which a callback requests it eagerly run its own
uncompiled forward, the rest the compiled one. With CUDA graphs, the graphs' router compiles each
module's forward instead (:class:`~loka_train.runtime.graphs.DenseGraphs` ``compile``). Either
way parameter names, the optimizer and checkpoints are unchanged.

A frame that dynamo gives up on runs eagerly for the rest of the run; :class:`FrameSkips`
reports each one as a fallback.

Example:
    >>> options = compile_options("inductor")
    >>> names = compile_in_place(model, options=options, eager=EagerSteps())
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loka_train.runtime.eager import EagerSteps, keyed_modules

logger = logging.getLogger(__name__)

__all__ = [
    "FrameSkips",
    "allow_recompiles",
    "compile_in_place",
    "compile_options",
    "dynamo_frame_skips",
    "eager_or_compiled",
]


def compile_options(backend: str) -> dict[str, Any]:
    """The keyword arguments of ``torch.compile`` for the dense submodules.

    Static shapes: a train and an eval batch size each get their own graph instead of one graph
    with a symbolic batch dim, which dynamo's DDP optimizer could not split (an H100 Wukong run
    failed with "'int' object has no attribute 'meta'") and which CUDA graphs replay per shape
    anyway.
    """
    options: dict[str, Any] = {"backend": backend, "dynamic": False}
    if backend == "inductor":
        # Inductor would otherwise fuse "x.to(bf16)" into the FP8 quantizer's division
        # and skip the rounding: compiled FP8 codes would differ from the eager ones the
        # Probe measured and the backends are tested against (40 dB apart on an H100).
        options["options"] = {"emulate_precision_casts": True}
    return options


def compile_in_place(
    found: dict[str, nn.Module], *, options: dict[str, Any], eager: EagerSteps
) -> list[str]:
    """Compile each of `found` (name -> dense submodule) without CUDA graphs; returns the names.

    A submodule holding :class:`~loka_train.runtime.eager.Keyed` modules is watched in `eager`
    and gets :func:`eager_or_compiled` as its instance ``forward``; any other is compiled in
    place (``nn.Module.compile``).
    """
    for module in found.values():
        if keyed_modules(module):
            # An instance attribute shadows the class's forward (as under the graphs):
            # requested steps run eagerly, the rest compiled.
            eager.watch(module)
            module.forward = eager_or_compiled(  # type: ignore[method-assign]
                module, torch.compile(module.forward, **options), module.forward, eager
            )
        else:
            module.compile(**options)
    return list(found)


def allow_recompiles(model: nn.Module) -> None:
    """Raise dynamo's recompile limit to 4 per :class:`~loka_train.runtime.eager.Keyed` module.

    A compiled frame guards on the keys of the keyed modules it runs (an FP8 site's plan): every
    key combination (and each batch shape and grad mode) is one more cache entry of that frame.
    """
    num_keyed = len(keyed_modules(model))
    limit = max(torch._dynamo.config.recompile_limit, 4 * num_keyed)
    if limit != torch._dynamo.config.recompile_limit:
        logger.info("compile_dense: dynamo recompile_limit %d -> %d (%d keyed modules)",
                    torch._dynamo.config.recompile_limit, limit, num_keyed)
        torch._dynamo.config.recompile_limit = limit


def eager_or_compiled(
    module: nn.Module, compiled: Callable[..., Any], eager_forward: Callable[..., Any], eager: EagerSteps
) -> Callable[..., Any]:
    """A forward for a compiled `module` (``trainer.compile_dense`` without CUDA graphs):
    training calls on steps that request `module` eagerly (`eager`, which must watch it) run
    `eager_forward`, the module's own uncompiled forward; every other call runs `compiled`.

    Why: a callback's host work inside the module (the LoKA Probe's statistics) reaches compiled
    code through a graph break. Inside a loop over layers (DCN's cross layers, Wukong's layers,
    ``nn.Sequential``) dynamo cannot resume after a break, so it skips the whole frame for good:
    the module then ran eagerly on every step, unfused (DCN at batch 32768 on an H100: 23 ms per
    step against 14 ms for the same model in bf16,
    ``bench/results/e2e_rotated_batches_h100_2026-11-24b/NOTES.md``). Compiled only
    for the other steps, the compiled code has no break; the requested steps, eager either way,
    do their host work. With ``eager.compiled_requests`` (``trainer.compile_sampled``) the
    requested steps run `compiled` too: the LoKA Probe's reports enter compiled code as opaque
    ops, without a break (``mods.probe_tap``).
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if module.training and torch.is_grad_enabled() and eager.runs_uncompiled(module):
            return eager_forward(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward


_FRAME_SKIPPED = re.compile(r"frame skipped: (\S+) \((.+) line (\d+)\)")
_RECOMPILE_LIMIT = re.compile(r"exceeding the (\w+) cache size limit \(currently set to (\d+)\)")


def dynamo_frame_skips() -> dict[str, int]:
    """The frames torch.compile gave up on in this process, which it then runs eagerly for
    good, as ``{"function (file line N)": times}``: a graph break inside a for/while loop
    skips the whole frame. A frame that hit dynamo's recompile limit (a module whose keyed
    modules went through more keys than :func:`allow_recompiles` allows for) runs only the
    graphs it has, else eagerly; dynamo's counters do not name it (its warning in the log does),
    so it reads ``"a frame past dynamo's recompile_limit=N"``. Compare two readings to see what
    a span of work skipped.

    Read from dynamo's graph-break counters (``torch._dynamo.utils.counters``, filled whether
    or not ``TORCH_LOGS`` is set; no public API exposes them). Empty if that internal ever
    changes shape."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo's counters
        return {}
    found: Counter[str] = Counter()
    for reason, times in list(counters.get("unimplemented", {}).items()):
        for fn, path, line in _FRAME_SKIPPED.findall(str(reason)):
            found[f"{fn} ({path} line {line})"] += int(times)
        for kind, limit in _RECOMPILE_LIMIT.findall(str(reason)):
            found[f"a frame past dynamo's {kind}={limit}"] += int(times)
    return dict(found)


class FrameSkips:
    """The frames dynamo gave up on since it was made (the dense modules' compilation).

    Each new one is a fallback: it runs eagerly (unfused) for the rest of the run.
    """

    def __init__(self) -> None:
        self._last = dynamo_frame_skips()
        self.frames: list[str] = []
        """Every frame skipped so far, as ``"function (file line N)"``."""

    def report(self, fallbacks: list[str]) -> None:
        """Add the frames skipped since the last reading to `frames`, each also as a logged line
        in `fallbacks`."""
        now = dynamo_frame_skips()
        for frame, times in now.items():
            if times > self._last.get(frame, 0) and frame not in self.frames:
                self.frames.append(frame)
                line = (f"compile_dense: torch.compile runs {frame} eagerly for the rest of the run "
                        "(a graph break inside a loop, or too many recompiles; TORCH_LOGS=graph_breaks,recompiles "
                        "shows which)")
                fallbacks.append(line)
                logger.warning("%s", line)
        self._last = now
