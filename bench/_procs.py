"""Child processes of a benchmark: each in its own process group, stopped with it.

``timeout`` on the device machine sends SIGTERM to the benchmark it started, not to the
processes that benchmark started; a child left running would hold the GPU for the next call.
:func:`terminating` turns SIGTERM into :class:`Terminated` (a ``SystemExit``) in the parent, and
:func:`run_child` stops the child's whole group (SIGTERM, then SIGKILL) when it times out or the
parent stops.

Example:
    >>> with terminating():
    ...     rc, timed_out = run_child([sys.executable, "-m", "bench.e2e", ...], log_path, timeout_s=600)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

__all__ = ["Terminated", "run_child", "stop", "terminating"]

ROOT = Path(__file__).resolve().parents[1]


class Terminated(SystemExit):
    """SIGTERM (``timeout`` on the device machine): stop the running child, then exit."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(128 + signum)


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside (the previous handler is restored after)."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a child's process group (torchrun and its workers, say), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(
    cmd: Sequence[str], log: Path, *, timeout_s: float | None, cwd: Path = ROOT
) -> tuple[int | None, bool]:
    """Run `cmd` in `cwd` (default: the repository root, which is on its PYTHONPATH either way)
    in its own process group, its output into `log`; returns (exit status, timed out). The
    child is stopped if the parent stops first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                process_group=0)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            stop(proc)
            return proc.returncode, True
        finally:
            if proc.poll() is None:
                stop(proc)
