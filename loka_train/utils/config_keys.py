"""Dotted setting names (``trainer.steps``) checked against a tree of config dataclasses, with
the nearest valid names for a misspelled one.

Example:
    >>> from loka_train.job import JobConfig
    >>> unknown_key_message(JobConfig, "trainer.stepz")
    'trainer.stepz is not a setting: did you mean trainer.steps?'
    >>> unknown_key_message(JobConfig, "trainer.steps") is None
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing

__all__ = ["unknown_key_message"]


def _dataclass_of(hint: object) -> type | None:
    """The dataclass a field's type hint holds (``X``, ``X | None``), else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def unknown_key_message(schema: type, key: str) -> str | None:
    """None when the dotted `key` names a field of the dataclass `schema` (or a path below a
    field that is not a dataclass, such as a dict, which is not checked here); else a message
    that names the nearest valid keys, or lists the valid ones where none is near.

    Args:
        schema: the root config dataclass (e.g. ``JobConfig``).
        key: a dotted setting name as given on a command line (``loka.probe.interval``).
    """
    node: type | None = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return None
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            prefix = ".".join(parts[:i])
            rest = "".join(f".{p}" for p in parts[i + 1 :])
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
            if close:
                full = [f"{prefix}.{name}{rest}" if prefix else f"{name}{rest}" for name in close]
                return f"{key} is not a setting: did you mean {' or '.join(full)}?"
            where = f"the settings of {prefix}" if prefix else "the top-level groups"
            return f"{key} is not a setting; {where} are: {', '.join(names)}"
        node = _dataclass_of(typing.get_type_hints(node)[part])
    return None
