"""Configuration of :func:`loka_train.export.serve`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ServeConfig"]

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""Values of :attr:`ServeConfig.dtype`."""


@dataclass(kw_only=True)
class ServeConfig:
    """How :func:`~loka_train.export.serve` prepares a trained model for inference.

    Example:
        >>> ServeConfig(dtype="bf16").torch_dtype
        torch.bfloat16
    """

    dtype: str = "bf16"
    """Compute dtype the served model runs its dense GEMMs in ("bf16": bf16 inputs or bf16
    autocast, as the DLRM family trains; "fp32"). An FP8 weight is quantized once from the
    weight rounded to it, as the training forward quantizes it at every step; a call in
    another compute dtype raises (it would take other codes)."""

    quantize_weights_once: bool = True
    """Quantize each FP8 ``Fp8Linear`` weight once, when the model is served, and only the
    input at every call. False keeps the training forward's per-call weight quantization
    (what serving would cost without it, for comparisons)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"serve dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        return DTYPES[self.dtype]
