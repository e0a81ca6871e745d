"""Weak scaling on 1 and 2 GPUs: step time, samples/s, scaling efficiency, all-to-all bytes.

For each config (``dlrm``: the main job's ``model=dlrm``; ``wukong``: the Wukong-style model
of bench.e2e) and each variant, the same per-GPU batch trains on 1 and on 2 GPUs, each job in
its own ``torchrun --standalone`` process group, one job after another. The jobs are composed
from ``conf/`` with hydra overrides by bench.e2e's :class:`~bench.e2e.variants.Composer` and
:func:`~bench.e2e.variants.job_overrides`, as ``launch/train.py`` composes them: synthetic data
(``data=synthetic``, 26 tables of 10k rows), table-wise sharding, the sparse-dist pipeline,
bf16 dense compute.

Variants (``--variants``, run in the order given; default ``bf16 loka_safe``), every one with
``trainer.compile_dense=true trainer.cuda_graphs=true``, the fastest single-GPU setting:

* ``bf16``: LoKA off, TorchRec's own FP32 embedding comms: the speed reference.
* ``loka_safe``, ``loka_aggressive``: ``loka=safe`` / ``loka=aggressive`` with the plans of a
  decision job. The presets' first re-plan comes at step 500 / 200 (``probe.interval``), past
  these short runs, so the timed job would only run the initial plans (high precision). As in
  bench.e2e, each LoKA job is therefore preceded by a *decision job* on the same number of
  processes: ``--decide-steps`` steps, not compiled, every site sampled every step, a re-plan
  every ``--decide-interval`` steps (:func:`bench.e2e.protocol.decide_overrides`), checkpointed at
  its end. The timed job builds fresh dense and embedding weights and loads only the LoKA
  callback's state from that checkpoint (each rank its own, through
  :func:`bench.e2e.protocol.decided_state`, as bench.e2e hands its timed runs the decision run's
  state): it starts on the decided plans, Probe windows and comm precisions. Each row records the
  decision job (wall time, plans, coverage) and the timed job's FP8 coverage
  (``loka/fp8_coverage``). ``loka_aggressive`` installs LoKA's codecs on 2 GPUs (its adaptive
  all-to-all starts at FP32; its first policy update, at step 200, is past the run).
* ``bf16_fp8comm``: LoKA's comm codecs only (no sites, Probe, Dispatch or guard; no SQNR
  sampling, ``loka.comm.sample_every=0``): the embedding all-to-all in FP8 both ways (e4m3
  forward, e5m2 backward, one fp32 scale per ``loka.comm.row_dim`` = embedding-dim values);
  dense gradients through the codec's DDP hook in FP32.
* ``bf16_fp32comm``: the same codecs at FP32: the bytes and the codec's own cost of the FP32
  all-to-all, the other side of ``bf16_fp8comm``.

Measured per job on every rank (rank 0's figures in the table): the median step time over the
timed steps after the warm-up (bench.e2e's ``StepClock``: CUDA events at step ends; on the CPU
the wall clock), samples/s (global: per-GPU batch x GPUs / median step), and, for the variants
that install LoKA's codecs, the bytes each rank hands the embedding all-to-all per step (what
the codec counts in ``encode``: its whole payload, own slice included; forward plus backward,
summed over ranks; 0 on 1 GPU, where there is nothing to communicate and LoKA installs no codec). Scaling efficiency = samples/s on 2 GPUs / (2 x samples/s on 1 GPU) of the
same config and variant. The train batches are generated once and cycled
(``data.cache_batches``), so the CPU generator does not bound the step; no NE is reported (the
runs are too short, and the batches repeat).

Time budget (2 x H100; each variant on 1 then 2 GPUs, the configs in turn): 20 warm-up + 40 timed
steps (the CUDA graphs are captured in the warm-up; 40 steps give a stable median, not a
resolution of a few percent) of 10-15 ms take about a second. A job's cost is its start (torchrun,
imports, sharding, the cached batches: about 30 s) and its compilation: cold, DLRM's ``bf16`` jobs
took about 45 s on 1 GPU and 43 s on 2 (the inductor cache on disk serves the 2-GPU job, whose
per-GPU shapes are the 1-GPU job's), ``bf16_fp8comm`` 36 s (``bf16``'s dense graphs cached);
LoKA's sites compile up to twice as long as bf16's, and a decision job (not compiled, 30 steps)
costs about a start. The default run (``dlrm``; ``bf16``, ``loka_safe``: 6 jobs) takes about 270 s
cold (estimated: 45 + 43 s ``bf16``, 2 x 35 s of decision jobs, about 60 + 50 s ``loka_safe``);
``loka_aggressive`` adds about 3 minutes, ``bf16_fp8comm`` about 1, and ``wukong`` about twice
DLRM's time per variant. A job running past ``--job-timeout`` is stopped and recorded as failed,
and scaling.json and scaling.md are rewritten after every job, so a run cut short (SIGTERM: the
running job is stopped and recorded) keeps what it measured.

A failed job is recorded with its error (first line of the failing rank's exception, else the end
of its log, ``<out>/<config>_<variant>_x<N>/log.txt``; a decision job's under
``<config>_<variant>_x<N>_decide/``) and the others go on; a LoKA variant whose decision job
failed is recorded as failed without its timed job. The exit status is then 1.

Run (2 GPUs):       python -m bench.scaling --out DIR
Dry run (CPU, gloo): python -m bench.scaling --dry-run --out /tmp/scaling
(tiny models, batch 64, 2 + 4 steps, decision jobs of 8 steps, eager: no compilation, no CUDA
graphs)
Merge:              python -m bench.scaling --merge DIR_1X2 DIR_4 --out DIR
(the rows of runs of one study measured in separate calls, e.g. ``--nprocs 1 2`` and ``--nprocs 4``
on the same machine kind, into one report with the ratios recomputed across them; runs no job.
The settings must agree, except ``nprocs`` and ``job_timeout_s``; a later run's row replaces an
earlier one of the same config, variant and GPU count)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench._procs import Terminated, run_child, terminating
from bench.e2e.measure import CATEGORY_NAMES, percentile
from bench.e2e.variants import CONFIGS, DATA, DRY_CONFIGS, DRY_DATA, Variant, job_overrides

REFERENCE = "bf16"
SCALED_CONFIGS = ("dlrm", "wukong")

_CODECS_ONLY = (
    "loka.enabled=true",
    "loka.mods.enabled=false",
    "loka.probe.enabled=false",
    "loka.dispatch.enabled=false",
    "loka.guard.enabled=false",
    "loka.comm_enabled=true",
    "loka.comm.sample_every=0",
)
"""LoKA with its comm codecs and nothing else (and no SQNR sampling on the timed steps)."""


def _a2a(precision: str) -> tuple[str, ...]:
    return (*_CODECS_ONLY, f"loka.comm.a2a_forward={precision}", f"loka.comm.a2a_backward={precision}")


VARIANTS: dict[str, Variant] = {
    "bf16": Variant(
        name="bf16", description="bf16, LoKA off, TorchRec's FP32 embedding comms (the speed reference)",
        compile=True, graphs=True,
    ),
    "loka_safe": Variant(
        name="loka_safe", description="conf/loka/safe.yaml from its decision job's plans (FP8 row-wise "
        "forward and input-gradient GEMMs where the Probe measured them safe and Dispatch predicts "
        "a gain; FP32 comms)",
        loka="safe", compile=True, graphs=True, decide=True,
    ),
    "loka_aggressive": Variant(
        name="loka_aggressive", description="conf/loka/aggressive.yaml from its decision job's plans (FP8 "
        "tensor- or row-wise, all three GEMMs, looser budgets; the adaptive all-to-all starts at FP32 "
        "and its first policy update is at step 200)",
        loka="aggressive", compile=True, graphs=True, decide=True,
    ),
    "bf16_fp8comm": Variant(
        name="bf16_fp8comm", description="bf16 + LoKA's codecs only: embedding all-to-all FP8 "
        "(e4m3 forward, e5m2 backward), dense gradients FP32 through the codec's DDP hook",
        loka_overrides=_a2a("FP8"), compile=True, graphs=True,
    ),
    "bf16_fp32comm": Variant(
        name="bf16_fp32comm", description="bf16 + LoKA's codecs only, all at FP32 (counts the FP32 "
        "all-to-all's bytes)",
        loka_overrides=_a2a("FP32"), compile=True, graphs=True,
    ),
}
DEFAULT_VARIANTS = ("bf16", "loka_safe")
"""Weak scaling of bf16 against LoKA, in this order: ``loka_safe``, the longest to compile,
last. The others by name (``--variants``); see the module docstring for the time each takes."""
DEFAULT_CONFIGS = ("dlrm",)
"""``wukong`` by name (``--configs``): its jobs take about twice DLRM's."""


def _progress(t0: float, msg: str) -> None:
    print(f"[scaling {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------ one job (a rank)
def run_job(job_dir: Path) -> int:
    """One job, on every rank that torchrun starts: trains as ``<job_dir>/job.json`` says and
    writes ``rank<r>.json`` (a timed job's step times and bytes, a decision job's plans), or
    ``error.rank<r>.txt`` and raises."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        spec = json.loads((job_dir / "job.json").read_text())
        result = _decide(spec, rank) if spec["role"] == "decide" else _measure(spec, rank)
    except Exception as exc:
        (job_dir / f"error.rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        raise
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def _decide(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """A LoKA decision job: trains with the decision run's Probe settings and checkpoints at its
    end (the overrides say both); returns the plans it decided."""
    from bench.e2e.protocol import loka_summary
    from bench.e2e.variants import Composer
    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime.trainer import Trainer

    with contextlib.ExitStack() as stack:
        job = Composer(stack).job(spec["overrides"])
    loka = LokaCallback(job.loka)
    trainer: Any = Trainer(model=job.model, data=job.data, trainer=job.trainer, callbacks=[loka])
    try:
        summary = trainer.fit()
        return {"rank": rank, "world_size": summary["world_size"], "steps": summary["steps"],
                "loka": loka_summary(loka, trainer)}
    finally:
        trainer.close()


def _load_decided(loka: Any, decided_from: Path, rank: int, world_size: int) -> dict[str, Any]:
    """Give `loka` the LoKA state of the decision job's checkpoint under `decided_from` (its
    ``trainer.out_dir``), as bench.e2e gives its timed runs the decision run's state: the
    callback's state only (the weights stay fresh), through ``decided_state``. Returns where it
    came from."""
    from bench.e2e.protocol import decided_state
    from loka_train.runtime.checkpoint import CheckpointManager, read_meta
    from loka_train.runtime.rundirs import find_checkpoint

    path = find_checkpoint(decided_from)
    if path is None:
        raise RuntimeError(f"the decision job wrote no checkpoint under {decided_from}")
    manager = CheckpointManager(path.parent, rank=rank, world_size=world_size, keep=1)
    states = [s["callbacks"][loka.name] for s in manager.rank_states(path)]
    # The decision job ran on as many processes; otherwise the callback merges, as on a resume.
    state = (states[rank] if len(states) == world_size
             else loka.merge_rank_states(states, rank=rank, world_size=world_size))
    loka.load_state_dict(decided_state(state))
    return {"checkpoint": str(path), "step": read_meta(path)["step"]}


def _gb_or_none(gb: float) -> float | None:
    """A memory figure for the JSON: None where there is none (NaN: not CUDA)."""
    return None if math.isnan(gb) else gb


def _measure(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch

    from bench.e2e.measure import StepClock
    from bench.e2e.protocol import loka_summary
    from bench.e2e.report import environment
    from bench.e2e.variants import Composer
    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime.trainer import Trainer

    with contextlib.ExitStack() as stack:
        job = Composer(stack).job(spec["overrides"])
    loka = LokaCallback(job.loka) if job.loka.enabled else None
    decided = None
    if spec.get("decided_from") is not None:
        assert loka is not None, "only LoKA variants have a decision job"
        decided = _load_decided(loka, Path(spec["decided_from"]), rank, int(os.environ.get("WORLD_SIZE", "1")))
    device = torch.device(job.trainer.device)
    profile_steps = spec["profile_steps"]
    clock = StepClock(warmup=spec["warmup"], timed=spec["steps"], profile_steps=profile_steps, device=device,
                      timing=spec["timing"], step_diag=profile_steps > 0)
    # The clock last: the other callbacks' step work falls inside the step it measures.
    trainer: Any = Trainer(model=job.model, data=job.data, trainer=job.trainer,
                           callbacks=[*([loka] if loka is not None else []), clock])
    try:
        summary = trainer.fit()
        times = clock.step_ms()
        if len(times) != spec["steps"]:
            raise RuntimeError(f"timed {len(times)} steps, expected {spec['steps']}")
        result: dict[str, Any] = {
            "rank": rank,
            "world_size": summary["world_size"],
            "step_ms": times,
            "train_loss": summary["train/loss"],
            "fallbacks": summary["fallbacks"],
            "compiled": summary.get("compiled", []),
            "cuda_graphs": summary.get("cuda_graphs"),
            # The clock resets the allocator's peak at every step end: its peak_gb() keeps the run's.
            "gpu_peak_allocated_gb": _gb_or_none(clock.peak_gb()[0]),
            "gpu_peak_reserved_gb": _gb_or_none(clock.peak_gb()[1]),
            "a2a_bytes_per_step": None,
            "decided_from": decided,
            # Host pauses a step may wait for where the step is host-bound (or waits on the host).
            "gc_pauses_ms": clock.gc_pauses_ms,
        }
        if profile_steps:
            from bench.e2e.measure import export_trace, summarize_profile

            # Every rank: the window after the timed steps, its GPU time by category, the host
            # side (operators, launches), and each timed step's host time.
            result["profile"] = summarize_profile(clock, statistics.median(times))
            result["step_host_ms"] = [d["host_ms"] for d in clock.step_diagnostics()]
            if rank == 0:
                result["trace"] = export_trace(clock.profile, Path(spec["job_dir"]), spec["config"], spec["batch"],
                                               spec["variant"])
        if loka is not None:
            result["fp8_coverage"] = summary["loka/fp8_coverage"]
            result["loka"] = loka_summary(loka, trainer, statistics.median(times))
        if loka is not None and loka.config.comm_enabled and loka.comm_state is None:
            # One process: LoKA installs no codec, TorchRec runs no all-to-all.
            result["a2a_bytes_per_step"] = {"a2a_fwd": 0.0, "a2a_bwd": 0.0}
            result["a2a_bytes_by_precision"] = {"a2a_fwd": {}, "a2a_bwd": {}}
            result["comm_fallbacks"] = []
        elif loka is not None and loka.comm_state is not None:
            report = loka.comm_state.report()
            channels = report["channels"]
            assert isinstance(channels, dict)
            # Per trained step: the pipeline shifts a batch's all-to-all into the step before, the
            # total does not move.
            result["a2a_bytes_per_step"] = {
                c: channels[c]["total_bytes"] / summary["steps"] for c in ("a2a_fwd", "a2a_bwd")
            }
            # What the codec really sent: a fallback to another precision shows here.
            result["a2a_bytes_by_precision"] = {c: channels[c]["bytes_by_precision"] for c in ("a2a_fwd", "a2a_bwd")}
            result["comm_fallbacks"] = report["fallbacks"]
        if rank == 0:
            result["env"] = environment(device.type)
        return result
    finally:
        clock.close()
        trainer.close()


# --------------------------------------------------------------------------- the jobs (parent)
def _launch(job_dir: Path, nproc: int, timeout_s: float) -> tuple[int | None, bool]:
    """Run one job under torchrun; returns (exit status, timed out)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "bench.scaling", "--job", str(job_dir)]
    return run_child(cmd, job_dir / "log.txt", timeout_s=timeout_s)


def _job_error(job_dir: Path, rc: int | None, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"timed out after {timeout_s:.0f} s (--job-timeout), stopped"
    for path in sorted(job_dir.glob("error.rank*.txt")):
        first = path.read_text().splitlines()[0]
        return f"rank {path.stem.removeprefix('error.rank')}: {first}"
    lines = [line for line in (job_dir / "log.txt").read_text(errors="replace").splitlines() if line.strip()]
    return f"exit status {rc}: " + " | ".join(lines[-6:])


def _row(spec: dict[str, Any], variant: Variant, job_dir: Path, rc: int | None, timed_out: bool,
         timeout_s: float, wall_s: float) -> dict[str, Any]:
    nproc = spec["nproc"]
    row: dict[str, Any] = {
        "config": spec["config"], "variant": variant.name, "description": variant.description,
        "nproc": nproc, "batch_per_gpu": spec["batch"], "global_batch": spec["batch"] * nproc,
        "wall_s": wall_s, "exit_status": rc, "overrides": spec["overrides"], "dir": str(job_dir),
    }
    paths = [job_dir / f"rank{r}.json" for r in range(nproc)]
    if timed_out or not all(p.exists() for p in paths):
        row.update(status="error", error=_job_error(job_dir, rc, timed_out, timeout_s))
        return row
    ranks = [json.loads(p.read_text()) for p in paths]
    r0 = ranks[0]
    times = r0["step_ms"]
    median = statistics.median(times)
    row.update(
        status="ok",
        step_ms_median=median,
        step_ms_p10=percentile(times, 0.1),
        step_ms_p90=percentile(times, 0.9),
        step_ms_median_by_rank=[statistics.median(r["step_ms"]) for r in ranks],
        step_ms=times,
        samples_per_s=spec["batch"] * nproc * 1000.0 / median,
        a2a_bytes_per_step=None,
        a2a_bytes_per_step_by_rank=[r["a2a_bytes_per_step"] for r in ranks],
        train_loss=r0["train_loss"],
        fallbacks=r0["fallbacks"],
        compiled=r0["compiled"],
        cuda_graphs=r0["cuda_graphs"],
        gpu_peak_allocated_gb=r0["gpu_peak_allocated_gb"],
        gpu_peak_reserved_gb=r0["gpu_peak_reserved_gb"],
        env=r0.get("env"),
    )
    # Older records have no GC figures: absent, not zero.
    if all("gc_pauses_ms" in r for r in ranks):
        row["gc_ms_per_step_by_rank"] = [sum(r["gc_pauses_ms"]) / len(r["step_ms"]) for r in ranks]
    if "profile" in r0:
        row["profile_by_rank"] = [r["profile"] for r in ranks]
        row["step_host_ms_median_by_rank"] = [statistics.median(r["step_host_ms"]) if r["step_host_ms"] else None
                                              for r in ranks]
        row["trace"] = r0.get("trace")
    if "loka" in r0:
        row.update(fp8_coverage=r0["fp8_coverage"], loka=r0["loka"], decided_from=r0["decided_from"])
    if all(r["a2a_bytes_per_step"] is not None for r in ranks):
        row["a2a_bytes_per_step"] = sum(sum(r["a2a_bytes_per_step"].values()) for r in ranks)
        row["a2a_bytes_by_precision_rank0"] = r0["a2a_bytes_by_precision"]
        row["comm_fallbacks"] = [f for r in ranks for f in r["comm_fallbacks"]]
    if rc != 0:  # every rank wrote its results: the measurement is whole; say how it ended
        row["note"] = f"exit status {rc} after every rank wrote its results"
    return row


def _decision(spec: dict[str, Any], job_dir: Path, rc: int | None, timed_out: bool, timeout_s: float,
              wall_s: float) -> dict[str, Any]:
    """A decision job's record: its wall time and rank 0's decided plans, or its error."""
    rec: dict[str, Any] = {"steps": spec["steps"], "wall_s": wall_s, "exit_status": rc,
                           "overrides": spec["overrides"], "dir": str(job_dir)}
    paths = [job_dir / f"rank{r}.json" for r in range(spec["nproc"])]
    if timed_out or not all(p.exists() for p in paths):
        return {**rec, "status": "error", "error": _job_error(job_dir, rc, timed_out, timeout_s)}
    loka = json.loads(paths[0].read_text())["loka"]
    return {**rec, "status": "ok", "fp8_coverage": loka["fp8_coverage"], "plan_changes": loka["plan_changes"],
            "plans": loka["plans"]}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency (samples/s on N GPUs / (N x samples/s on 1 GPU), same config and
    variant) and speed against the reference variant (same config and GPUs), where both ran."""
    ok = {(r["config"], r["variant"], r["nproc"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        r["scaling_efficiency"] = r["speed_vs_" + REFERENCE] = None
        if r["status"] != "ok":
            continue
        one = ok.get((r["config"], r["variant"], 1))
        if r["nproc"] > 1 and one is not None:
            r["scaling_efficiency"] = r["samples_per_s"] / (r["nproc"] * one["samples_per_s"])
        ref = ok.get((r["config"], REFERENCE, r["nproc"]))
        if ref is not None:
            r["speed_vs_" + REFERENCE] = r["samples_per_s"] / ref["samples_per_s"]


def bound_by(host_ms: float | None, step_ms: float | None) -> str:
    """What bounds a rank's step: ``host`` where the host's median time per step is within 5% of
    the step's median (the GPU waits for the host: GPU work saved does not shorten the step),
    else ``GPU``; ``-`` without both figures.

    >>> bound_by(9.69, 9.71), bound_by(6.1, 9.7), bound_by(None, 9.7)
    ('host', 'GPU', '-')
    """
    if host_ms is None or step_ms is None:
        return "-"
    return "host" if host_ms >= 0.95 * step_ms else "GPU"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _merged_from_lines(report: dict[str, Any]) -> list[str]:
    if "merged_from" not in report:
        return []
    lines = ["Merged from:", ""]
    lines += [f"- `{src['path']}` ({src['gpu']}; GPUs {' '.join(map(str, src['nprocs']))}): `{src['command']}`"
              for src in report["merged_from"]]
    return [*lines, ""]


def render(report: dict[str, Any]) -> str:
    """scaling.md: the settings, the table, the failed jobs."""
    env, s = report["env"], report["settings"]
    rows = report["rows"]
    lines = [
        f"# Weak scaling on {' and '.join(map(str, s['nprocs']))} GPUs ({env.get('gpu', '?')})", "",
        f"Command: `{report['command']}`", "",
        *_merged_from_lines(report),
        f"GPU: {env.get('gpu', '?')} ({env.get('capability', '-')}); torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, torchrec {env.get('torchrec')}, fbgemm_gpu {env.get('fbgemm_gpu')}, triton "
        f"{env.get('triton')}, python {env.get('python')}; host {env.get('host')}.", "",
        f"Per-GPU batch {s['batch']} (weak scaling: the global batch grows with the GPUs), "
        f"{s['warmup']} warm-up + {s['steps']} timed steps, median of the timed steps on rank 0 "
        f"({s['timing']}), {s['cache_batches']} cached synthetic train batches cycled "
        f"(data.cache_batches), table-wise sharding, sparse-dist pipeline, {s['device']}"
        f"{'' if s['compile'] else ', eager (dry run: no compilation, no CUDA graphs)'}. LoKA variants: "
        f"a decision job of {s['decide_steps']} steps first (every site sampled every step, probe interval "
        f"{s['decide_interval']}, not compiled), then the timed job from fresh weights with the decided LoKA "
        "state.", "",
        "| config | variant | GPUs | step ms (median) | p10-p90 | samples/s (global) | vs bf16 | "
        "scaling eff. | a2a MB/step | FP8 GEMMs | decision s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        spread = f"{r['step_ms_p10']:.2f}-{r['step_ms_p90']:.2f}" if ok else "-"
        mb = r.get("a2a_bytes_per_step")
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['nproc']} | {_fmt(r.get('step_ms_median'), '.2f')} | {spread} | "
            f"{_fmt(r.get('samples_per_s'), ',.0f')} | {_fmt(r.get('speed_vs_' + REFERENCE), '.2f', 'x')} | "
            f"{_fmt(r.get('scaling_efficiency'), '.0%')} | {_fmt(None if mb is None else mb / 1e6, '.2f')} | "
            f"{_fmt(r.get('fp8_coverage'), '.0%')} | {_fmt(r.get('decide', {}).get('wall_s'), '.1f')} | "
            f"{r['status']} |"
        )
    profiled = [r for r in rows if r.get("profile_by_rank")]
    if profiled:
        lines += ["", f"Profile of {s.get('profile_steps')} steps after the timed ones, per rank (torch.profiler; "
                  "GPU ms a step by kernel category, the GPU's busy share of the median step, the host's "
                  "operator time and aten calls a step; host ms: median host time of a timed step; bound: "
                  "`host` where that is within 5% of the rank's median step, so the GPU waits for the host "
                  "and GPU work saved does not shorten the step):", "",
                  "| config | variant | GPUs | rank | busy | gemm | quantize | embedding | memcpy | other | "
                  "host op ms | aten calls | host ms | GC ms | bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            gc_ms = r.get("gc_ms_per_step_by_rank") or [None] * r["nproc"]
            for rank, (prof, host_ms, gc_rank) in enumerate(zip(r["profile_by_rank"], r["step_host_ms_median_by_rank"],
                                                                 gc_ms)):
                cats = prof["categories"]
                lines.append(
                    f"| {r['config']} | {r['variant']} | {r['nproc']} | {rank} | {_fmt(prof['busy_fraction'], '.0%')} | "
                    + " | ".join(_fmt(cats[c]["ms_per_step"], ".2f") for c in CATEGORY_NAMES)
                    + f" | {_fmt(prof['host_self_cpu_ms_per_step'], '.2f')} | {prof['host_aten_calls_per_step']:.0f} | "
                    f"{_fmt(host_ms, '.2f')} | {_fmt(gc_rank, '.3f')} | "
                    f"{bound_by(host_ms, r['step_ms_median_by_rank'][rank])} |"
                )
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed jobs:", ""]
        lines += [f"- {r['config']} {r['variant']} x{r['nproc']}: {r['error']} ({r['dir']}/log.txt)" for r in failed]
    notes = [r for r in rows if r.get("note")]
    lines += [f"- {r['config']} {r['variant']} x{r['nproc']}: {r['note']}" for r in notes]
    lines += ["", "Variants:", ""]
    lines += [f"- `{name}`: {desc}" for name, desc in report["variants"].items()]
    lines += [
        "",
        "Scaling efficiency: samples/s on N GPUs / (N x samples/s on 1 GPU), same config and variant "
        "(1.0: perfect weak scaling). a2a MB/step: bytes the embedding all-to-all's codec encodes "
        "per step, forward + backward, summed over ranks, each rank's whole payload (its own slice "
        "included); 0 on 1 GPU, where there is nothing to communicate (LoKA installs no codec). "
        "Only variants that install LoKA's codecs count them (`-` otherwise). FP8 GEMMs: the share of "
        "LoKA's GEMMs in FP8 at the end of the timed job (`loka/fp8_coverage`). decision s: the "
        "decision job's wall time (its start included).",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ --merge
MERGE_FREE_SETTINGS = ("nprocs", "job_timeout_s")
"""The settings that may differ between the runs ``--merge`` joins; any other difference (batch,
steps, device, ...) would put rows measured differently in one table, so the merge is refused."""

_REPORT_KEYS = ("command", "env", "settings", "variants", "rows")


def load_report(out_dir: Path) -> dict[str, Any]:
    """``<out_dir>/scaling.json``; ValueError naming the path when it is missing or no scaling report."""
    path = out_dir / "scaling.json"
    if not path.is_file():
        raise ValueError(f"--merge: {path} not found (is {out_dir} the --out of a bench.scaling run?)")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--merge: {path} is not JSON: {e}") from e
    missing = [k for k in _REPORT_KEYS if k not in report] if isinstance(report, dict) else list(_REPORT_KEYS)
    if missing:
        raise ValueError(f"--merge: {path} is no bench.scaling report (no {', '.join(missing)})")
    return report


def merge_reports(sources: list[tuple[Path, dict[str, Any]]], command: str) -> tuple[dict[str, Any], list[str]]:
    """One report from the reports of several runs (``(path, report)``, in the order given) and
    the lines to print about it.

    The rows are concatenated, a later report's row replacing an earlier one of the same config,
    variant and GPU count (a line says so), ordered by config and variant (as first seen), then
    GPUs, and the ratios are recomputed over all of them (:func:`add_ratios`: the 4-GPU row of one
    run against the 1-GPU row of another). Settings: the first report's, ``nprocs`` the union;
    a setting other than :data:`MERGE_FREE_SETTINGS` that differs raises ValueError naming it and
    both values. ``merged_from`` records each source's path, GPU, process counts and command (a
    source that was itself merged contributes its own sources).

    Example::

        report, notes = merge_reports([(Path("a/scaling.json"), load_report(Path("a"))),
                                       (Path("b/scaling.json"), load_report(Path("b")))],
                                      "python -m bench.scaling --merge a b --out c")
    """
    assert sources, "nothing to merge"
    (first_path, first), *later = sources
    for path, report in later:
        a, b = first["settings"], report["settings"]
        for key in dict.fromkeys([*a, *b]):
            va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")  # an older report may lack a setting
            if key not in MERGE_FREE_SETTINGS and va != vb:
                raise ValueError(
                    f"--merge: setting {key!r} differs: {va!r} in {first_path}, {vb!r} in {path}; rows measured "
                    f"with different settings are not comparable (only {', '.join(MERGE_FREE_SETTINGS)} may differ)")
    notes: list[str] = []
    by_key: dict[tuple[str, str, int], dict[str, Any]] = {}
    origin: dict[tuple[str, str, int], Path] = {}
    merged_from: list[dict[str, Any]] = []
    for path, report in sources:
        for row in report["rows"]:
            key = (row["config"], row["variant"], row["nproc"])
            if key in by_key:
                notes.append(f"{key[0]} {key[1]} x{key[2]}: the row of {path} replaces the row of {origin[key]}")
            by_key[key], origin[key] = row, path
        merged_from += report.get("merged_from") or [{
            "path": str(path), "gpu": report["env"].get("gpu", "?"), "nprocs": report["settings"]["nprocs"],
            "command": report["command"],
        }]
    gpus = list(dict.fromkeys(src["gpu"] for src in merged_from))
    if len(gpus) > 1:
        notes.append(f"warning: the runs were measured on different GPUs ({', '.join(gpus)}): the ratios "
                     "across them compare machines, not GPU counts")
    configs = list(dict.fromkeys(k[0] for k in by_key))
    variants = list(dict.fromkeys(k[1] for k in by_key))
    rows = [by_key[k] for k in sorted(by_key, key=lambda k: (configs.index(k[0]), variants.index(k[1]), k[2]))]
    add_ratios(rows)
    merged = {
        "command": command,
        "merged_from": merged_from,
        "env": first["env"],
        "settings": {**first["settings"],
                     "nprocs": sorted({n for _, report in sources for n in report["settings"]["nprocs"]})},
        "variants": {name: desc for _, report in sources for name, desc in report["variants"].items()},
        "rows": rows,
    }
    return merged, notes


def _merge(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Write ``--out``'s scaling.json and scaling.md from the ``--merge`` runs' reports."""
    command = "python -m bench.scaling " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        sources = [(d / "scaling.json", load_report(d)) for d in args.merge]
        report, notes = merge_reports(sources, command)
    except ValueError as e:
        _parser().error(str(e))
    for note in notes:
        print(note, flush=True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    text = render(report)
    (out / "scaling.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "scaling.md").write_text(text)
    print(text, flush=True)
    print(f"wrote {out}/scaling.md and scaling.json: {len(report['rows'])} rows from {len(sources)} runs", flush=True)
    return 0


# ------------------------------------------------------------------------------ command line
_JOB_OPTIONS = ("nprocs", "configs", "variants", "batch", "warmup", "steps", "cache_batches", "decide_steps",
                "decide_interval", "job_timeout", "profile_steps", "dry_run")
"""The options of a run of jobs, which ``--merge`` (no jobs) refuses."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path,
                   help="directory for scaling.json, scaling.md and one folder per job (--merge: the merged report)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                   help="merge the reports DIR/scaling.json of earlier runs into --out's; runs no job")
    p.add_argument("--nprocs", type=int, nargs="+", default=None, help="processes (GPUs) per job (default 1 2)")
    p.add_argument("--configs", nargs="+", default=None, choices=SCALED_CONFIGS,
                   help=f"of {', '.join(SCALED_CONFIGS)} (default {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"of {', '.join(VARIANTS)} (default {' '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--batch", type=int, default=None, help="per-GPU batch (default 8192; dry run 64)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; dry run 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 40; dry run 4)")
    p.add_argument("--cache-batches", type=int, default=None, help="distinct train batches, cycled (default 16; dry run 4)")
    p.add_argument("--decide-steps", type=int, default=None,
                   help="steps of a LoKA variant's decision job (default 30; dry run 8)")
    p.add_argument("--decide-interval", type=int, default=None,
                   help="probe interval of the decision job (default 5; dry run 2)")
    p.add_argument("--job-timeout", type=float, default=None, help="seconds one job may run (default 180)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="profile this many steps after the timed ones on every rank (torch.profiler): the GPU "
                        "time by category and the host side in each rank's record and the row, rank 0's trace "
                        "in the job's folder, and every timed step's host time (read from the allocator's "
                        "counters at every step end: runs with and without a profile are not merged) "
                        "(default 0: no profile)")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny models, eager")
    p.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.job is not None:
        return args
    if args.out is None:
        p.error("--out DIR is required")
    if args.merge is not None:
        given = [f"--{name.replace('_', '-')}" for name in _JOB_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            p.error(f"--merge runs no job: drop {' '.join(given)}")
        if any(d.resolve() == args.out.resolve() for d in args.merge):
            p.error(f"--out {args.out} is one of the --merge runs: its scaling.json would be overwritten; "
                    "write the merged report to a new directory")
        return args
    for name, default in (("nprocs", [1, 2]), ("configs", list(DEFAULT_CONFIGS)),
                          ("variants", list(DEFAULT_VARIANTS)), ("job_timeout", 180.0), ("profile_steps", 0)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    dry = args.dry_run
    for name, gpu, cpu in (("batch", 8192, 64), ("warmup", 20, 2), ("steps", 40, 4), ("cache_batches", 16, 4),
                           ("decide_steps", 30, 8), ("decide_interval", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if dry else gpu)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if any(n < 1 for n in args.nprocs) or len(set(args.nprocs)) != len(args.nprocs):
        p.error(f"--nprocs {args.nprocs}: distinct process counts >= 1")
    args.device = "cpu" if dry else "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every job, one after another; 0 when all succeeded, 1 when a job failed (recorded,
    the others run), 2 without the GPUs asked for. With ``--merge``: merge the reports, 0."""
    args = parse_args(argv)
    if args.job is not None:
        return run_job(args.job)
    if args.merge is not None:
        return _merge(args, argv)
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < max(args.nprocs):
        print(f"error: {max(args.nprocs)} GPUs asked for, {torch.cuda.device_count()} visible; "
              "use --dry-run on a CPU", file=sys.stderr)
        return 2
    with terminating():
        return _run_all(args, argv)


def _run_all(args: argparse.Namespace, argv: list[str] | None) -> int:
    from bench.e2e.protocol import decide_overrides
    from bench.e2e.report import environment
    from bench.e2e.variants import Composer

    t0 = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    configs, data = (DRY_CONFIGS, DRY_DATA) if args.dry_run else (CONFIGS, DATA)
    variants = [VARIANTS[v] for v in args.variants]
    if args.dry_run:
        variants = [replace(v, compile=False, graphs=False) for v in variants]
    with contextlib.ExitStack() as stack:
        composer = Composer(stack)
        dims = {c: composer.job([*configs[c], *data]).model.embedding_dim for c in args.configs}
        # The variants whose LoKA installs the comm codecs (on several processes): one scale per
        # embedding row (loka.comm.row_dim must divide every slice of the all-to-all).
        codecs = {v.name for v in variants
                  if composer.job([*data, f"loka={v.loka}", *v.loka_overrides]).loka.comm_enabled}
    # job_overrides' arguments; the dry run has no compilation and no graphs.
    e2e_args = argparse.Namespace(dry_run=args.dry_run, cache_batches=args.cache_batches, device=args.device,
                                  compile_backend="inductor")
    report: dict[str, Any] = {
        "command": "python -m bench.scaling " + shlex.join(sys.argv[1:] if argv is None else argv),
        "env": environment("cpu"),  # versions; the GPU's name comes from the jobs
        "settings": {"nprocs": args.nprocs, "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
                     "cache_batches": args.cache_batches, "device": args.device,
                     "timing": "CUDA events" if args.device == "cuda" else "wall clock",
                     "compile": not args.dry_run, "job_timeout_s": args.job_timeout,
                     "decide_steps": args.decide_steps, "decide_interval": args.decide_interval,
                     "profile_steps": args.profile_steps},
        "variants": {v.name: v.description for v in variants},
        "rows": [],
    }
    rows: list[dict[str, Any]] = report["rows"]

    def write() -> str:
        add_ratios(rows)
        gpu_env = next((r["env"] for r in rows if r.get("env")), None)
        if gpu_env is not None:
            report["env"] = gpu_env
        text = render(report)
        (out / "scaling.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "scaling.md").write_text(text)
        return text

    def launch(job_dir: Path, spec: dict[str, Any]) -> tuple[int | None, bool, float]:
        """Run one job; SIGTERM records it as stopped (and the report is written) first."""
        job_dir.mkdir(parents=True, exist_ok=True)
        for stale in (*job_dir.glob("rank*.json"), *job_dir.glob("error.rank*.txt")):
            stale.unlink()
        (job_dir / "job.json").write_text(json.dumps(spec, indent=1))
        started = time.perf_counter()
        try:
            rc, timed_out = _launch(job_dir, spec["nproc"], args.job_timeout)
        except Terminated:
            what = "its decision job was" if spec["role"] == "decide" else "the benchmark was"
            rows.append({"config": spec["config"], "variant": spec["variant"], "nproc": spec["nproc"],
                         "status": "error", "error": f"stopped: {what} terminated (SIGTERM)", "dir": str(job_dir),
                         "overrides": spec["overrides"], "wall_s": time.perf_counter() - started})
            write()
            raise
        return rc, timed_out, time.perf_counter() - started

    num_jobs = len(args.configs) * len(args.nprocs) * sum(2 if v.decide else 1 for v in variants)
    _progress(t0, f"{num_jobs} jobs, batch {args.batch}/GPU, {args.warmup} + {args.steps} steps, {args.device}")
    for config in args.configs:
        for variant in variants:
            extra = (f"loka.comm.row_dim={dims[config]}",) if variant.name in codecs else ()
            for nproc in args.nprocs:
                name = f"{config} {variant.name} x{nproc}"
                job_dir = out / f"{config}_{variant.name}_x{nproc}"
                common = {"config": config, "variant": variant.name, "nproc": nproc, "batch": args.batch}
                decision: dict[str, Any] | None = None
                if variant.decide:
                    # As bench.e2e decides: eagerly (the plans do not depend on compilation),
                    # every site sampled every step; the checkpoint at its end holds the decisions.
                    decide_dir = out / f"{config}_{variant.name}_x{nproc}_decide"
                    dspec = {**common, "role": "decide", "steps": args.decide_steps, "overrides": job_overrides(
                        e2e_args, config, args.batch, replace(variant, compile=False), str(decide_dir / "run"),
                        steps=args.decide_steps, eval_batches=1,
                        extra=(*decide_overrides(args.decide_interval), *extra), checkpoint_at_end=True)}
                    _progress(t0, f"{name}: decision job ({args.decide_steps} steps)")
                    rc, timed_out, wall_s = launch(decide_dir, dspec)
                    decision = _decision(dspec, decide_dir, rc, timed_out, args.job_timeout, wall_s)
                if decision is not None and decision["status"] != "ok":
                    rows.append({**common, "description": variant.description, "status": "error",
                                 "error": f"decision job: {decision['error']}", "dir": decision["dir"],
                                 "overrides": decision["overrides"], "wall_s": decision["wall_s"],
                                 "decide": decision})
                    write()
                    _progress(t0, f"{name}: decision job FAILED ({decision['wall_s']:.1f} s): {decision['error']}")
                    continue
                if decision is not None:
                    _progress(t0, f"{name}: decided FP8 {decision['fp8_coverage']:.0%} of GEMMs, "
                                  f"{decision['plan_changes']} plan changes ({decision['wall_s']:.1f} s)")
                spec = {
                    **common, "role": "timed", "warmup": args.warmup, "steps": args.steps,
                    "profile_steps": args.profile_steps, "job_dir": str(job_dir),
                    "timing": "events" if args.device == "cuda" else "sync",
                    "decided_from": None if decision is None else str(Path(decision["dir"]) / "run"),
                    "overrides": job_overrides(e2e_args, config, args.batch, variant, str(job_dir / "run"),
                                               steps=args.warmup + args.steps + args.profile_steps,
                                               eval_batches=1, extra=extra),
                }
                _progress(t0, f"{name}: start")
                rc, timed_out, wall_s = launch(job_dir, spec)
                row = _row(spec, variant, job_dir, rc, timed_out, args.job_timeout, wall_s)
                if decision is not None:
                    row["decide"] = decision
                rows.append(row)
                write()
                if row["status"] == "ok":
                    mb = row["a2a_bytes_per_step"]
                    eff = row["scaling_efficiency"]
                    cov = row.get("fp8_coverage")
                    _progress(t0, f"{name}: {row['step_ms_median']:.2f} ms/step, {row['samples_per_s']:,.0f} samples/s"
                                  + (f", efficiency {eff:.0%}" if eff is not None else "")
                                  + (f", a2a {mb / 1e6:.2f} MB/step" if mb is not None else "")
                                  + (f", FP8 {cov:.0%} of GEMMs" if cov is not None else "")
                                  + f" ({row['wall_s']:.1f} s)")
                else:
                    _progress(t0, f"{name}: FAILED ({row['wall_s']:.1f} s): {row['error']}")
    text = write()
    print(text, flush=True)
    failed = sum(r["status"] != "ok" for r in rows)
    _progress(t0, f"wrote {out}/scaling.md and scaling.json: {len(rows)} rows, {failed} failed")
    return 1 if failed else 0

if __name__ == "__main__":
    raise SystemExit(main())
