"""One small metrics interface: scalars by key (e.g. `train/loss`, `probe/<site>/<gemm>/sqnr_db`)
written as JSON lines and, when available, TensorBoard events. Only rank 0 writes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from loka_train.runtime._paths import set_aside

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Append-only metrics sink.

    Args:
        out_dir: directory of `metrics.jsonl` and `tb/`; None disables writing (other ranks).
        tensorboard: also write TensorBoard events; if the package is missing this is
            logged once as a warning and counted in `fallbacks`.

    Example:
        >>> m = MetricsLogger("runs/x", tensorboard=False)
        >>> m.log(10, {"train/loss": 0.45})
    """

    def __init__(self, out_dir: str | Path | None, *, tensorboard: bool) -> None:
        self.fallbacks: list[str] = []
        self._file = None
        self._tb: Any = None
        if out_dir is None:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._path = out / "metrics.jsonl"
        self._file = self._path.open("a")  # a run calls start_at once it knows its first step
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out / "tb"))
            except ImportError as exc:
                msg = f"TensorBoard logging off: {exc} (pip install tensorboard to enable it)"
                logger.warning(msg)
                self.fallbacks.append(msg)

    def start_at(self, step: int) -> None:
        """The run starts after `step` steps (0: from scratch; else resumed from a checkpoint of
        that step). From scratch, an earlier run's file is moved aside; resumed, the lines past
        `step` (written after the checkpoint by the interrupted run, about to be redone) are
        dropped, so every step appears once."""
        if self._file is None:
            return
        self._file.close()
        if step == 0:
            if self._path.stat().st_size:
                aside = set_aside(self._path)
                logger.warning("metrics: a fresh run; the earlier run's metrics moved to %s", aside)
        elif self._path.exists():
            lines = self._path.read_text().splitlines(keepends=True)
            kept = []
            for line in lines:
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    # A killed run can leave a half-written last line: it is dropped, not fatal.
                    logger.warning("metrics: %s holds a line that is not JSON (a write cut short); "
                                   "dropped: %.80r", self._path, line)
                    continue
                if record is not None and record["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            if kept != lines:
                tmp = self._path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(kept))
                tmp.replace(self._path)
                logger.info("metrics: resumed after step %d; dropped %d lines past it", step,
                            len(lines) - len(kept))
        self._file = self._path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is None or not metrics:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else str(float(v))) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, float(value), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
