"""FP8 formats, scaling granularities, and the pure-PyTorch quantizers (the reference).

Every other quantizer in ``loka_train.kernels`` (the fused Triton kernels, FBGEMM's ops) is
tested against :func:`quantize` here, and the ``emulated`` GEMM backend is built on
:func:`dequantize`.

Conventions:

* ``scale`` is the *dequantization* scale, as in ``torch._scaled_mm``: ``x ~= data * scale``,
  ``data = saturate(x / scale)``. Just-in-time scaling picks ``scale = amax / fmt.max`` for each
  scaling group, so the largest value of a group maps onto the largest finite FP8 value.
* ``axis`` is the *contraction* dim of the GEMM that consumes the operand. Row-wise keeps one
  scale per slice along the other dims: activation ``x_MK`` with ``axis=-1`` gets one scale per
  row (``(M, 1)``), weight ``w_NK`` with ``axis=-1`` one per output channel (``(N, 1)``); for the
  grad-weight GEMM ``dW = dY^T X`` the operands ``dY_MN`` and ``x_MK`` are scaled with
  ``axis=0`` (``(1, N)`` and ``(1, K)``).
* Block scaling: 1 x ``block_size`` groups along ``axis`` (default 128, activations) or, with
  ``block_2d=True``, ``block_size x block_size`` tiles of a 2-D tensor (weights). A ragged last
  block is allowed (it is scaled by its own amax).
* MX: groups of 32 along ``axis`` with power-of-two scales (E8M0). The exponent is rounded *up*
  (``2**ceil(log2(amax / fmt.max))``), so no element saturates; the OCP spec's floor rounding
  clips the top of each block and is not used.
* Saturating: magnitudes beyond ``fmt.max`` clamp to ``fmt.max`` (never inf, also for E5M2,
  whose plain cast overflows). All-zero groups get scale 1 (no NaN). A non-finite input makes
  its group's scale NaN, so statistics can see it; nothing raises.

Shape legend: ``M`` rows of an activation, ``K`` the contraction dim, ``N`` output features,
``G`` number of scaling groups along an axis.

Example:
    >>> import torch
    >>> from loka_train.kernels.formats import Fp8Format, Scaling, quantize, dequantize, sqnr_db
    >>> x_MK = torch.randn(64, 256)
    >>> q = quantize(x_MK, Fp8Format.E4M3, Scaling.ROWWISE)
    >>> q.scale.shape
    torch.Size([64, 1])
    >>> bool(sqnr_db(x_MK, dequantize(q)) > 25)
    True
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "MX_BLOCK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "SQNR_CAP_DB",
    "Fp8Format",
    "Scaling",
    "as_format",
    "as_scaling",
    "QTensor",
    "quantize",
    "dequantize",
    "is_row_strided",
    "compute_scale",
    "scale_from_amax",
    "expand_scale",
    "sqnr_db",
    "saturation_fraction",
    "clipped_counts",
    "underflow_fraction",
]

MX_BLOCK_SIZE = 32
"""Elements per MX scaling block (OCP Microscaling spec)."""

DEFAULT_BLOCK_SIZE = 128
"""Default block edge for ``Scaling.BLOCK`` (DeepSeek-V3 style 1x128 / 128x128)."""

SQNR_CAP_DB = 200.0
"""SQNR reported when the approximation is exact (instead of +inf)."""

_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127


class Fp8Format(enum.StrEnum):
    """An 8-bit floating-point element format.

    ``E4M3`` (OCP ``float8_e4m3fn``, max 448) has more precision, ``E5M2`` (max 57344) more
    range; ``E4M3FNUZ`` (max 240) is AMD's MI300 variant, named for completeness.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E4M3FNUZ = "e4m3fnuz"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype that stores this format."""
        return _DTYPES[self]

    @property
    def max(self) -> float:
        """Largest finite value."""
        return float(torch.finfo(self.dtype).max)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value."""
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def mantissa_bits(self) -> int:
        """Number of explicit mantissa bits."""
        return _MANTISSA_BITS[self]

    @property
    def min_subnormal(self) -> float:
        """Smallest positive (subnormal) value."""
        return self.min_normal * 2.0**-self.mantissa_bits


_DTYPES = {
    Fp8Format.E4M3: torch.float8_e4m3fn,
    Fp8Format.E5M2: torch.float8_e5m2,
    Fp8Format.E4M3FNUZ: torch.float8_e4m3fnuz,
}
_MANTISSA_BITS = {Fp8Format.E4M3: 3, Fp8Format.E5M2: 2, Fp8Format.E4M3FNUZ: 3}


class Scaling(enum.StrEnum):
    """Granularity of the scales of a quantized tensor."""

    TENSORWISE = "tensorwise"
    """One scale for the whole tensor."""
    ROWWISE = "rowwise"
    """One scale per slice along ``axis`` (per row of an activation, per output channel)."""
    BLOCK = "block"
    """One scale per 1 x ``block_size`` group along ``axis`` (or 2-D tiles, ``block_2d``)."""
    MX = "mx"
    """One power-of-two (E8M0) scale per 32 elements along ``axis``."""


def as_format(fmt: Fp8Format | str) -> Fp8Format:
    """``fmt`` as an :class:`Fp8Format` member; a member passes through uncalled (calling the
    Enum class in compiled code is a graph break on some torch releases, where dynamo cannot
    wrap ``EnumMeta.__call__``: code that compiled modules run takes this)."""
    return fmt if isinstance(fmt, Fp8Format) else Fp8Format(fmt)


def as_scaling(scaling: Scaling | str) -> Scaling:
    """``scaling`` as a :class:`Scaling` member; a member passes through (see :func:`as_format`)."""
    return scaling if isinstance(scaling, Scaling) else Scaling(scaling)


@dataclass(frozen=True)
class QTensor:
    """A tensor quantized to FP8 with its scales.

    ``dequantize(q) == q.data.float() * expand_scale(q)``.
    """

    data: Tensor
    """FP8 payload, same shape as the input."""
    scale: Tensor
    """fp32 dequantization scales: 0-dim (tensorwise); the input's shape with ``axis`` reduced
    to 1 (rowwise); the input's shape with ``axis`` reduced to the number of blocks (block, MX);
    ``(ceil(R / block_size), ceil(C / block_size))`` for 2-D tiles (``block_2d``)."""
    fmt: Fp8Format
    """Element format of ``data``."""
    scaling: Scaling
    """Granularity of ``scale``."""
    axis: int
    """Contraction axis the scales were computed along (non-negative)."""
    block_size: int | None = None
    """Group length along ``axis`` (tile edge for ``block_2d``); None for tensorwise/rowwise."""
    block_2d: bool = False
    """True when ``scale`` holds ``block_size x block_size`` tiles of a 2-D tensor."""

    @property
    def shape(self) -> torch.Size:
        """Shape of the (de)quantized tensor."""
        return self.data.shape

    def scale_e8m0(self) -> Tensor:
        """The MX scales as ``torch.float8_e8m0fnu`` (exact: they are powers of two).

        Raises:
            ValueError: if this tensor is not MX-scaled.
        """
        if self.scaling is not Scaling.MX:
            raise ValueError(f"scale_e8m0() needs Scaling.MX scales, got {self.scaling.value}")
        return self.scale.to(torch.float8_e8m0fnu)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Shorthand for :func:`dequantize`."""
        return dequantize(self, dtype)


def _normalize_axis(axis: int, ndim: int) -> int:
    if ndim == 0:
        return 0
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-D tensor")
    return axis % ndim


def _resolve_block_size(scaling: Scaling, block_size: int | None, block_2d: bool) -> int | None:
    if block_2d and scaling is not Scaling.BLOCK:
        raise ValueError(f"block_2d=True needs Scaling.BLOCK, got {scaling.value}")
    if scaling is Scaling.BLOCK:
        bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    elif scaling is Scaling.MX:
        if block_size not in (None, MX_BLOCK_SIZE):
            raise ValueError(f"MX scaling uses blocks of {MX_BLOCK_SIZE}, got block_size={block_size}")
        bs = MX_BLOCK_SIZE
    else:
        if block_size is not None:
            raise ValueError(f"block_size is only meaningful for block/MX scaling, not {scaling.value}")
        return None
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {bs}")
    return bs


def _group_amax(x: Tensor, axis: int, bs: int) -> Tensor:
    """amax over groups of ``bs`` consecutive elements along ``axis`` (ragged tail allowed)."""
    xt = x.abs().movedim(axis, -1)
    size = xt.shape[-1]
    num_groups = max(1, math.ceil(size / bs))
    pad = num_groups * bs - size
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    amax = xt.reshape(*xt.shape[:-1], num_groups, bs).amax(dim=-1)
    return amax.movedim(-1, axis)


def _tile_amax(x: Tensor, bs: int) -> Tensor:
    """amax over ``bs x bs`` tiles of a 2-D tensor."""
    rows, cols = x.shape
    gr, gc = max(1, math.ceil(rows / bs)), max(1, math.ceil(cols / bs))
    xp = torch.nn.functional.pad(x.abs(), (0, gc * bs - cols, 0, gr * bs - rows))
    return xp.reshape(gr, bs, gc, bs).amax(dim=(1, 3))


def _amax_to_scale(amax: Tensor, fmt: Fp8Format, power_of_two: bool) -> Tensor:
    """Dequantization scale from a group amax: zero -> 1, non-finite -> NaN."""
    amax = amax.float()
    nan = float("nan")
    if power_of_two:
        # ceil so that amax / scale <= fmt.max: no element saturates. The exponent clamp maps
        # an inf amax to a finite scale, hence the explicit non-finite test.
        exp = torch.ceil(torch.log2(amax / fmt.max)).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
        scale = torch.where(torch.isfinite(amax), torch.exp2(exp), nan)
        return torch.where(amax == 0, 1.0, scale)
    # clamp_min keeps tiny-but-non-zero groups finite after x / scale; NaN and inf pass it.
    # Python scalars, not ones_like / full_like, and nan_to_num for "inf -> NaN" instead of
    # isfinite + where: each a kernel launch fewer per quantization on the hot path.
    scale = torch.where(amax == 0, 1.0, (amax / fmt.max).clamp_min(torch.finfo(torch.float32).tiny))
    return torch.nan_to_num(scale, nan=nan, posinf=nan, neginf=nan)


def scale_from_amax(amax: Tensor, fmt: Fp8Format) -> Tensor:
    """The just-in-time dequantization scale of groups whose max |value| is `amax`, as
    :func:`compute_scale` derives it for tensor-wise, row-wise and block scaling (for a caller
    that has the amax already).

    Example:
        >>> float(scale_from_amax(torch.tensor(896.0), Fp8Format.E4M3))
        2.0
    """
    return _amax_to_scale(amax, Fp8Format(fmt), power_of_two=False)


def compute_scale(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    *,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
) -> Tensor:
    """The just-in-time dequantization scales :func:`quantize` would use (see QTensor.scale)."""
    scaling = Scaling(scaling)
    fmt = Fp8Format(fmt)
    ax = _normalize_axis(axis, x.ndim)
    bs = _resolve_block_size(scaling, block_size, block_2d)
    # max |x| as one reduction (the inf-norm; NaN and inf propagate like abs().amax()),
    # without a full-size |x| temporary: a launch and a pass over x fewer on the hot path.
    if scaling is Scaling.TENSORWISE or x.ndim == 0:
        amax = torch.linalg.vector_norm(x, ord=math.inf) if x.numel() else x.new_zeros(())
        return _amax_to_scale(amax.reshape(()), fmt, power_of_two=False)
    if scaling is Scaling.ROWWISE:
        if x.shape[ax] == 0:
            return torch.ones(*x.shape[:ax], 1, *x.shape[ax + 1 :], device=x.device)
        amax = torch.linalg.vector_norm(x, ord=math.inf, dim=ax, keepdim=True)
        return _amax_to_scale(amax, fmt, power_of_two=False)
    assert bs is not None
    if block_2d:
        if x.ndim != 2:
            raise ValueError(f"block_2d tiles need a 2-D tensor, got shape {tuple(x.shape)}")
        return _amax_to_scale(_tile_amax(x, bs), fmt, power_of_two=False)
    return _amax_to_scale(_group_amax(x, ax, bs), fmt, power_of_two=scaling is Scaling.MX)


def expand_scale(
    scale: Tensor,
    shape: torch.Size | tuple[int, ...],
    scaling: Scaling,
    *,
    axis: int,
    block_size: int | None,
    block_2d: bool = False,
) -> Tensor:
    """Broadcast ``scale`` (in its compact layout) to a tensor of ``shape``."""
    scaling = Scaling(scaling)
    if scaling in (Scaling.TENSORWISE, Scaling.ROWWISE) or len(shape) == 0:
        return scale
    assert block_size is not None
    if block_2d:
        rows, cols = shape
        return (
            scale.repeat_interleave(block_size, dim=0)[:rows]
            .repeat_interleave(block_size, dim=1)[:, :cols]
        )
    ax = _normalize_axis(axis, len(shape))
    return scale.repeat_interleave(block_size, dim=ax).narrow(ax, 0, shape[ax])


def quantize(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    *,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
) -> QTensor:
    """Quantize ``x`` to FP8 with just-in-time (amax) scaling. Pure PyTorch; the reference.

    Args:
        x: floating-point tensor of any shape (computed in fp32).
        fmt: FP8 element format.
        scaling: scale granularity.
        axis: contraction axis of the consuming GEMM (see the module docstring).
        block_size: group length for ``Scaling.BLOCK`` (default 128); must be None or 32
            for ``Scaling.MX``; must be None otherwise.
        block_2d: for ``Scaling.BLOCK`` on a 2-D tensor, use ``block_size x block_size``
            tiles (weights) instead of 1 x ``block_size`` groups along ``axis``.

    Returns:
        A :class:`QTensor`; values beyond the range saturate at ``fmt.max``.

    Example:
        >>> q = quantize(torch.randn(8, 256), Fp8Format.E4M3, Scaling.BLOCK)
        >>> tuple(q.scale.shape)
        (8, 2)
    """
    fmt = Fp8Format(fmt)
    scaling = Scaling(scaling)
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a floating-point tensor, got {x.dtype}")
    ax = _normalize_axis(axis, x.ndim)
    bs = _resolve_block_size(scaling, block_size, block_2d)
    scale = compute_scale(x, fmt, scaling, axis=ax, block_size=bs, block_2d=block_2d)
    full = expand_scale(scale, x.shape, scaling, axis=ax, block_size=bs, block_2d=block_2d)
    if full.ndim == 0 and x.ndim:
        full = full.reshape((1,) * x.ndim)  # a 0-dim fp32 divisor would not promote x to fp32
    # fp32 division by type promotion (x is cast inside the kernel: no fp32 copy of x). No
    # clamp: every scale comes from its own group's amax (>= amax / max, power-of-two scales
    # round up), so |x / scale| <= max up to one fp32 rounding, far below the value at which
    # the cast overflows (e4m3fn 480, e5m2 61440: it rounds to max); NaN/inf groups have a NaN
    # scale. Saturation is thus exact, and a full-tensor pass and a launch cheaper
    # (test_quantize_is_bit_identical_to_the_plain_formula).
    data = torch.div(x, full).to(fmt.dtype)
    return QTensor(
        data=data, scale=scale, fmt=fmt, scaling=scaling, axis=ax, block_size=bs, block_2d=block_2d
    )


def is_row_strided(t: Tensor) -> bool:
    """Whether ``t`` is 2-D with contiguous rows that lie apart (``stride == (s, 1)``, ``s`` more
    than its columns): a slice of a wider tensor's columns, such as a concatenation's gradient,
    which the two-layout tensor-wise casts read as it is."""
    return t.ndim == 2 and t.stride(1) == 1 and t.stride(0) > t.shape[1] and t.shape[0] > 1


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Reconstruct ``data * scale`` in ``dtype`` (multiplication done in fp32)."""
    full = expand_scale(
        q.scale, q.data.shape, q.scaling, axis=q.axis, block_size=q.block_size, block_2d=q.block_2d
    )
    return (q.data.float() * full).to(dtype)


def sqnr_db(ref: Tensor, approx: Tensor) -> Tensor:
    """Signal-to-quantization-noise ratio ``20*log10(|ref| / |ref - approx|)`` in dB.

    Returns a 0-dim fp32 tensor on ``ref``'s device (no host sync). An exact match gives
    ``SQNR_CAP_DB``; NaN in either input gives NaN.

    Example:
        >>> x = torch.randn(100)
        >>> float(sqnr_db(x, x))
        200.0
    """
    ref32 = ref.detach().float()
    noise = torch.linalg.vector_norm(ref32 - approx.detach().float())
    signal = torch.linalg.vector_norm(ref32)
    db = 20.0 * (torch.log10(signal) - torch.log10(noise))
    cap = torch.full_like(db, SQNR_CAP_DB)
    db = torch.where(noise == 0, cap, torch.minimum(db, cap))
    return db


def _scaled_magnitude(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    axis: int,
    block_size: int | None,
    block_2d: bool,
    scale: Tensor | None,
) -> tuple[Tensor, Tensor]:
    fmt = Fp8Format(fmt)
    scaling = Scaling(scaling)
    ax = _normalize_axis(axis, x.ndim)
    bs = _resolve_block_size(scaling, block_size, block_2d)
    if scale is None:
        scale = compute_scale(x, fmt, scaling, axis=ax, block_size=bs, block_2d=block_2d)
    full = expand_scale(scale.float(), x.shape, scaling, axis=ax, block_size=bs, block_2d=block_2d)
    all_finite = torch.isfinite(scale).all()
    return (x.float() / full).abs(), all_finite


def _nan_unless(flag: Tensor, value: Tensor) -> Tensor:
    return torch.where(flag, value, torch.full_like(value, float("nan")))


def saturation_fraction(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    *,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
    scale: Tensor | None = None,
) -> Tensor:
    """Fraction of the values of ``x`` that would clip at ``fmt.max`` (0-dim fp32, no sync).

    With the default just-in-time amax scales this is zero up to fp32 rounding (which is why a
    relative tolerance of 1e-6 is allowed); pass ``scale`` (e.g. a delayed or calibrated scale,
    in the compact layout of :class:`QTensor`) to measure clipping under that scale.
    NaN when any scale is non-finite (non-finite input).
    """
    mag, ok = _scaled_magnitude(x, fmt, scaling, axis, block_size, block_2d, scale)
    clipped = (mag > Fp8Format(fmt).max * (1 + 1e-6)).float()
    frac = clipped.mean() if x.numel() else x.new_zeros((), dtype=torch.float32)
    return _nan_unless(ok, frac)


def clipped_counts(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    *,
    nonzero: Tensor,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """How many values of ``x`` would saturate and how many non-zero ones would underflow, as
    :func:`saturation_fraction` and :func:`underflow_fraction` define them, from one scaled
    magnitude (0-dim fp32 counts, no host sync; NaN when any scale is non-finite).

    ``nonzero`` is ``x != 0``, which a caller measuring several formats computes once.

    Example:
        >>> x = torch.tensor([1e-9, 0.0, 1.0, 448.0])
        >>> [float(c) for c in clipped_counts(x, "e4m3", "tensorwise", nonzero=x != 0)]
        [0.0, 1.0]
    """
    if nonzero.shape != x.shape:
        raise ValueError(f"clipped_counts: nonzero has shape {tuple(nonzero.shape)}, x {tuple(x.shape)}")
    fmt = Fp8Format(fmt)
    mag, ok = _scaled_magnitude(x, fmt, scaling, axis, block_size, block_2d, scale)
    saturated = (mag > fmt.max * (1 + 1e-6)).sum().float()
    underflow = (nonzero & (mag < fmt.min_subnormal)).sum().float()
    nan = float("nan")
    return torch.where(ok, saturated, nan), torch.where(ok, underflow, nan)


def underflow_fraction(
    x: Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    *,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
    scale: Tensor | None = None,
) -> Tensor:
    """Fraction of the non-zero values of ``x`` whose scaled magnitude is below
    ``fmt.min_subnormal`` (they flush to zero or keep at most one subnormal step).

    0-dim fp32, no host sync; 0 when ``x`` has no non-zero value; NaN when any scale is
    non-finite. ``scale`` as in :func:`saturation_fraction`.
    """
    mag, ok = _scaled_magnitude(x, fmt, scaling, axis, block_size, block_2d, scale)
    nonzero = x != 0
    under = (nonzero & (mag < Fp8Format(fmt).min_subnormal)).sum().float()
    frac = under / nonzero.sum().clamp_min(1).float()
    return _nan_unless(ok, frac)
