"""Configuration of the LoKA plugin (the `loka:` group of the hydra config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class LokaConfig:
    """What the LoKA callback does. The library default (`enabled=False`) changes nothing.

    Example:
        >>> LokaConfig(enabled=True)
    """

    enabled: bool = False
    """Attach the LoKA callback to the trainer."""
