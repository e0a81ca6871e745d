"""Whether a device has FP8 matrix hardware, and why not: checked once per device, lazily.

Nothing here touches hardware at import.

Example:
    >>> fp8_available("cpu")[0]
    False
"""

from __future__ import annotations

import functools

import torch

__all__ = ["fp8_available"]


def _device_key(device: torch.device | str | None) -> tuple[str, int | None]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    index = dev.index
    if dev.type == "cuda" and index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return dev.type, index


@functools.cache
def _fp8_available(device_type: str, index: int | None) -> tuple[bool, str]:
    if device_type == "cpu":
        return False, (
            "CPU has no FP8 matrix hardware: the emulated backend and torch._scaled_mm's CPU "
            "reference run for testing, not for speed"
        )
    if device_type != "cuda":
        return False, f"FP8 GEMMs are only wired up for CUDA devices, not {device_type!r}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this process"
    if torch.version.hip is not None:
        return False, "ROCm FP8 (e4m3fnuz) backends are not wired up"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, (
            f"{torch.cuda.get_device_name(index)} is sm_{major}{minor}; FP8 tensor cores need "
            "sm_89 (Ada) or sm_90+ (Hopper)"
        )
    return True, ""


def fp8_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``device`` has FP8 tensor cores, and why not. Checked once per device, lazily.

    Example:
        >>> fp8_available("cpu")[0]
        False
    """
    if torch.compiler.is_compiling():  # dynamo does not trace through functools caches
        return _fp8_available.__wrapped__(*_device_key(device))
    return _fp8_available(*_device_key(device))
