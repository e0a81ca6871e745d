"""How far two runs of the same small trainer drift apart on the GPU, with and without graphs.

    python -m bench.graph_drift [--kind wukong] [--loka] [--compiled] [--repeats 2]
                                [--no-shared-outputs] [--out DIR]

`tests/gpu/test_graphs_gpu.py::test_trainer_with_graphs_trains_like_eager` compares a graphed
run's per-step losses with an eager run's under a fixed tolerance. Graphed and eager compiled
code may round apart, and a 24-step warm-up run amplifies small differences, so that tolerance
only means something next to the gap measured alone. This script runs the test's configuration
(the same helper, ``train_losses``) ``--repeats`` times eager and as many times graphed, in one
process, and prints each run's losses and plan changes, and the largest per-step relative loss
gap of eager against eager, eager against graphed and graphed against graphed, with the step
where it occurs. Differences between processes or machines need one call per process.
``--no-shared-outputs`` graphs every module with copied outputs
(``trainer.cuda_graphs_share_outputs=false``), to tell a gap of the shared output buffers from
one of the compiled kernels.
``--out`` writes the same as ``drift.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any


def max_gap(a: list[float], b: list[float]) -> tuple[float, int]:
    """The largest per-step relative gap |a - b| / |b| and its step."""
    gaps = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
    step = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[step], step


def pair_gaps(runs: dict[str, list[list[float]]]) -> dict[str, list[tuple[float, int]]]:
    """Per kind of pair (``eager~eager``, ``eager~graphed``, ``graphed~graphed``), the max gaps
    of every pair of distinct runs."""
    eager, graphed = runs["eager"], runs["graphed"]
    return {
        "eager~eager": [max_gap(a, b) for a, b in itertools.combinations(eager, 2)],
        "eager~graphed": [max_gap(g, e) for e, g in itertools.product(eager, graphed)],
        "graphed~graphed": [max_gap(a, b) for a, b in itertools.combinations(graphed, 2)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.graph_drift", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="wukong", choices=("dcn", "wukong"))
    p.add_argument("--loka", action="store_true", help="the LoKA callback on (the test's safe preset)")
    p.add_argument("--compiled", action="store_true", help="trainer.compile_dense too")
    p.add_argument("--repeats", type=int, default=2, help="runs of each of eager and graphed (>= 1)")
    p.add_argument("--no-shared-outputs", action="store_true",
                   help="graphed modules copy their outputs instead of sharing their buffers")
    p.add_argument("--out", type=Path, default=None, help="directory for drift.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: give at least 1")

    import torch

    if not torch.cuda.is_available():
        p.error("needs CUDA: the drift measured is that of the GPU's kernels")
    from tests.gpu._graphs_runs import train_losses


    runs: dict[str, list[list[float]]] = {"eager": [], "graphed": []}
    changes: dict[str, list[Any]] = {"eager": [], "graphed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, graphs in (("eager", False), ("graphed", True)):
                summary, losses = train_losses(
                    args.kind, graphs, args.loka, args.compiled, Path(tmp) / f"{name}{i}",
                    share_outputs=not args.no_shared_outputs,
                )
                plan_changes = summary["plan_changes"] if args.loka else []
                runs[name].append(losses)
                changes[name].append(plan_changes)
                print(f"{name} run {i}: losses {[round(x, 5) for x in losses]}", flush=True)
                for c in plan_changes:
                    print(f"  plan change: step {c['step']} {c['site']}/{c['role']}: {c['old']} -> {c['new']}")
    gaps = pair_gaps(runs)
    for pair, values in gaps.items():
        cells = ", ".join(f"{g:.2%} at step {s}" for g, s in values) or "-"
        print(f"max per-step loss gap {pair}: {cells}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "drift.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "plan_changes": changes,
             "gaps": gaps, "gpu": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
