"""bench/device_multi.sh refuses a lane whose part it does not run before any part starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_multi.sh"


def test_an_unknown_part_stops_the_call_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "0:e2e", "1:pytest+inferw2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown part 'inferw2' in lane '1:pytest+inferw2'" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing made, nothing run


def test_the_parts_it_checks_are_the_parts_it_runs() -> None:
    text = SCRIPT.read_text()
    checked = re.search(r"known\(\) \{.*?case \$1 in\s*(.*?)\) return 0", text, re.S)
    assert checked is not None
    known = {p.strip().rstrip("*") for p in checked.group(1).replace("\\\n", "").split("|")}
    body = text[text.index("part() {"):text.index("lane() {")]
    run = {m.rstrip("*") for m in re.findall(r"^\s{4}([a-z0-9]+\*)\)", body, re.M)}
    assert run and known == run


def test_each_part_runs_in_its_lane_and_logs_its_code_and_wall_time(tmp_path: Path) -> None:
    """Two lanes on a stand-in host of one GPU (fake nvidia-smi and python on PATH; its parts
    write under the test's directory): every part's log, in its lane's archive, ends with its
    return code and its wall time."""
    import os
    import tarfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\ncase \"$1\" in -L) echo 'GPU 0: fake';; *) echo 'name, memory';; esac\n")
    # The parts' python: says which GPU it saw, sleeps a second, fails for the pytest part.
    (bin_dir / "python").write_text(
        "#!/bin/sh\necho \"gpu $CUDA_VISIBLE_DEVICES: $*\"\nsleep 1\ncase \"$1 $2\" in \"-m pytest\") exit 3;; esac\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_e2ex": "--configs dcn",
           "DEVICE_MULTI_TMP": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT), str(out), "0:e2ex+pytesty", "0:gemmz"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    logs = {}
    for lane in (0, 1):
        with tarfile.open(out / f"lane{lane}.tgz") as tar:
            for m in tar.getmembers():
                if m.name.endswith(".txt") and m.name not in ("gpus.txt", "commit.txt", "lanes.txt"):
                    f = tar.extractfile(m)
                    assert f is not None
                    logs[m.name[:-4]] = f.read().decode().splitlines()
    assert sorted(logs) == ["e2ex", "gemmz", "pytesty"]
    assert f"gpu 0: -m bench.e2e --out {tmp_path}/multi/e2ex --configs dcn" in logs["e2ex"]
    assert any(line.startswith("gpu 0: -m bench.gemm") for line in logs["gemmz"])
    assert f"--basetemp={tmp_path}/mg_pytesty" in " ".join(logs["pytesty"])
    assert logs["pytesty"][-2] == "rc=3" and logs["e2ex"][-2] == "rc=0"
    for lines in logs.values():
        wall = re.fullmatch(r"wall (\d+)s", lines[-1])
        assert wall is not None and int(wall.group(1)) >= 1, lines
