"""Moving an earlier run's outputs out of the way (nothing is deleted)."""

from __future__ import annotations

import time
from pathlib import Path


def set_aside(path: Path) -> Path:
    """Rename ``path`` (a file or directory) to ``<stem>.before-<time><suffix>`` beside it and
    return the new path; a ``-<n>`` suffix keeps an earlier set-aside of the same second (a
    plain rename would silently replace it).

    Example:
        >>> set_aside(Path("runs/latest/metrics.jsonl"))  # doctest: +SKIP
        PosixPath('runs/latest/metrics.before-20261123-140001.jsonl')
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.stem}.before-{stamp}{path.suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.stem}.before-{stamp}-{n}{path.suffix}")
        n += 1
    path.rename(target)
    return target
