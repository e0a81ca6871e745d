"""Wire formats: how a precision turns an fp32 tensor into a payload and back.

Two payload kinds:

* bytes (uint8): every precision, for collectives that only move data (all-to-all,
  all-gather). The wire dtype never changes when the precision does.
* native (fp32 / fp16 / bf16 tensor): for collectives that sum the payload
  (reduce-scatter, all-reduce); only the unscaled float formats qualify.

Row-wise layouts (one row per `row_dim` consecutive values, `A = row_dim` rounded up to 4):

* FP8 (reference): ``[A bytes of fp8 | fp32 inverse scale]`` (A + 4 bytes per row);
  value = fp8 / inverse_scale, inverse_scale = fmt_max / amax(row) (1 for an all-zero row;
  FBGEMM adds 1e-20 to amax instead, which flushes rows below about 1e-20 to zero).
* FP8 (FBGEMM ops, CUDA): FBGEMM's ``FloatToFP8RowwiseQuantized`` layout (A + 8 bytes).
  Only an explicit ``CodecImpl.FBGEMM`` uses it; every rank must then use it.
* INT8: ``[A bytes of uint8 | fp32 scale | fp32 offset]`` (A + 8 bytes, FBGEMM's
  fused 8-bit row-wise scheme); value = q * scale + offset.

Implementations (`CodecImpl`, chosen per tensor device when AUTO): REFERENCE (the pure-PyTorch
code below, the oracle), TRITON (`comm.triton_codec`: one fused kernel per FP8 encode, FP8
decode and 16-bit encode, bit-identical to REFERENCE on the same device), FBGEMM (FBGEMM's
row-wise ops for FP8/INT8). AUTO takes TRITON for CUDA tensors where the Triton codec runs and
REFERENCE otherwise, logged once per device.

Shape legend: N values (flattened), R rows, C values per row (row_dim), A aligned row bytes,
P payload bytes per row.

Example:
    >>> fmt = WireFormat(precision=CommPrecision.FP8, row_dim=32, fp8_format=Fp8Format.E4M3)
    >>> payload_P = fmt.encode_bytes(torch.randn(4, 64))
    >>> x_N = fmt.decode_bytes(payload_P)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from loka_train.comm.config import CodecImpl, CommPrecision
from loka_train.kernels.formats import Fp8Format

logger = logging.getLogger(__name__)

_NATIVE_DTYPES = {
    CommPrecision.FP32: torch.float32,
    CommPrecision.FP16: torch.float16,
    CommPrecision.BF16: torch.bfloat16,
}
_FP32_MAX = torch.finfo(torch.float32).max
# Precisions whose encoding TRITON runs as Triton kernels (None: any, at config time).
_TRITON_PRECISIONS = (None, CommPrecision.FP8, CommPrecision.BF16, CommPrecision.FP16)
# INT8: FBGEMM's Fused8BitRowwise epsilon on the range.
_RANGE_EPS = 1e-8


def _aligned(num_bytes: int) -> int:
    return (num_bytes + 3) // 4 * 4


def native_dtype(precision: CommPrecision) -> torch.dtype:
    """The tensor dtype of `precision` as a summable (native) payload; ValueError for FP8/INT8."""
    if precision not in _NATIVE_DTYPES:
        raise ValueError(
            f"{precision.name} has no native (summable) payload: it is row-wise scaled"
        )
    return _NATIVE_DTYPES[precision]


def _triton_codec() -> ModuleType:
    # Imported on first use: it imports triton and registers the loka::comm_* ops.
    from loka_train.comm import triton_codec

    return triton_codec


def _triton_codec_runnable(device: torch.device, row_dim: int) -> tuple[bool, str]:
    try:
        codec = _triton_codec()
    except ImportError as err:
        return False, f"triton does not import ({err})"
    ok, why = codec.codec_runnable(device, row_dim)
    return bool(ok), str(why)


def check_codec_impl(
    impl: CodecImpl,
    device: torch.device | str,
    row_dim: int,
    precision: CommPrecision | None = None,
) -> None:
    """Raise ValueError, naming the fix, if an explicit `impl` cannot run on `device`.

    AUTO and REFERENCE run everywhere. `precision` None checks every precision (a channel's
    precision may change during the run); a given one checks only the kernels it uses (FBGEMM's
    INT8 ops have CPU kernels, its FP8 ops do not; TRITON encodes FP8, BF16 and FP16).

    Example:
        >>> check_codec_impl(CodecImpl.FBGEMM, "cpu", 32)
        Traceback (most recent call last):
        ValueError: comm.codec_impl=FBGEMM needs a CUDA device ...
    """
    device = torch.device(device)
    fbgemm_fp8 = precision in (None, CommPrecision.FP8)
    if impl is CodecImpl.FBGEMM and fbgemm_fp8 and device.type != "cuda":
        raise ValueError(
            "comm.codec_impl=FBGEMM needs a CUDA device (FBGEMM's FP8 row-wise ops have no CPU "
            f"kernel); got device={device}. Set comm.codec_impl=AUTO or REFERENCE."
        )
    if impl is CodecImpl.TRITON and precision in _TRITON_PRECISIONS:
        ok, why = _triton_codec_runnable(device, row_dim)
        if not ok:
            raise ValueError(
                f"comm.codec_impl=TRITON cannot run on {device}: {why}. Set comm.codec_impl=AUTO "
                "(Triton where it runs, else the PyTorch reference) or REFERENCE."
            )


@functools.cache
def _auto_impl(device: torch.device, row_dim: int) -> CodecImpl:
    if device.type != "cuda":
        return CodecImpl.REFERENCE
    ok, why = _triton_codec_runnable(device, row_dim)
    if ok:
        logger.info("comm codec on %s, row_dim=%d: fused Triton kernels", device, row_dim)
        return CodecImpl.TRITON
    logger.info("comm codec on %s, row_dim=%d: the PyTorch reference (%s)", device, row_dim, why)
    return CodecImpl.REFERENCE


@functools.cache
def _checked_impl(
    impl: CodecImpl, device: torch.device, row_dim: int, precision: CommPrecision | None
) -> CodecImpl:
    check_codec_impl(impl, device, row_dim, precision)
    return impl


def resolve_codec_impl(
    impl: CodecImpl,
    device: torch.device | str,
    row_dim: int,
    precision: CommPrecision | None = None,
) -> CodecImpl:
    """The implementation that encodes tensors on `device`: AUTO resolved by capability (TRITON
    on CUDA where the Triton codec runs, else REFERENCE; checked once per device and logged);
    an explicit choice that cannot run there raises ValueError (`check_codec_impl`).

    Example:
        >>> resolve_codec_impl(CodecImpl.AUTO, "cpu", 32)
        <CodecImpl.REFERENCE: 'reference'>
    """
    device = torch.device(device)
    if impl is CodecImpl.AUTO:
        return _auto_impl(device, row_dim)
    return _checked_impl(impl, device, row_dim, precision)


def _clamped_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Saturate instead of overflowing to inf, like FBGEMM's fp32_to_{fp16,bf16}_with_clamp.
    if dtype == torch.float32:
        return x.float()
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)


@dataclass(frozen=True)
class WireFormat:
    """Encoder/decoder of one precision, with the kernels `impl` selects.

    Example:
        >>> WireFormat(precision=CommPrecision.INT8, row_dim=32).encoded_bytes(64)
        80
    """

    precision: CommPrecision
    """What the payload carries."""

    row_dim: int = 32
    """Values per row (row-wise formats only)."""

    fp8_format: Fp8Format = Fp8Format.E4M3
    """FP8 element format (FP8 only)."""

    impl: CodecImpl = CodecImpl.AUTO
    """Kernels that encode and decode (see `CodecImpl`); AUTO is resolved per tensor device."""

    def impl_for(self, device: torch.device | str) -> CodecImpl:
        """The implementation used for tensors on `device` (raises if an explicit one cannot
        run there)."""
        return resolve_codec_impl(self.impl, device, self.row_dim, self.precision)

    @property
    def row_payload_bytes(self) -> int:
        """Bytes per row of a row-wise payload."""
        aligned = _aligned(self.row_dim)
        if self.precision is CommPrecision.FP8:
            return aligned + (8 if self.impl is CodecImpl.FBGEMM else 4)
        if self.precision is CommPrecision.INT8:
            return aligned + 8
        raise ValueError(f"{self.precision.name} is not row-wise")

    def _num_rows(self, numel: int) -> int:
        if numel % self.row_dim != 0:
            raise ValueError(
                f"{self.precision.name} row-wise payload: {numel} values are not a multiple of "
                f"comm.row_dim={self.row_dim}. Choose a row_dim that divides every embedding "
                "dim (each per-rank slice of the collective is batch x dim values)."
            )
        return numel // self.row_dim

    def encoded_bytes(self, numel: int) -> int:
        """Bytes of the bytes-payload for `numel` values."""
        if self.precision.is_rowwise:
            return self._num_rows(numel) * self.row_payload_bytes
        return numel * torch.finfo(_NATIVE_DTYPES[self.precision]).bits // 8

    # ---------------------------------------------------------------- bytes payload
    def encode_bytes(self, x: torch.Tensor) -> torch.Tensor:
        """Encode `x` (any shape, any float dtype) into a flat uint8 payload."""
        x_N = x.reshape(-1).contiguous()
        if self.precision is CommPrecision.FP8:
            payload_RP = self._encode_fp8(x_N)
        elif self.precision is CommPrecision.INT8:
            payload_RP = self._encode_int8(x_N)
        else:
            return self._cast(x_N, _NATIVE_DTYPES[self.precision]).view(torch.uint8)
        return payload_RP.reshape(-1)

    def decode_bytes(self, payload: torch.Tensor) -> torch.Tensor:
        """Decode a flat uint8 payload (or a concatenation of them) into flat fp32 values."""
        if payload.dtype != torch.uint8:
            raise ValueError(f"bytes payload must be uint8, got {payload.dtype}")
        payload = payload.reshape(-1)
        if self.precision is CommPrecision.FP8:
            return self._decode_fp8(payload)
        if self.precision is CommPrecision.INT8:
            return self._decode_int8(payload)
        return payload.view(_NATIVE_DTYPES[self.precision]).float()

    # --------------------------------------------------------------- native payload
    def encode_native(self, x: torch.Tensor) -> torch.Tensor:
        """Encode `x` into a summable tensor of the precision's dtype (same shape)."""
        return self._cast(x, native_dtype(self.precision))

    @staticmethod
    def decode_native(payload: torch.Tensor) -> torch.Tensor:
        """fp32 values of a native payload (its dtype says how it was encoded)."""
        return payload.float()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) as fp32, same shape: what the receiver sees."""
        if self.precision.is_rowwise:
            return self.decode_bytes(self.encode_bytes(x)).view(x.shape)
        return self._cast(x, _NATIVE_DTYPES[self.precision]).float()

    def _cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype != torch.float32 and self.impl_for(x.device) is CodecImpl.TRITON:
            return _triton_codec().clamped_cast(x, dtype)
        return _clamped_cast(x, dtype)

    # ------------------------------------------------------------------ row-wise
    def _rows(self, x_N: torch.Tensor) -> torch.Tensor:
        num_rows = self._num_rows(x_N.numel())
        return x_N.float().reshape(num_rows, self.row_dim)

    def _split_payload(self, payload: torch.Tensor) -> torch.Tensor:
        row_bytes = self.row_payload_bytes
        if payload.numel() % row_bytes != 0:
            raise ValueError(
                f"{self.precision.name} payload of {payload.numel()} bytes is not a whole "
                f"number of {row_bytes}-byte rows: sender and receiver disagree on the format"
            )
        return payload.view(-1, row_bytes)

    def _encode_fp8(self, x_N: torch.Tensor) -> torch.Tensor:
        impl = self.impl_for(x_N.device)
        if impl is CodecImpl.TRITON:
            self._num_rows(x_N.numel())
            return _triton_codec().fp8_encode(x_N, row_dim=self.row_dim, fmt=self.fp8_format)
        x_RC = self._rows(x_N)
        if impl is CodecImpl.FBGEMM:
            return torch.ops.fbgemm.FloatToFP8RowwiseQuantized(
                x_RC.contiguous(), self.fp8_format is Fp8Format.E4M3
            )
        fp8_dtype = self.fp8_format.dtype
        fmt_max = torch.finfo(fp8_dtype).max
        amax_R1 = x_RC.abs().amax(dim=1, keepdim=True)
        # All-zero rows get scale 1; tiny (even subnormal) rows are scaled up, not flushed.
        # `fmt_max / amax_R1` runs as `amax_R1.reciprocal() * fmt_max` (torch's __rtruediv__),
        # two fp32 roundings on every device: the Triton codec computes the same.
        inv_scale_R1 = torch.where(amax_R1 > 0, fmt_max / amax_R1, torch.ones_like(amax_R1)).clamp(
            max=_FP32_MAX
        )
        q_RC = (x_RC * inv_scale_R1).clamp(-fmt_max, fmt_max).to(fp8_dtype)
        num_rows, aligned = x_RC.shape[0], _aligned(self.row_dim)
        payload_RP = torch.zeros(
            num_rows, self.row_payload_bytes, dtype=torch.uint8, device=x_RC.device
        )
        payload_RP[:, : self.row_dim] = q_RC.view(torch.uint8)
        payload_RP[:, aligned : aligned + 4] = inv_scale_R1.view(torch.uint8)
        return payload_RP

    def _decode_fp8(self, payload: torch.Tensor) -> torch.Tensor:
        payload_RP = self._split_payload(payload)
        impl = self.impl_for(payload.device)
        if impl is CodecImpl.TRITON:
            return _triton_codec().fp8_decode(payload, row_dim=self.row_dim, fmt=self.fp8_format)
        if impl is CodecImpl.FBGEMM:
            return torch.ops.fbgemm.FP8RowwiseQuantizedToFloat(
                payload_RP.contiguous(), self.fp8_format is Fp8Format.E4M3, 0
            ).reshape(-1)
        aligned = _aligned(self.row_dim)
        q_RC = payload_RP[:, : self.row_dim].view(self.fp8_format.dtype).float()
        inv_scale_R1 = payload_RP[:, aligned : aligned + 4].contiguous().view(torch.float32)
        return (q_RC / inv_scale_R1).reshape(-1)

    def _encode_int8(self, x_N: torch.Tensor) -> torch.Tensor:
        x_RC = self._rows(x_N)
        if self.impl_for(x_N.device) is CodecImpl.FBGEMM:
            return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x_RC.contiguous())
        min_R1 = x_RC.amin(dim=1, keepdim=True)
        range_R1 = x_RC.amax(dim=1, keepdim=True) - min_R1
        scale_R1 = range_R1 / 255.0
        inv_scale_R1 = 255.0 / (range_R1 + _RANGE_EPS)
        q_RC = ((x_RC - min_R1) * inv_scale_R1).round().clamp(0, 255).to(torch.uint8)
        num_rows, aligned = x_RC.shape[0], _aligned(self.row_dim)
        payload_RP = torch.zeros(
            num_rows, self.row_payload_bytes, dtype=torch.uint8, device=x_RC.device
        )
        payload_RP[:, : self.row_dim] = q_RC
        payload_RP[:, aligned : aligned + 8] = torch.cat([scale_R1, min_R1], dim=1).view(
            torch.uint8
        )
        return payload_RP

    def _decode_int8(self, payload: torch.Tensor) -> torch.Tensor:
        payload_RP = self._split_payload(payload)
        if self.impl_for(payload.device) is CodecImpl.FBGEMM:
            return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(
                payload_RP.contiguous()
            ).reshape(-1)
        aligned = _aligned(self.row_dim)
        q_RC = payload_RP[:, : self.row_dim].float()
        scale_offset_R2 = payload_RP[:, aligned : aligned + 8].contiguous().view(torch.float32)
        return (q_RC * scale_offset_R2[:, :1] + scale_offset_R2[:, 1:]).reshape(-1)
