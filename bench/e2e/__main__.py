"""``python -m bench.e2e``: runs :func:`bench.e2e.cli.main` and exits at once."""

import os
import sys

from bench.e2e.cli import main

if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit now: on an H100 the process stayed alive after its last line (runs sat idle until
    # their time limit, likely a lingering non-daemon thread of torch.compile's workers), and device time is scarce. Everything is written by now.
    os._exit(rc)
