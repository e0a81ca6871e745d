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
