"""``--isolate``: every (config, batch, variant, round) of the benchmark in a fresh process.

One process carries state from run to run: on an H100 a host-bound variant's median step moved
by up to 1.8x between rounds of one process, and its peak reserved memory grew from round to
round, whatever the variant (``bench/results/sampled_replay_h100_2026-11-25/NOTES.md``); ratios
then depend on the order of the runs. With ``--isolate`` the benchmark starts ``python -m
bench.e2e`` once per run, in the rotated order of ``--repeats``, with its own arguments narrowed
to that run (``--configs``, ``--batches``, ``--variants``, ``--repeats 1``, ``--first-seed`` of
the round, ``--out OUT/runs/<run>``), and merges the records each child wrote into its report.
A child that fails or writes nothing becomes an error record naming its log.

Example:
    python -m bench.e2e --configs dlrm --batches 8192 --repeats 3 --isolate \\
        --variants bf16+compile+graphs,loka_safe+compile+graphs --out $OUT/e2e
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._procs import run_child, terminating
from bench.e2e.protocol import Runs, aggregate, progress, run_order
from bench.e2e.variants import Variant

__all__ = ["child_argv", "run_isolated"]

_NARROWED = ("--configs", "--batches", "--variants", "--repeats", "--first-seed", "--out")
"""Options with a value that each child gets narrowed to its run."""
_DROPPED_FLAGS = ("--isolate",)

Launch = Callable[[list[str], Path], "tuple[int | None, bool]"]
"""``(command, log) -> (exit status, timed out)``: how a child runs (tests pass a stand-in)."""


def child_argv(argv: Sequence[str], *, config: str, batch: int, variant: str, seed: int, out: Path) -> list[str]:
    """The parent's arguments for one run: the narrowed options replaced, ``--isolate`` dropped."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED_FLAGS:
            continue
        if name in _NARROWED:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return [*kept, "--configs", config, "--batches", str(batch), "--variants", variant, "--repeats", "1",
            "--first-seed", str(seed), "--out", str(out)]


def _launch(cmd: list[str], log: Path) -> tuple[int | None, bool]:
    # The parent's working directory: relative paths in its arguments mean the same to a child.
    return run_child(cmd, log, timeout_s=None, cwd=Path.cwd())


def run_isolated(
    args: argparse.Namespace,
    argv: Sequence[str],
    variants: list[Variant],
    runs: Runs,
    *,
    t0: float,
    on_run: Callable[[], object],
    launch: Launch | None = None,
) -> None:
    """Every run of ``args`` in its own process, its records into `runs` (`on_run` after each).

    Args:
        args: the parsed command line.
        argv: the command line as typed (what each child gets, narrowed).
        variants: the variants, in the order of the first round.
        runs: where the records go.
        t0: the benchmark's start, for the progress lines.
        on_run: called after every run (the caller rewrites the report).
        launch: runs one child (default: a process of its own, stopped with this one).
    """
    launch = launch or _launch
    with terminating():  # a SIGTERM stops the running child too (bench._procs)
        for config in args.config_names:
            for batch in args.batch_sizes:
                for variant, round_ in run_order(variants, args.repeats):
                    seed = args.first_seed + round_
                    name = f"{config}_b{batch}_{variant.name.replace('+', '_')}_s{seed}"
                    out = args.out / "runs" / name
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "e2e.json").unlink(missing_ok=True)  # an earlier benchmark's record
                    cmd = [sys.executable, "-m", "bench.e2e",
                           *child_argv(argv, config=config, batch=batch, variant=variant.name, seed=seed, out=out)]
                    rc, timed_out = launch(cmd, out / "log.txt")
                    records = _records(out / "e2e.json")
                    if not records:
                        why = "timed out" if timed_out else f"exited with status {rc}"
                        records = [{"config": config, "batch": batch, "variant": variant.name, "seed": seed,
                                    "status": "error", "error": f"its process {why} without a record; see {out}/log.txt"}]
                    runs.raw.extend(records)
                    runs.results[:] = aggregate(runs.raw)
                    for rec in records:
                        if rec["status"] == "ok":
                            progress(t0, f"{config} b{batch} {variant.name} seed {seed} (own process): "
                                         f"{rec['step_ms_median']:.2f} ms/step")
                        else:
                            progress(t0, f"{config} b{batch} {variant.name} seed {seed}: {str(rec.get('error'))[:300]}")
                    on_run()


def _records(path: Path) -> list[dict[str, Any]]:
    """The run records a child wrote (none when it wrote no report)."""
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text())["runs"])
    except (ValueError, KeyError):
        return []
