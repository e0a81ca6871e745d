"""loka_train.kernels: FP8 formats, quantizers, GEMM backends, planned FP8 linear layers.

Modules:
    formats: FP8 formats, scaling granularities, reference quantize/dequantize, SQNR and
        saturation/underflow statistics.
    plan: per-GEMM numerics plans (``GemmPlan``, ``LinearPlan``).
    roles: the three GEMMs of a linear layer (``Role``, ``ROLES``).
    gemm: the GEMM contract (``GemmProblem``, the ``Backend`` protocol).
    capability: ``fp8_available``.
    registry: the GEMM backend registry.
    backends: built-in backends (emulated, bf16, torch_scaled_mm, fbgemm_rowwise, triton).
    linear: ``fp8_linear``, an autograd function whose three GEMMs follow a ``LinearPlan``.
    fused: ``layernorm_linear``, LayerNorm -> Linear -> activation with fused quantization.
    settings: ``KernelSettings`` (compiled quantizer, Triton autotune) and their environment
        overrides.
    opaque: the FP8 autograd Functions as opaque custom ops for compiled code.
    triton_kernels: the fused row-wise quantizer and the helpers all Triton kernels share;
        triton_gemm: the FP8 GEMM with a fused epilogue; triton_block: the transposing
        quantizer; triton_layernorm: LayerNorm's backward (all imported lazily: need triton).

Importing this package touches no hardware and does not import triton.

Example:
    >>> import torch
    >>> from loka_train.kernels import LinearPlan, fp8_linear
    >>> y = fp8_linear(torch.randn(8, 32), torch.randn(16, 32), None, LinearPlan.fp8())
"""

from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import (
    Fp8Format,
    QTensor,
    Scaling,
    dequantize,
    quantize,
    saturation_fraction,
    sqnr_db,
    underflow_fraction,
)
from loka_train.kernels.gemm import Backend, GemmProblem
from loka_train.kernels.linear import fp8_linear
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.kernels.registry import available_backends, get_backend, register_backend

__all__ = [
    "Fp8Format",
    "QTensor",
    "Scaling",
    "dequantize",
    "quantize",
    "saturation_fraction",
    "sqnr_db",
    "underflow_fraction",
    "fp8_linear",
    "GemmPlan",
    "LinearPlan",
    "Precision",
    "Backend",
    "GemmProblem",
    "available_backends",
    "fp8_available",
    "get_backend",
    "register_backend",
]
