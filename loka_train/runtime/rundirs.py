"""Run directories: every run of a job writes into a directory of its own.

Layout under ``trainer.out_dir`` (default ``runs``)::

    20261125-190301/        one run: metrics.jsonl, tb/, checkpoints/, summary.json, train.log,
    20261125-191544/        config.yaml, loka/ (the LoKA report)
    latest -> 20261125-191544

``latest`` is a relative symbolic link to the newest run; where the file system refuses links
it is a one-line text file naming the run (a fallback: logged once, counted in
:attr:`RunDirs.fallbacks` and so in the run's summary). A run starts in a new directory named by
its start time (``-1``, ``-2`` appended within one second), except that ``trainer.resume=auto``
(or ``must``) continues in the run ``latest`` names when that run holds a checkpoint.
``trainer.resume=<path>`` starts a new run from the checkpoint at `path`.

Nothing changes on disk before the run's checks have passed: :meth:`RunDirs.plan` only reads;
:meth:`RunDirs.open`, which the Trainer calls after its preflight, creates the directory,
repoints ``latest`` and deletes the oldest runs beyond ``trainer.keep_runs``. Only directories
named like a run (``YYYYmmdd-HHMMSS[-n]``) are counted and deleted; the run being resumed is
never deleted.

Example:
    >>> runs = RunDirs("runs", keep=10)
    >>> start = runs.plan("auto")     # which run and checkpoint; reads only
    >>> run_dir = runs.open(start)    # creates it, points latest at it, prunes (one rank)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from loka_train.runtime.checkpoint import LATEST, CheckpointError, latest_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["RUN_NAME_FORMAT", "RunDirs", "RunStart", "find_checkpoint"]

RUN_NAME_FORMAT = "%Y%m%d-%H%M%S"
"""``time.strftime`` format of a run directory's name (its start time, local)."""

_RUN_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")


@dataclass(frozen=True)
class RunStart:
    """Where a run writes and what it resumes, as :meth:`RunDirs.plan` decided it."""

    run_dir: Path | None
    """An existing run to continue in (``resume=auto``/``must`` found its checkpoint); None: a
    new run directory."""

    checkpoint: Path | None
    """The checkpoint (a ``checkpoints/step_*`` directory) to resume from; None: step 0."""


def find_checkpoint(path: Path) -> Path | None:
    """The checkpoint that `path` means, or None: `path` may be a ``checkpoints/step_*``
    directory, a ``checkpoints/`` directory, a run directory or a runs root (their latest).

    Example:
        >>> find_checkpoint(Path("runs/20261125-190301"))  # doctest: +SKIP
        PosixPath('runs/20261125-190301/checkpoints/step_00000300')
    """
    if (path / "meta.json").is_file():
        return path
    if (path / "checkpoints").is_dir():
        return latest_checkpoint(path / "checkpoints")
    pointer = path / LATEST
    if pointer.is_file() and not pointer.is_symlink() and pointer.read_text().startswith("step_"):
        return latest_checkpoint(path)
    run = RunDirs(path, keep=0).latest() if path.is_dir() else None
    return find_checkpoint(run) if run is not None and run != path else None


def _order(run: Path) -> tuple[str, int]:
    match = _RUN_NAME.fullmatch(run.name)
    assert match is not None
    return match.group(1), int(match.group(2) or 0)


class RunDirs:
    """The run directories under one root (``trainer.out_dir``).

    Args:
        root: the directory that holds the runs and ``latest``.
        keep: run directories kept after a new one is made (the new one included); the
            oldest beyond it are deleted. 0 keeps every run.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"trainer.keep_runs={keep} must be >= 0 (0 keeps every run)")
        self.root = Path(root)
        self.keep = keep
        self.fallbacks: list[str] = []
        """What :meth:`open` did other than asked (``latest`` a file, not a link), each once."""

    def runs(self) -> list[Path]:
        """The run directories under the root, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            p for p in self.root.iterdir()
            if p.is_dir() and not p.is_symlink() and _RUN_NAME.fullmatch(p.name)
        ]
        return sorted(found, key=_order)

    def latest(self) -> Path | None:
        """The run ``latest`` names, or None when there is none (a ``latest`` naming a
        directory that is gone is logged and taken as none)."""
        pointer = self.root / LATEST
        if pointer.is_symlink():
            target = self.root / os.readlink(pointer)
        elif pointer.is_file():
            target = self.root / pointer.read_text().strip()
        elif pointer.is_dir():
            return pointer  # a run written into `latest` itself (trainer.out_dir named the run)
        else:
            return None
        if not target.is_dir():
            logger.warning("%s names %s, which does not exist: no earlier run to continue", pointer, target)
            return None
        return target

    def plan(self, resume: str) -> RunStart:
        """Where a run with ``trainer.resume=resume`` writes and what it resumes (reads only).

        Raises `CheckpointError` naming the fix when ``must`` finds no checkpoint or a path
        holds none.
        """
        if resume == "never":
            return RunStart(run_dir=None, checkpoint=None)
        if resume in ("auto", "must"):
            run = self.latest()
            checkpoint = latest_checkpoint(run / "checkpoints") if run is not None else None
            if checkpoint is not None:
                return RunStart(run_dir=run, checkpoint=checkpoint)
            if resume == "must":
                where = f"the latest run ({run})" if run is not None else f"{self.root} (no run yet)"
                raise CheckpointError(
                    f"trainer.resume=must, but {where} holds no checkpoint: start a new run with "
                    "trainer.resume=auto or never, or give trainer.resume=<path of a run or checkpoint>"
                )
            return RunStart(run_dir=None, checkpoint=None)
        checkpoint = find_checkpoint(Path(resume))
        if checkpoint is None:
            raise CheckpointError(
                f"trainer.resume={resume!r}: no checkpoint at {resume} (give a run directory, its "
                "checkpoints/ or a checkpoints/step_* directory), or use trainer.resume=auto, never "
                "or must"
            )
        return RunStart(run_dir=None, checkpoint=checkpoint)

    def open(self, start: RunStart, *, now: float | None = None) -> Path:
        """The run directory of `start`: the run it continues, or a new one, named by `now`
        (default: the current time), that ``latest`` then names; the oldest runs beyond
        `keep` are deleted (never the one a checkpoint is resumed from). Call it on one rank,
        after the run's checks passed."""
        if start.run_dir is not None:
            return start.run_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self._adopt_run_in_latest()
        run = self._make_dir(time.time() if now is None else now)
        self._point_latest(run)
        self._prune(protect=run, resumed_from=start.checkpoint)
        return run

    def _unique(self, stamp: float) -> Path:
        base = time.strftime(RUN_NAME_FORMAT, time.localtime(stamp))
        path, n = self.root / base, 0
        while path.exists() or path.is_symlink():
            n += 1
            path = self.root / f"{base}-{n}"
        return path

    def _make_dir(self, now: float) -> Path:
        while True:  # mkdir is the atomic claim: two jobs starting in one second get two names
            path = self._unique(now)
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue

    def _adopt_run_in_latest(self) -> None:
        """A run written into ``latest`` itself (a directory, not a pointer) becomes a run
        directory named by its last change, so ``latest`` can point at the new run."""
        pointer = self.root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():
            target = self._unique(pointer.stat().st_mtime)
            pointer.rename(target)
            logger.warning("%s was a run directory, not a pointer; kept as the run %s", pointer, target)

    def _point_latest(self, run: Path) -> None:
        pointer = self.root / LATEST
        tmp = self.root / f".{LATEST}.{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        try:
            os.symlink(run.name, tmp)  # relative: the runs root can be moved or copied
        except OSError as exc:
            tmp.write_text(run.name + "\n")
            line = (f"run directories: symbolic links are not allowed in {self.root} "
                    f"({exc.strerror or exc}); {pointer} is a file naming the latest run instead")
            if line not in self.fallbacks:
                logger.warning(line)
                self.fallbacks.append(line)
        os.replace(tmp, pointer)

    def _prune(self, *, protect: Path, resumed_from: Path | None) -> None:
        if not self.keep:
            return
        runs = self.runs()
        keep = {protect.resolve()}
        if resumed_from is not None:
            source = resumed_from.resolve()
            keep.update(r.resolve() for r in runs if source.is_relative_to(r.resolve()))
        excess = len(runs) - self.keep
        removed = []
        for run in runs:
            if excess <= 0:
                break
            if run.resolve() in keep:
                continue
            try:
                shutil.rmtree(run)
                removed.append(run.name)
            except OSError as exc:
                logger.warning("could not delete the old run %s (%s); delete it by hand", run, exc)
            excess -= 1
        if removed:
            logger.info("deleted the oldest runs beyond trainer.keep_runs=%d: %s", self.keep, ", ".join(removed))
