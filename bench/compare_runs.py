"""Compare two runs of the main job bit for bit: per-step losses, evaluations, and LoKA's plans,
plan changes and per-site report rows.

A refactoring that must not change behaviour is checked by running the same fixed-seed job on
both commits and comparing the two run directories:

    ./scripts/train.sh trainer.steps=120 trainer.log_every=1 trainer.out_dir=/tmp/before ...
    (on the other commit)  ./scripts/train.sh ... trainer.out_dir=/tmp/after
    python -m bench.compare_runs /tmp/before /tmp/after

Exits 0 when everything is identical, 1 otherwise (naming what differs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(run: Path) -> dict[str, Any]:
    """What a run directory says: losses and evaluations from ``metrics.jsonl``, the LoKA
    report's plans and sites from ``loka/loka_report.json`` (when the run had LoKA on)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, Any] = {
        "losses": [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r],
        "evals": [(r["step"], {k: v for k, v in r.items() if k.startswith("eval/")})
                  for r in rows if any(k.startswith("eval/") for k in r)],
    }
    report = run / "loka" / "loka_report.json"
    if report.exists():
        rep = json.loads(report.read_text())
        out.update(plans=rep["plan_export"], plan_changes=rep["plan_changes"],
                   fp8_coverage=rep["fp8_coverage"], sites=rep["sites"])
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """One line per field: identical or DIFFERENT."""
    lines = []
    for key in sorted(set(a) | set(b)):
        same = a.get(key) == b.get(key)
        size = f" ({len(a[key])} entries)" if isinstance(a.get(key), list) else ""
        lines.append(f"{key}: {'identical' if same else 'DIFFERENT'}{size}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    args = p.parse_args(argv)
    lines = compare(load(args.before), load(args.after))
    print("\n".join(lines))
    return 0 if all(line.split(": ")[1].startswith("identical") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
