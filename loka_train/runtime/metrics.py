"""One small metrics interface: scalars by key (e.g. `train/loss`, `probe/<site>/<gemm>/sqnr_db`)
written as JSON lines and, when available, TensorBoard events, into the run's directory. Only
rank 0 writes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Append-only metrics sink of one run directory.

    Args:
        out_dir: the run directory (`metrics.jsonl`, `tb/`); None disables writing (other ranks).
        tensorboard: also write TensorBoard events; if the package is missing this is
            logged once as a warning and counted in `fallbacks`.

    Example:
        >>> m = MetricsLogger("runs/20261125-190301", tensorboard=False)
        >>> m.start_at(0)
        >>> m.log(10, {"train/loss": 0.45})
    """

    def __init__(self, out_dir: str | Path | None, *, tensorboard: bool) -> None:
        self.fallbacks: list[str] = []
        self._out = None if out_dir is None else Path(out_dir)
        self._file: Any = None
        self._tb: Any = None
        self._writer: Any = None
        if self._out is not None and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter
            except ImportError as exc:
                msg = f"TensorBoard logging off: {exc} (pip install tensorboard to enable it)"
                logger.warning(msg)
                self.fallbacks.append(msg)

    def start_at(self, step: int) -> None:
        """Open the run's files for a run that starts after `step` steps (0: from scratch; else
        resumed from a checkpoint of that step in the same run directory). From scratch the
        file starts empty; resumed, the lines past `step` (written after the checkpoint by the
        interrupted run, about to be redone) are dropped, and so are TensorBoard's events past
        it, so every step appears once."""
        if self._out is None:
            return
        self._out.mkdir(parents=True, exist_ok=True)
        path = self._out / "metrics.jsonl"
        if step and path.exists():
            _drop_lines_past(path, step)
        self._file = path.open("a" if step else "w")
        if self._writer is not None:
            self._tb = self._writer(log_dir=str(self._out / "tb"), purge_step=step + 1 if step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write `metrics` of `step` (once :meth:`start_at` opened the files; other ranks write
        nothing)."""
        if self._file is None or not metrics:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else str(float(v))) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, float(value), step)

    def close(self) -> None:
        """Close the run's files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _drop_lines_past(path: Path, step: int) -> None:
    """Keep the lines of `path` up to `step`; a half-written line (a killed run) is dropped."""
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            logger.warning("metrics: %s holds a line that is not JSON (a write cut short); "
                           "dropped: %.80r", path, line)
            continue
        if record is not None and record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        logger.info("metrics: resumed after step %d; dropped %d lines past it", step, len(lines) - len(kept))
