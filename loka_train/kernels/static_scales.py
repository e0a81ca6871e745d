"""Static tensor-wise scales: one read of the operand instead of two, never a saturated code.

A dynamic tensor-wise quantizer needs the tensor's amax before it can cast a single value, so
it reads the operand twice (an amax pass, then the cast). With a scale known beforehand, one
pass reads the operand once, writes the codes and reduces the amax on the way; a one-program
check then decides whether the static scale *fits* this tensor:

* ``amax / scale <= fmt.max``: no code saturates, and
* ``amax / scale >= fmt.max / spread`` (or the tensor is all zeros): the largest code sits at
  most ``log2(spread)`` binades below the format's top (where a dynamic scale puts it).

Where it fits, the payload keeps the static scale. Where it does not (the operand drifted, a
non-finite value, or no scale yet), a second pass recasts the tensor with the dynamic scale:
the payload is then bit for bit the dynamic quantizer's, the fallback is counted in the slot
(not while it has no scale yet), and the slot is re-seeded from this tensor's amax when that is
finite and not zero, so a drift costs one recast, not one per step. Numerics therefore never
saturate, whatever the scale: a stale scale costs time, never a clipped value.

Formats with a wider range get more of both (:func:`headroom`): e5m2 has 15 more binades of
normal values than e4m3, so a gradient's scale seeds with ``128 x margin`` and fits over
``128**2 x spread``. Its largest code then sits 7 binades (and the margin) below e5m2's top,
where an e4m3 seed would put it (``57344 / 128 == 448``): the codes keep e4m3's absolute range
and e5m2's extra range absorbs drift. With e4m3's knobs alone, the gradients of Wukong's FM MLPs
recast on about half the steps of a short run (``docs/performance.md``).

Where scales come from: the Probe's window (its amax over the sampled steps, all-reduced
across ranks, :func:`set_from_amax`, with a ``margin`` of headroom, rounded up to a power of two),
refreshed at each window; before the first window, and after a fallback, from the operand
itself.

A **slot** is a 4-element fp32 tensor on the operand's device, updated in place by the
quantizer (``loka::tensorwise_quant_static``) and read by the host only between steps:

====  =====================================================================
  0   the static dequantization scale (0: none yet)
  1   fallbacks: calls the scale did not fit (unset slots are not counted)
  2   margin: headroom of a seeded scale over the amax (``>= 1``; times :func:`headroom`)
  3   spread: how far below the format's top a fitting tensor's amax may sit (``>= 2``; times
      :func:`headroom` squared)
====  =====================================================================

:func:`quantize_static_reference` is the pure-PyTorch oracle of the Triton kernel (same codes,
scale and slot update).

Example:
    >>> slots = new_slots(2, margin=2.0, spread=16.0, device=torch.device("cpu"))
    >>> x = torch.randn(64, 32)
    >>> q, scale = quantize_static_reference(x, slots[0], Fp8Format.E4M3)  # seeds the slot
    >>> q, scale = quantize_static_reference(x, slots[0], Fp8Format.E4M3)  # fits now
    >>> bool(scale == slots[0, SCALE]), float(slots[0, FALLBACKS])
    (True, 0.0)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loka_train.kernels.formats import Fp8Format, Scaling, quantize

__all__ = [
    "FALLBACKS",
    "headroom",
    "MARGIN",
    "SCALE",
    "SLOT_SIZE",
    "SPREAD",
    "check_slot",
    "fallbacks",
    "new_slots",
    "quantize_static_reference",
    "set_from_amax",
]

SCALE, FALLBACKS, MARGIN, SPREAD = 0, 1, 2, 3
"""Positions in a slot (module docstring)."""
SLOT_SIZE = 4


def headroom(fmt: Fp8Format) -> float:
    """The factor a format's wider range adds to a slot's margin (its square to the spread):
    ``2**k``, ``k`` half the binades of normal values ``fmt`` has beyond e4m3's, rounded down
    (1 for e4m3, 128 for e5m2)."""
    fmt = Fp8Format(fmt)
    e4m3 = Fp8Format.E4M3
    extra = math.log2((fmt.max / fmt.min_normal) / (e4m3.max / e4m3.min_normal))
    return 2.0 ** max(0, math.floor(extra / 2))


def new_slots(num: int, *, margin: float, spread: float, device: torch.device) -> Tensor:
    """``num`` fresh slots ``(num, 4)``: no scale yet, no fallback, the given margin and spread.

    Raises:
        ValueError: for ``margin < 1`` or ``spread < 2``.
    """
    if not margin >= 1.0:
        raise ValueError(f"static-scale margin must be >= 1 (headroom over the amax), got {margin}")
    if not spread >= 2.0:
        raise ValueError(f"static-scale spread must be >= 2, got {spread}")
    slots = torch.zeros(num, SLOT_SIZE, dtype=torch.float32, device=device)
    slots[:, MARGIN] = margin
    slots[:, SPREAD] = spread
    return slots


def check_slot(slot: Tensor, device: torch.device) -> None:
    """Raise ValueError unless ``slot`` is one contiguous fp32 slot on ``device``."""
    if slot.shape != (SLOT_SIZE,) or slot.dtype != torch.float32 or not slot.is_contiguous():
        raise ValueError(
            f"a static-scale slot is a contiguous fp32 tensor of {SLOT_SIZE} (static_scales.new_slots), "
            f"got {slot.dtype} {tuple(slot.shape)} with strides {slot.stride()}"
        )
    if slot.device != device:
        raise ValueError(f"static-scale slot on {slot.device}, operand on {device}")


def _seed(amax: Tensor, margin: Tensor, fmt: Fp8Format) -> Tensor:
    """The power of two at or above ``amax * margin * headroom / fmt.max`` (fp32, from its
    exponent bits, as the kernel computes it; normal range)."""
    inv_max = torch.tensor(1.0, dtype=torch.float32) / fmt.max
    v = amax.float() * ((margin.float() * headroom(fmt)) * inv_max.to(amax.device))
    bits = v.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def quantize_static_reference(x: Tensor, slot: Tensor, fmt: Fp8Format) -> tuple[Tensor, Tensor]:
    """The static-scale quantizer in PyTorch (module docstring): ``(codes, scale)``, with
    ``slot`` updated in place as the kernel updates it."""
    fmt = Fp8Format(fmt)
    check_slot(slot, x.device)
    dynamic = quantize(x, fmt, Scaling.TENSORWISE)
    if x.numel() == 0:
        return dynamic.data, dynamic.scale
    xf = x.float()
    finite = bool(torch.isfinite(xf).all())
    amax = xf.abs().amax() if finite else torch.tensor(float("inf"), device=x.device)
    static = slot[SCALE].clone()
    is_set = bool(static > 0)
    fits = False
    if is_set and finite:
        peak = amax / static
        spread = slot[SPREAD] * headroom(fmt) ** 2
        fits = bool(peak <= fmt.max) and (bool(peak * spread >= fmt.max) or bool(amax == 0))
    if not fits:
        if is_set:
            slot[FALLBACKS] += 1
        if finite and bool(amax > 0):
            slot[SCALE] = _seed(amax, slot[MARGIN], fmt)
        return dynamic.data, dynamic.scale
    q = torch.div(x, static.reshape((1,) * x.ndim)).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q, static


def set_from_amax(slot: Tensor, amax: Tensor | float, fmt: Fp8Format) -> None:
    """Set ``slot``'s scale from an amax seen beforehand (the Probe's window): the power of two
    at or above ``amax * margin * headroom(fmt) / fmt.max``. A non-finite or zero amax leaves the slot as it is.
    In place, on the slot's device, no host sync (``amax`` may be a device tensor)."""
    a = torch.as_tensor(amax, dtype=torch.float32, device=slot.device)
    ok = torch.isfinite(a) & (a > 0)
    slot[SCALE] = torch.where(ok, _seed(torch.where(ok, a, 1.0), slot[MARGIN], Fp8Format(fmt)), slot[SCALE])


def fallbacks(slots: Tensor) -> list[int]:
    """The fallback counts of ``slots`` ``(..., 4)``, flattened (a host sync: between steps)."""
    return [int(v) for v in slots[..., FALLBACKS].reshape(-1).tolist()]
