"""Kernel settings that change behaviour, and the environment variables that may override them.

Each setting is passed explicitly to the code it changes: ``compiled_quantizer`` to the FP8
Functions (``fp8_linear``, ``layernorm_linear``, the sites' batched GEMM; a site holds it from
``mods.compiled_quantizer``), ``triton_autotune`` to the ``triton`` backend when the registry
builds it. :meth:`KernelSettings.with_env_overrides` is the one place loka_train reads their
environment variables (``LOKA_COMPILED_QUANTIZER``, ``LOKA_TRITON_AUTOTUNE``), and it is called
when those consumers are built, never at import.

Example:
    >>> KernelSettings().compiled_quantizer
    'custom'
    >>> KernelSettings().with_env_overrides({"LOKA_TRITON_AUTOTUNE": "0"}).triton_autotune
    False
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["COMPILED_QUANTIZERS", "ENV_COMPILED_QUANTIZER", "ENV_TRITON_AUTOTUNE", "KernelSettings"]

COMPILED_QUANTIZERS: tuple[str, ...] = ("custom", "inductor")
"""Values of :attr:`KernelSettings.compiled_quantizer`."""

ENV_COMPILED_QUANTIZER = "LOKA_COMPILED_QUANTIZER"
"""Overrides :attr:`KernelSettings.compiled_quantizer` (``custom`` or ``inductor``)."""

ENV_TRITON_AUTOTUNE = "LOKA_TRITON_AUTOTUNE"
"""``0`` overrides :attr:`KernelSettings.triton_autotune` to False (anything else: True)."""


@dataclass(frozen=True, kw_only=True)
class KernelSettings:
    """How LoKA's kernels behave where a run may choose.

    Example:
        >>> KernelSettings(compiled_quantizer="inductor", triton_autotune=False)
        KernelSettings(compiled_quantizer='inductor', triton_autotune=False)
    """

    compiled_quantizer: str = "custom"
    """What quantizes FP8 operands in code that ``torch.compile`` traces
    (``trainer.compile_dense``); eager code is the same either way:

    * ``custom`` (default): each FP8 Function (``linear.fp8_linear``, ``fused.layernorm_linear``,
      the sites' batched GEMM) is one opaque custom op each way (``kernels.opaque``) that runs
      the eager code inside, Triton quantizers and fused LayerNorm -> FP8 kernels included:
      inductor fuses the code around the ops but not into them;
    * ``inductor``: the Functions are traced, with the reference quantizer's torch ops and the
      separate LayerNorm -> Linear composition, which inductor fuses with their neighbours (the
      approach of torchao's float8 training).

    ``inductor`` is an experiment, measured slower: on an H100 (``bash bench/device_h100.sh
    $OUT quant_ab``) LoKA safe's compiled, CUDA-graphed Wukong step took 13.75 ms with
    ``inductor`` against 10.22 ms with ``custom``. Its backward had two fp32 SIMT GEMMs per step
    (2.6 ms each) that ``custom`` does not have; which GEMMs they replace is not identified. Its
    eval NE was 8% worse than bf16's in the same run
    (bench/results/e2e_torchao_ne_floor_h100_2026-11-24/NOTES.md)."""

    triton_autotune: bool = True
    """The Triton FP8 GEMM tunes its tile config for each new problem (~9 compiles and timings
    per shape). False launches every GEMM with one fixed config: for correctness tests on a
    GPU, which need the right answer, not the fastest config."""

    def __post_init__(self) -> None:
        if self.compiled_quantizer not in COMPILED_QUANTIZERS:
            raise ValueError(
                f"compiled_quantizer={self.compiled_quantizer!r}: choose one of {COMPILED_QUANTIZERS}"
            )
        if not isinstance(self.triton_autotune, bool):
            raise ValueError(f"triton_autotune must be a bool, got {self.triton_autotune!r}")

    def with_env_overrides(self, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """These settings with ``LOKA_COMPILED_QUANTIZER`` / ``LOKA_TRITON_AUTOTUNE`` applied
        where set (each override that changes a setting is logged).

        Args:
            environ: where to read the variables; default ``os.environ``.

        Raises:
            ValueError: if ``LOKA_COMPILED_QUANTIZER`` names no compiled quantizer.
        """
        env = os.environ if environ is None else environ
        changes: dict[str, object] = {}
        mode = env.get(ENV_COMPILED_QUANTIZER)
        if mode is not None:
            if mode not in COMPILED_QUANTIZERS:
                raise ValueError(
                    f"{ENV_COMPILED_QUANTIZER}={mode!r}: set it to one of {COMPILED_QUANTIZERS}"
                )
            changes["compiled_quantizer"] = mode
        autotune = env.get(ENV_TRITON_AUTOTUNE)
        if autotune is not None:
            changes["triton_autotune"] = autotune != "0"
        for name, value in changes.items():
            if getattr(self, name) != value:
                logger.info("kernels: the environment sets %s=%r (configured %r)", name, value, getattr(self, name))
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
