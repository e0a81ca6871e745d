"""Built-in FP8 GEMM backends (see ``gemm.py`` for the contract, ``registry.py`` for the names).

Every backend computes ``a @ b^T (+ bias)`` for ``a_q`` (M, K) and ``b_q`` (N, K), both
quantized along K (``QTensor.axis == 1``), and says in ``supports()`` why it cannot run a
problem. ``emulated`` is the numerical oracle for all others.

Shape legend: ``M`` rows of ``a``, ``K`` contraction, ``N`` rows of ``b`` / output columns.

Example:
    >>> from loka_train.kernels.formats import quantize
    >>> a_q = quantize(torch.randn(8, 32), "e4m3", "rowwise")
    >>> b_q = quantize(torch.randn(4, 32), "e4m3", "rowwise")
    >>> EmulatedBackend()(a_q, b_q, out_dtype=torch.float32).shape
    torch.Size([8, 4])
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from packaging import version
from torch import Tensor

from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import DEFAULT_BLOCK_SIZE, Fp8Format, QTensor, Scaling, dequantize
from loka_train.kernels.gemm import Backend, GemmProblem
from loka_train.kernels.settings import KernelSettings

logger = logging.getLogger(__name__)

__all__ = [
    "EmulatedBackend",
    "Bf16Backend",
    "TorchScaledMMBackend",
    "FbgemmRowwiseBackend",
    "TritonBackend",
    "builtin_backends",
]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_operands(a_q: QTensor, b_q: QTensor) -> None:
    if a_q.data.ndim != 2 or b_q.data.ndim != 2:
        raise ValueError(f"operands must be 2-D, got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"contraction mismatch: a {tuple(a_q.shape)} vs b {tuple(b_q.shape)}")
    for name, q in (("a", a_q), ("b", b_q)):
        if q.axis != 1 and q.scaling is not Scaling.TENSORWISE:
            raise ValueError(f"operand {name} must be quantized along K (axis=1), got axis={q.axis}")


def _add_bias(out_f32: Tensor, bias: Tensor | None) -> Tensor:
    return out_f32 if bias is None else out_f32 + bias.float()


class EmulatedBackend:
    """Dequantize both operands and multiply in fp32: runs anywhere, the numerical oracle.

    Uses whatever fp32 matmul precision the process allows (TF32 only if the user enabled it).
    """

    name = "emulated"

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        return True, ""

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        _check_operands(a_q, b_q)
        out = dequantize(a_q) @ dequantize(b_q).t()
        return _add_bias(out, bias).to(out_dtype)


class Bf16Backend:
    """The high-precision baseline: dequantize to bf16 and run a bf16 GEMM (fp32 accumulate).

    On CPU bf16 matmul is slow (no AVX-512 BF16 here) but correct.
    """

    name = "bf16"

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        return True, ""

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        _check_operands(a_q, b_q)
        a = dequantize(a_q, torch.bfloat16)
        b = dequantize(b_q, torch.bfloat16)
        return F.linear(a, b, None if bias is None else bias.to(torch.bfloat16)).to(out_dtype)

    @staticmethod
    def matmul(a_MK: Tensor, b_NK: Tensor, bias_N: Tensor | None = None) -> Tensor:
        """High-precision ``a @ b^T + bias`` in the inputs' dtype (what HIGH plans run)."""
        return F.linear(a_MK, b_NK, bias_N)


def _torch_at_least(v: str) -> bool:
    return version.parse(torch.__version__.split("+")[0]) >= version.parse(v)


class TorchScaledMMBackend:
    """``torch._scaled_mm``: cuBLASLt (tensorwise), CUTLASS/cuBLASLt (row-wise), and on Hopper
    the DeepSeek block recipe (a 1x128, b 128x128 or 1x128; cuBLASLt >= 12.9).

    On CPU it runs tensorwise and row-wise for every FP8 format (a slow reference path).
    """

    name = "torch_scaled_mm"

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        if problem.out_dtype not in _OUT_DTYPES:
            return False, f"out_dtype {problem.out_dtype} not in {_OUT_DTYPES}"
        if problem.scaling is Scaling.MX:
            return False, "MX (1x32 e8m0) _scaled_mm needs sm_100 (Blackwell)"
        if problem.device_type == "cpu":
            if problem.scaling is Scaling.BLOCK:
                return False, "block-wise scaling is not implemented by _scaled_mm on CPU"
            return True, ""
        if problem.device_type != "cuda":
            return False, f"device {problem.device_type!r} is not supported"
        ok, why = fp8_available("cuda")
        if not ok:
            return False, why
        fmts = {problem.fmt, problem.operand_b_fmt}
        if Fp8Format.E4M3FNUZ in fmts:
            return False, "e4m3fnuz is an AMD format; CUDA uses e4m3fn"
        if problem.fmt is Fp8Format.E5M2 and problem.operand_b_fmt is Fp8Format.E5M2:
            return False, "cuBLASLt has no e5m2 x e5m2 GEMM (use e5m2 x e4m3)"
        if problem.k % 16 or problem.n % 16:
            return False, f"_scaled_mm on CUDA needs K and N divisible by 16 (K={problem.k}, N={problem.n})"
        if problem.scaling is Scaling.BLOCK:
            if torch.cuda.get_device_capability()[0] != 9:
                return False, "DeepSeek-style block _scaled_mm is Hopper-only"
            if not _torch_at_least("2.9"):
                return False, f"block-wise _scaled_mm needs torch >= 2.9, have {torch.__version__}"
            if problem.out_dtype is not torch.bfloat16:
                return False, "block-wise _scaled_mm outputs bf16 only"
            if problem.fast_accum:
                return False, "cuBLASLt has no fast-accumulation mode for block-scaled FP8"
            if problem.k % 512 or problem.m % 4:
                # 128x128 weight tiles with K/128 not a multiple of 4 (K = 256) gave wrong
                # results on an H100 (torch 2.11, CUDA 13.0): the scale rows are then not
                # 16-byte aligned, and torch's stride checks forbid padding them.
                return False, (
                    f"block-wise _scaled_mm needs K % 512 == 0 and M % 4 == 0 here "
                    f"(M={problem.m}, K={problem.k}): unaligned scale rows read wrong scales"
                )
        return True, ""

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        _check_operands(a_q, b_q)
        a = a_q.data.contiguous()
        b = b_q.data.contiguous()
        m, n = a.shape[0], b.shape[0]
        if a_q.scaling is Scaling.TENSORWISE:
            sa, sb = a_q.scale.float().reshape(()), b_q.scale.float().reshape(())
        elif a_q.scaling is Scaling.ROWWISE:
            sa = a_q.scale.float().reshape(m, 1).contiguous()
            sb = b_q.scale.float().reshape(1, n).contiguous()
        elif a_q.scaling is Scaling.BLOCK:
            if a_q.block_2d or a_q.block_size != DEFAULT_BLOCK_SIZE or b_q.block_size != DEFAULT_BLOCK_SIZE:
                raise ValueError("block _scaled_mm needs a in 1x128 groups and b in 1x128 or 128x128")
            # a: (M, K/128) outer-dim-major; b: 128x128 tiles (N/128, K/128) viewed transposed,
            # or 1x128 groups (N, K/128) as a contiguous (K/128, N).
            sa = a_q.scale.float().t().contiguous().t()
            sb = b_q.scale.float().t() if b_q.block_2d else b_q.scale.float().t().contiguous()
        else:
            raise ValueError(f"torch._scaled_mm does not take {a_q.scaling.value} scales")
        fuse_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
        out = torch._scaled_mm(
            a,
            b.t(),
            sa,
            sb,
            bias=bias.to(out_dtype) if fuse_bias and bias is not None else None,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        if bias is not None and not fuse_bias:
            out = (out.float() + bias.float()).to(out_dtype)
        return out


@functools.cache
def _fbgemm_genai_ops() -> tuple[bool, str]:
    """Import FBGEMM GenAI once (CUDA only) and check for the FP8 row-wise ops."""
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return False, "fbgemm_gpu is not installed"
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm.*)
    except Exception as e:  # an ImportError or a missing-symbol OSError from the .so
        return False, f"fbgemm_gpu.experimental.gen_ai does not import: {type(e).__name__}: {e}"
    missing = [
        op
        for op in ("quantize_fp8_per_row", "f8f8bf16_rowwise")
        if not hasattr(torch.ops.fbgemm, op)
    ]
    if missing:
        return False, f"fbgemm GenAI lacks {missing}"
    return True, ""


class FbgemmRowwiseBackend:
    """FBGEMM GenAI ``f8f8bf16_rowwise`` (CUTLASS, e4m3, per-row scales, bf16 output).

    FBGEMM's block-wise GEMM (``f8f8bf16_blockwise``) wants 128x128 activation blocks, not the
    1x128 groups this package uses for activations, so it is not wired up.
    """

    name = "fbgemm_rowwise"

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        if problem.device_type != "cuda":
            return False, "FBGEMM GenAI FP8 GEMMs run on CUDA only"
        ok, why = fp8_available("cuda")
        if not ok:
            return False, why
        if problem.scaling is not Scaling.ROWWISE:
            return False, f"f8f8bf16_rowwise takes row-wise scales, not {problem.scaling.value}"
        if problem.fmt is not Fp8Format.E4M3 or problem.operand_b_fmt is not Fp8Format.E4M3:
            return False, "f8f8bf16_rowwise takes e4m3 x e4m3 only"
        if problem.k % 16 or problem.n % 16:
            # CUTLASS's TMA loads need 16-byte aligned rows ("cutlass cannot implement").
            return False, f"f8f8bf16_rowwise needs K and N divisible by 16 (K={problem.k}, N={problem.n})"
        if problem.out_dtype not in _OUT_DTYPES:
            return False, f"out_dtype {problem.out_dtype} not in {_OUT_DTYPES}"
        return _fbgemm_genai_ops()

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        _check_operands(a_q, b_q)
        m, n = a_q.shape[0], b_q.shape[0]
        out = torch.ops.fbgemm.f8f8bf16_rowwise(
            a_q.data.contiguous(),
            b_q.data.contiguous(),
            a_q.scale.float().reshape(m).contiguous(),
            b_q.scale.float().reshape(n).contiguous(),
            use_fast_accum=fast_accum,
        )
        if bias is not None:
            out = (out.float() + bias.float()).to(out_dtype)
        return out.to(out_dtype)


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
"""Whether triton is importable; looked up once (no import, no hardware) when this module loads."""


class TritonBackend:
    """Our Triton FP8 GEMM (``loka::fp8_gemm``): row-wise or tensorwise scales, fused epilogue.

    Args:
        autotune: tune the tile config for each new problem on a GPU; False launches one fixed
            config (``settings.KernelSettings.triton_autotune``).
    """

    name = "triton"

    def __init__(self, *, autotune: bool = True) -> None:
        self.autotune = autotune

    def supports(self, problem: GemmProblem) -> tuple[bool, str]:
        if not TRITON_INSTALLED:
            return False, "triton is not installed"
        if problem.scaling not in (Scaling.ROWWISE, Scaling.TENSORWISE):
            return False, f"the Triton GEMM takes row-wise/tensorwise scales, not {problem.scaling.value}"
        for f in (problem.fmt, problem.operand_b_fmt):
            if f not in (Fp8Format.E4M3, Fp8Format.E5M2):
                return False, f"the Triton GEMM takes e4m3/e5m2, not {f.value}"
        if problem.out_dtype not in _OUT_DTYPES:
            return False, f"out_dtype {problem.out_dtype} not in {_OUT_DTYPES}"
        from loka_train.kernels.triton_kernels import triton_runnable

        return triton_runnable(problem.device_type)

    def __call__(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        fast_accum: bool = False,
    ) -> Tensor:
        return self.fused(a_q, b_q, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)[0]

    def fused(
        self,
        a_q: QTensor,
        b_q: QTensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        activation: str = "none",
        fast_accum: bool = False,
        return_preact: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """The GEMM with its activation epilogue; returns ``(out, preact)`` (see ``fp8_gemm``)."""
        from loka_train.kernels.triton_gemm import fp8_gemm

        _check_operands(a_q, b_q)
        return fp8_gemm(
            a_q.data,
            b_q.data,
            a_q.scale,
            b_q.scale,
            bias_N=bias,
            activation=activation,
            out_dtype=out_dtype,
            fast_accum=fast_accum,
            return_preact=return_preact,
            autotune=self.autotune,
        )


def builtin_backends(settings: KernelSettings | None = None) -> list[Backend]:
    """Fresh instances of the built-in backends.

    Args:
        settings: what they take from the run's kernel settings (``triton_autotune``);
            default :class:`KernelSettings`'s defaults.
    """
    settings = KernelSettings() if settings is None else settings
    return [
        EmulatedBackend(),
        Bf16Backend(),
        TorchScaledMMBackend(),
        FbgemmRowwiseBackend(),
        TritonBackend(autotune=settings.triton_autotune),
    ]
