"""torchrun without its failure report: ``python launch/torchrun.py [torchrun arguments]``.

Takes torchrun's arguments and starts the processes as torchrun does. When a process fails,
torchrun prints a ~40-line ``ChildFailedError`` report and traceback after the job's own
message; here the job's message (``launch/train.py`` prints one, on rank 0) is all the console
shows, and the exit status is the first failing process's (2 for a config, data or checkpoint
error). scripts/train.sh runs it.

Example:
    python launch/torchrun.py --standalone --nproc_per_node=2 launch/train.py trainer.steps=50
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def exit_status(failure_exitcode: int) -> int:
    """The shell's exit status of a process that exited with `failure_exitcode` (negative: the
    signal that ended it)."""
    return 128 - failure_exitcode if failure_exitcode < 0 else failure_exitcode or 1


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # The agent's notices (OMP_NUM_THREADS set to 1, processes stopped after a failure, which
    # process failed with which code) repeat what the job's own message says.
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return exit_status(failure.exitcode)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
