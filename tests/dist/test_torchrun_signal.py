"""launch/torchrun.py: a rank killed by a signal (SIGKILL, as the out-of-memory killer sends)
prints nothing of its own; the wrapper prints one line naming the rank, the signal and the run's
log, and exits with the shell's status of a killed process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUIET_TORCHRUN = [sys.executable, str(ROOT / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]

# Stands in for launch/train.py: rank 0 writes the run's log (as the run would) and waits; rank 1
# is killed. The hydra override after the script names the runs' directory, as for train.py.
KILLED = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1].split("=", 1)[1])
if os.environ["RANK"] == "0":
    (out / "latest" / "train.log").write_text("step 1\\n")
    time.sleep(30)
else:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_by_a_signal_is_named_with_the_run_log(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    (out / "20260101-000000").mkdir(parents=True)
    (out / "latest").symlink_to("20260101-000000")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*QUIET_TORCHRUN, str(script), f"trainer.out_dir={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: rank 1 was killed by SIGKILL (signal 9; out of memory? `dmesg` names the process "
        f"the kernel killed); the run's log: {out.resolve() / '20260101-000000' / 'train.log'}"
    ], proc.stderr[-3000:]
