"""Write conf/loka/<name>.yaml from the LoKA presets: ``python -m launch.presets [--check]``.

The presets are defined once, in Python (``LokaConfig.preset``, loka_train/plugin/config.py);
hydra's ``loka=<name>`` reads the YAML files this writes. Each file holds the fields in which
its preset differs from ``LokaConfig()`` (plus ``enabled``). ``--check`` writes nothing and
exits 1 when a file is not what this would write.

Example:
    >>> print(preset_yaml("off"))
    # LoKA preset "off": written from LokaConfig.preset("off") ...
    enabled: false
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from loka_train.plugin.config import PRESETS, LokaConfig

CONF_LOKA = Path(__file__).resolve().parents[1] / "conf" / "loka"
"""Where hydra finds the ``loka`` group."""


def _plain(value: Any) -> Any:
    """`value` as YAML data: enums by name, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _diff(config: Any, base: Any) -> dict[str, Any]:
    """The fields of the dataclass `config` that differ from `base`, nested like the config."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(value):
            sub = _diff(value, default)
            if sub:
                out[f.name] = sub
        elif _plain(value) != _plain(default):
            out[f.name] = _plain(value)
    return out


def preset_yaml(name: str) -> str:
    """The text of conf/loka/<name>.yaml for the preset `name`."""
    config = LokaConfig.preset(name)
    fields = {"enabled": config.enabled, **_diff(config, LokaConfig())}
    header = (
        f'# LoKA preset "{name}": written from LokaConfig.preset("{name}") by\n'
        "# `python -m launch.presets`; change the preset in loka_train/plugin/config.py (which\n"
        "# describes each one), not this file. It holds the fields that differ from LokaConfig();\n"
        "# each field is documented in its dataclass (loka_train/{probe,mods,dispatch,comm}/config.py).\n"
    )
    return header + OmegaConf.to_yaml(OmegaConf.create(fields))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    stale = []
    for name in PRESETS:
        path = CONF_LOKA / f"{name}.yaml"
        text = preset_yaml(name)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
            print(f"wrote {path}")
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}; run `python -m launch.presets`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
