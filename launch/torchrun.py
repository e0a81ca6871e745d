"""torchrun without its failure report: ``python launch/torchrun.py [torchrun arguments]``.

Takes torchrun's arguments and starts the processes as torchrun does. When a process fails,
torchrun prints a ~40-line ``ChildFailedError`` report and traceback after the job's own
message; here the job's message (``launch/train.py`` prints one, on rank 0) is all the console
shows, and the exit status is the first failing process's (2 for a config, data or checkpoint
error). A process ended by a signal (SIGKILL from the out-of-memory killer, say) prints no
message of its own; for it this wrapper prints one line naming the rank, the signal and the
run's log (``<trainer.out_dir>/latest/train.log``, or the rank's own ``train.rank<k>.log``,
when this job wrote it). scripts/train.sh runs it.

Example:
    python launch/torchrun.py --standalone --nproc_per_node=2 launch/train.py trainer.steps=50
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

logger = logging.getLogger(__name__)


def exit_status(failure_exitcode: int) -> int:
    """The shell's exit status of a process that exited with `failure_exitcode` (negative: the
    signal that ended it)."""
    return 128 - failure_exitcode if failure_exitcode < 0 else failure_exitcode or 1


def root_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that ended the job, with its rank: the first one, where SIGTERM (what the
    agent sends the other processes once one failed) counts last, and a signal first among
    failures of the same second (the peers of a killed process fail because of it)."""
    return min(
        exc.failures.items(),
        key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[1].exitcode >= 0, item[0]),
    )


def signal_message(rank: int, failure: ProcessFailure, log: Path | None) -> str:
    """The one line printed for a process that a signal ended (it could not print its own)."""
    name = failure.signal_name()
    why = "; out of memory? `dmesg` names the process the kernel killed" if name == "SIGKILL" else ""
    where = f"; the run's log: {log}" if log is not None else ""
    return f"error: rank {rank} was killed by {name} (signal {-failure.exitcode}{why}){where}"


def run_log(script_args: list[str], rank: int, since: float) -> Path | None:
    """The log of the run that `script_args` (hydra overrides of launch/train.py) wrote into,
    rank `rank`'s own when it has one, else rank 0's; None when no log in the latest run under
    ``trainer.out_dir`` was written after `since` (the job failed before its run directory
    existed, or is not launch/train.py)."""
    # Imported here, on a failure only: loka_train imports TorchRec (seconds), and the wrapper
    # starts the job without waiting for that.
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.config_store import ConfigStore

        from loka_train.job import JobConfig
        from loka_train.runtime.rundirs import RunDirs

        ConfigStore.instance().store(name="job_schema", node=JobConfig)  # as launch/train.py does
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            out_dir = compose(config_name="config", overrides=script_args).trainer.out_dir
        run_dir = RunDirs(out_dir, keep=0).latest()
    except Exception:  # not launch/train.py's arguments: no log to name, the failure is told anyway
        logger.debug("no run log for the arguments %s", script_args, exc_info=True)
        return None
    if run_dir is None:
        return None
    for name in (f"train.rank{rank}.log", "train.log"):
        log = run_dir.resolve() / name
        if log.is_file() and log.stat().st_mtime >= since - 1:  # 1 s: coarse file-system clocks
            return log
    return None


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # The agent's notices (OMP_NUM_THREADS set to 1, processes stopped after a failure, which
    # process failed with which code) repeat what the job's own message says.
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    started = time.time()
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = root_failure(exc)
        if failure.exitcode < 0:
            log = run_log(list(args.training_script_args), rank, started)
            print(signal_message(rank, failure, log), file=sys.stderr, flush=True)
        return exit_status(failure.exitcode)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
