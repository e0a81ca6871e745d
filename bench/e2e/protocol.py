"""How the benchmark runs its variants: data, runs, warm runs, rotated rounds and the NE protocol.

Every run is a real ``Trainer`` job, world size 1, all in this one process, one after another
(:func:`run_grid`). The train and eval batches are generated once per (config, batch) and
shared by every run (:func:`shared_datasets`). A LoKA variant first runs a decision run, then
its timed run from fresh weights (or both from a shared checkpoint) with the decided state
(:func:`run_one`). ``--repeats N``
runs N rounds whose variant order rotates, round i with ``trainer.seed=i`` for every variant
(:func:`run_order`), so that runs of the same seed pair up; :func:`aggregate` folds each
variant's rounds into one record. The NE protocol: ``--ne-steps`` trains past the timed window
before the eval NE, ``--ne-from`` continues a shared per-seed checkpoint
(:func:`base_checkpoint`), ``--ne-decay`` decays both rates at the end (:func:`decay_overrides`).
``--warm-run`` runs the first variant once before the measured runs (:func:`warm_run`).

Example:
    >>> from bench.e2e.variants import resolve_variants
    >>> [(v.name, i) for v, i in run_order(resolve_variants(["bf16", "loka_safe"], "emulated"), 2)]
    [('bf16', 0), ('loka_safe', 0), ('loka_safe', 1), ('bf16', 1)]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import json
import logging
import math
import os
import re
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.e2e.measure import (
    StepClock,
    export_trace,
    percentile,
    rss_gb,
    start_memory_trace,
    summarize_profile,
)
from bench.e2e.variants import REFERENCE, Composer, TorchaoFloat8, Variant, job_overrides
from bench.e2e.verdicts import fmt_pct, fmt_x
from loka_train.runtime.callbacks import Callback

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the data
class _MemoSplit:
    """A dataset whose batches are generated once and then served from memory."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.feature_names = source.feature_names
        self.num_embeddings_per_feature = source.num_embeddings_per_feature
        self.num_dense = source.num_dense
        self._memo: dict[int, Any] = {}

    def batch(self, step: int) -> Any:
        if step not in self._memo:
            self._memo[step] = self.source.batch(step)
        return self._memo[step]

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Any]:
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch(step)
            step += 1


def generate_batches(dataset: Any, n: int, workers: int | None = None) -> None:
    """Batches ``0 .. n-1`` of `dataset` (a shared dataset, which keeps what it generates),
    generated on `workers` threads (default: the cores this process may run on, at most 16),
    each op on one intra-op thread: the batches side by side instead of each op's elements, so
    the parallelism does not depend on how well the generator's many small ops split. A batch
    of the synthetic data (the benchmark's) is a pure function of its step: they are the
    batches one after another would give."""
    import concurrent.futures

    if workers is None:
        workers = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            for _ in pool.map(dataset.batch, range(n)):
                pass
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def shared_datasets() -> Iterator[Any]:
    """Trainers built inside share one dataset object per (data config, split, batch size).

    Building the synthetic data (schema, teacher, bias calibration) takes seconds per split,
    and every variant would also regenerate the same cached train batches and eval batches.
    The data is a pure function of these keys, so sharing the objects changes nothing the
    runs see; it only takes the set-up out of the benchmark's wall time. Yields the factory.
    """
    import loka_train.runtime.trainer as trainer_module

    original = trainer_module.make_dataset
    memo: dict[tuple[Any, ...], Any] = {}

    def make(cfg: Any, *, split: str, rank: int, world_size: int, batch_size: int) -> Any:
        key = (repr(cfg), split, rank, world_size, batch_size)
        if key not in memo:
            ds = original(cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size)
            # The train split caches its batches itself (data.cache_batches).
            memo[key] = ds if split == "train" and cfg.cache_batches else _MemoSplit(ds)
        return memo[key]

    trainer_module.make_dataset = make  # type: ignore[assignment]
    try:
        yield make
    finally:
        trainer_module.make_dataset = original


# ------------------------------------------------------------------------- the runs
def forwards_high_ne(trainer: Any, sites: dict[str, Any]) -> float:
    """The trained model's eval NE with every site's forward GEMM in high precision (its
    backward plans kept, every plan restored after: ``mods.forwards_high``): of what a LoKA
    run's NE gives up, the part its FP8 forwards cost at evaluation, apart from what FP8 changed
    in the training itself."""
    from loka_train.mods import forwards_high

    with forwards_high(sites):
        return float(trainer.evaluate()["eval/ne"])


def loka_summary(cb: Any, trainer: Any, step_ms: float | None = None) -> dict[str, Any]:
    """FP8 coverage and the GEMMs left in high precision (with why) of a LoKA callback, and its
    ledger (``--ledger``) with predictions against ``step_ms``, the run's median timed step
    (the callback's own figure is the mean over the whole run, set-up and evaluations included)."""
    report = cb.report(trainer)
    high = []
    num_gemms = 0
    for site, roles in report["sites"].items():
        for role, entry in roles.items():
            num_gemms += 1
            if not entry["plan"].lower().startswith("fp8"):
                high.append(f"{site}/{role}: {entry['why']}")
    mods_report = next(
        (m.loka_mods_report for m in trainer.model.modules() if hasattr(m, "loka_mods_report")), None
    )
    not_sites = dict(mods_report.skipped) if mods_report is not None else {}
    return {
        "fp8_coverage": report["fp8_coverage"],
        "num_sites": len(report["sites"]),
        "num_gemms": num_gemms,
        "num_fp8_gemms": num_gemms - len(high),
        "high_gemms": high,
        "not_sites": {k: v for k, v in not_sites.items() if "embedding" not in v},
        "mods_fallbacks": list(mods_report.fallbacks) if mods_report is not None else [],
        # Sites that apply the ReLU before them (mods.fold_relu); it saves a pass where the
        # site's forward casts tensor-wise.
        "folded_relus": list(getattr(mods_report, "folded_relus", [])),
        "plan_changes": report["plan_changes"],
        # The Probe's measurement graphs: each new shape's capture syncs the device once.
        "probe_cuda_graphs": report["probe"]["cuda_graphs"],
        "guard_trips": len(report["guard_trips"]),
        "fallbacks": report["fallbacks"],
        # mods.static_scales: each tensor-wise operand's slot and its recasts.
        "static_scales": report.get("static_scales", []),
        "plans": {
            site: {role: e["plan"] for role, e in roles.items()} for site, roles in report["sites"].items()
        },
        # The Probe's low-quantile SQNR of each FP8 GEMM's plan, against its floor.
        "fp8_sqnr_db": {
            f"{site}/{role}": {"sqnr_lo_db": e["sqnr_lo_db"], "budget_db": e["budget_db"]}
            for site, roles in report["sites"].items() for role, e in roles.items() if "sqnr_lo_db" in e
        },
        "ledger": None if cb.ledger is None else cb.ledger.to_dict(step_ms or cb.step_ms),
    }


class _StartStep(Callback):
    """The step a run starts at (a resumed run: its checkpoint's)."""

    step: int | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.step = trainer.step


def decide_overrides(interval: int) -> tuple[str, ...]:
    """The decision run's Probe over the preset's: every site sampled on every step, a re-plan
    every `interval` steps, so that a short run reaches the plans a long one would."""
    return ("loka.probe.every_k_steps=1", "loka.probe.sites_per_step=null", f"loka.probe.interval={interval}")


SHARED_DECISION_OVERRIDES = (
    "loka.mods.static_scales=true", "loka.mods.static_scales=false", "loka.mods.fold_relu=false",
    "loka.mods.relu_mask_bits=true", "loka.mods.relu_mask_bits=false", "loka.mods.fold_relu_grad=true",
    "loka.mods.dcn_tail_in_gemm=true", "loka.mods.dcn_tail_in_gemm=false", "loka.probe.sites_per_step=2",  # the decision run samples every site whatever the schedule
)
"""Overrides that change how a plan runs: ``--share-decisions`` lets variants that differ in
them share one decision run, so that they compare on the same plans. Those plans are what
Dispatch picked with the deciding variant's timings (static scales make tensor-wise candidates
cheaper to quantize): the variant listed first decides. A timed run re-plans at the preset's
interval, with its own timings."""


def decision_key(config: str, batch: int, seed: int | None, variant: Variant) -> tuple[Any, ...]:
    """What a decision run depends on: the job, the seed (None: ``--decide-once``, every seed
    takes the first seed's decision), the preset and its overrides (less
    :data:`SHARED_DECISION_OVERRIDES`), and whether Dispatch times candidates graph-replayed
    (``+graphs``); not ``+compile`` (the decision runs eagerly) nor ``+pageable``."""
    overrides = tuple(o for o in variant.loka_overrides if o not in SHARED_DECISION_OVERRIDES)
    return (config, batch, seed, variant.loka, overrides, variant.graphs)


def decided_state(state: dict[str, Any]) -> dict[str, Any]:
    """What a timed run takes of a decision run's LoKA state (``LokaCallback.state_dict()``):
    the Probe's windows and verdicts, Dispatch's plans and history, the comm precisions. The
    timed run starts again from fresh weights (or the checkpoint the decision run resumed), so
    the quality guard, the plan timeline and the dense-gradient error-feedback residuals
    (rounding of the decision run's gradients) do not carry over."""
    return {**state, "guard": {"best_ne": None, "cooldown": 0, "trips": []}, "timeline": [], "compressors": []}


def decision_file(directory: str | Path, args: argparse.Namespace, config: str, batch: int, seed: int | None,
                  variant: Variant) -> Path:
    """Where ``--decisions DIR`` keeps the decided state of one decision run: a file named by a
    hash of everything the decision depends on (:func:`decision_key`, and every override
    unless ``--share-decisions`` lets variants share it, the decision run's length, interval
    and starting checkpoint), with that key readable in a ``.json`` beside it."""
    key = decision_key(config, batch, seed, variant)
    if not args.share_decisions:
        key = (*key, tuple(variant.loka_overrides))
    key = (*key, args.decide_steps, args.decide_interval, args.ne_from)
    digest = hashlib.sha1(json.dumps(key, default=str).encode()).hexdigest()[:16]
    return Path(directory) / f"{config}_b{batch}_{variant.loka}_{digest}.pt"


def load_decision(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The (decision record, decided state) saved at `path`, or None where there is none."""
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return saved["decide"], saved["state"]


def save_decision(path: Path, decide_rec: dict[str, Any], state: dict[str, Any], key_text: str) -> None:
    """Write a decided state for :func:`load_decision` (atomically: a run cut short leaves none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"decide": decide_rec, "state": state}, tmp)
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps({"key": key_text, "decide": decide_rec}, indent=1) + "\n")


def cleanup(device_type: str) -> None:
    """Free what a run left: its compiled graphs and the GPU memory it cached."""
    import torch._dynamo

    # The next run's modules share these code objects: without a reset their recompilations
    # would pile up against dynamo's recompile limit, then run eagerly.
    torch._dynamo.reset()
    # After the reset: dynamo's cache entries can keep the compiled modules (and so their
    # parameters, optimizer state and embedding tables on the GPU) reachable until then.
    gc.collect()
    if device_type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError as exc:  # a sticky CUDA error: later runs will fail and say so
            logger.error("GPU clean-up failed: %s", exc)


def progress(t0: float, msg: str) -> None:
    print(f"[e2e {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def train_steps(args: argparse.Namespace) -> int:
    """Steps every variant trains before its eval NE: the timed window, or --ne-steps. A
    profiled window gets as many steps again of room, to be shifted off the Probe's sampled
    steps (``measure.profile_offset``)."""
    return max(args.warmup + args.steps + 2 * args.profile_steps, args.ne_steps)


def decayed_steps(ne_decay: float, steps: int) -> int:
    """``--ne-decay``: how many of a run's `steps` steps decay."""
    return round(ne_decay * steps)


def decay_overrides(args: argparse.Namespace, end: int, steps: int) -> tuple[str, ...]:
    """``--ne-decay``: the overrides that decay a run's rates to 0 over the last fraction of its
    `steps` steps (the run ends at step `end`); none without it.

    >>> decay_overrides(argparse.Namespace(ne_decay=0.25), end=1300, steps=300)
    ('trainer.lr_decay_start=1225', 'trainer.lr_decay_steps=75')
    """
    n = decayed_steps(args.ne_decay, steps)
    if n < 1:
        return ()
    if n < 2:
        raise SystemExit(f"--ne-decay {args.ne_decay}: decays {n} of {steps} steps; take at least 2")
    return (f"trainer.lr_decay_start={end - n}", f"trainer.lr_decay_steps={n}")


WARM_RUN_STEPS = 20
"""Timed steps of ``--warm-run``'s discarded run."""


def warm_run(
    args: argparse.Namespace, composer: Composer, config: str, batch: int, variant: Variant, t0: float,
    torchao_missing: str | None,
) -> dict[str, Any]:
    """``--warm-run``: one short run of `variant` from step 0, kept out of the results; returns
    its summary (variant, status, median step ms, wall s) for the report."""
    short = argparse.Namespace(**vars(args))
    short.steps = min(args.steps, WARM_RUN_STEPS)
    short.profile_steps, short.ne_steps, short.ne_from, short.ne_decay = 0, 0, 0, 0.0
    short.trace = short.pyprofile = None
    short.step_diag = False
    short.train_steps = train_steps(short)
    with cast_grid(variant):
        rec = run_one(short, composer, config, batch, variant, t0, torchao_missing)
    progress(t0, f"{config} b{batch} {variant.name}: warm run ({rec['status']}), not in the results "
                 f"[{rec.get('wall_s', math.nan):.1f}s]")
    return {"config": config, "batch": batch, "variant": variant.name, "status": rec["status"],
            "step_ms_median": rec.get("step_ms_median"), "wall_s": rec.get("wall_s"),
            "started_unix": rec.get("started_unix")}


def base_checkpoint(
    args: argparse.Namespace, composer: Composer, config: str, batch: int, base: Variant, seed: int, root: Path,
) -> tuple[Path, dict[str, Any]]:
    """``--ne-from``: train `base` for ``args.ne_from`` steps with ``trainer.seed=seed`` and save
    its checkpoint under a fresh out_dir; returns that out_dir and the run's summary figures."""
    from loka_train.runtime.trainer import Trainer

    out = root / f"base_{config}_b{batch}_s{seed}"
    job = composer.job(job_overrides(
        args, config, batch, base, str(out), steps=args.ne_from, eval_batches=args.eval_batches,
        extra=(f"trainer.seed={seed}",), checkpoint_at_end=True,
    ))
    started = time.perf_counter()
    trainer: Any = Trainer(model=job.model, data=job.data, trainer=job.trainer, callbacks=[])
    try:
        summary = trainer.fit()
    finally:
        job = trainer = None
        cleanup(args.device)
    return out, {"config": config, "batch": batch, "seed": seed, "variant": base.name, "steps": args.ne_from,
                 "eval_ne": summary["eval/ne"], "eval_auc": summary["eval/auc"],
                 "wall_s": time.perf_counter() - started}


@contextlib.contextmanager
def cast_grid(variant: Variant) -> Iterator[None]:
    """The tensor-wise casts on one program a tile, without a pipelined loop, while `variant`
    runs (its decision run too: with ``--share-decisions`` the variant listed first decides, on its
    own grid), where it asks for it (``+tilegrid``); the persistent grid again after."""
    if not variant.tile_grid:
        yield
        return
    from loka_train.kernels import triton_tensorwise as tt

    before = tt._PROGRAMS_PER_SM, tt._STAGES
    tt._PROGRAMS_PER_SM, tt._STAGES = 1 << 30, 1  # more programs than any cast has tiles, one tile each
    try:
        yield
    finally:
        tt._PROGRAMS_PER_SM, tt._STAGES = before


def run_one(
    args: argparse.Namespace,
    composer: Composer,
    config: str,
    batch: int,
    variant: Variant,
    t0: float,
    torchao_missing: str | None,
    seed: int = 0,
    warm_start: Path | None = None,
    decisions: dict[tuple[Any, ...], tuple[str, dict[str, Any], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Decision run (LoKA), then the timed run; every figure of one (config, batch, variant),
    with ``trainer.seed=seed`` in both. With `warm_start` (a base run's out_dir, ``--ne-from``)
    both resume its checkpoint instead of starting from fresh weights. With
    `decisions` (``--share-decisions``), a LoKA variant whose decision a variant run before it
    made already (:func:`decision_key`) takes that decided state instead of deciding anew."""
    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime.trainer import Trainer

    rec: dict[str, Any] = {
        "config": config,
        "batch": batch,
        "variant": variant.name,
        "description": variant.description,
        "status": "ok",
        "seed": seed,
    }
    if variant.torchao and torchao_missing:
        rec["status"] = "not run"
        rec["error"] = f"not run: {torchao_missing}"
        return rec
    profile_steps = args.profile_steps if variant.name in args.profile_names else 0
    total_steps = args.train_steps
    device_type = args.device
    started = time.perf_counter()
    # Everything that holds the model (and so GPU memory) is named here, so the clean-up below
    # can drop it also when the run failed: a failed run (e.g. out of memory) must not keep its
    # tensors alive into the next run.
    job: Any = None
    trainer: Any = None
    decider: Any = None
    clock: Any = None
    callbacks: list[Callback] = []
    loka_cb: Any = None
    torchao_cb: Any = None
    # --memory-trace records from here when a decision run comes first: what that run leaves
    # allocated through the timed run keeps the stacks that allocated it.
    trace_early = bool(getattr(args, "memory_trace", False)) and device_type == "cuda" and variant.decide
    with tempfile.TemporaryDirectory(prefix=f"e2e_{config}_{variant.name}_".replace("+", "_")) as tmp:
        try:
            if trace_early:
                start_memory_trace()
            state = None
            key = decision_key(config, batch, None if args.decide_once else seed, variant)
            shared = decisions.get(key) if decisions is not None and variant.decide else None
            # --decisions DIR: a decision made before (another process, another call) is taken
            # as it was saved; one made here is saved there.
            stored = loaded = None
            if variant.decide and getattr(args, "decisions", None):
                stored = decision_file(args.decisions, args, config, batch,
                                       None if args.decide_once else seed, variant)
                loaded = load_decision(stored) if shared is None else None
            if shared is not None:
                made_by, decide_rec, decided = shared
                state = copy.deepcopy(decided)
                rec["decide_overrides"] = []
                rec["decide"] = {**decide_rec, "s": 0.0, "shared_from": made_by}
                progress(t0, f"{config} b{batch} {variant.name}: the decision of {made_by}, seed "
                             f"{decide_rec['seed']} (--share-decisions)")
            elif loaded is not None:
                assert stored is not None
                decide_rec, state = loaded
                rec["decide_overrides"] = []
                rec["decide"] = {**decide_rec, "s": 0.0, "loaded_from": stored.name}
                progress(t0, f"{config} b{batch} {variant.name}: the decision of {decide_rec['variant']}, seed "
                             f"{decide_rec['seed']}, from {stored} (--decisions)")
            elif variant.decide:
                decide_extra = decide_overrides(args.decide_interval)
                # A continuation (--ne-from) decides from the checkpoint it continues: its plans
                # come from the Probe's statistics of the steps after N0, at the trained
                # weights the timed run continues, not from those of fresh weights.
                decide_from = 0
                if warm_start is not None:
                    shutil.copytree(warm_start, f"{tmp}/decide", symlinks=True)
                    decide_from = args.ne_from
                # The plans do not depend on compilation: decide eagerly.
                job = composer.job(
                    job_overrides(
                        args, config, batch, replace(variant, compile=False), f"{tmp}/decide",
                        steps=decide_from + args.decide_steps, eval_batches=1,
                        extra=(*decide_extra, f"trainer.seed={seed}"),
                        resume="must" if warm_start is not None else "never",
                    )
                )
                rec["decide_overrides"] = list(decide_extra) + [f"trainer.steps={decide_from + args.decide_steps}"]
                decider = LokaCallback(job.loka)
                start = _StartStep()
                trainer = Trainer(model=job.model, data=job.data, trainer=job.trainer, callbacks=[decider, start])
                trainer.fit()
                state = decider.state_dict()
                assert decider.dispatcher is not None
                rec["decide"] = {
                    "steps": args.decide_steps,
                    "from_step": start.step,
                    "fp8_coverage": decider.dispatcher.fp8_coverage(),
                    "plan_changes": decider.dispatcher.num_changes,
                    "seed": seed,
                    "s": time.perf_counter() - started,
                }
                progress(
                    t0,
                    f"{config} b{batch} {variant.name}: decision run {args.decide_steps} steps -> "
                    f"FP8 {rec['decide']['fp8_coverage']:.0%} of GEMMs, "
                    f"{rec['decide']['plan_changes']} plan changes ({rec['decide']['s']:.1f}s)",
                )
                # The decision job holds its model and optimizer: dropped before the clean-up, or
                # they stay allocated through the timed run (modules hold reference cycles).
                trainer = decider = job = None
                cleanup(device_type)
                state = decided_state(state)
                if decisions is not None:
                    decisions[key] = (variant.name, dict(rec["decide"]), copy.deepcopy(state))
                if stored is not None:
                    save_decision(stored, {**rec["decide"], "variant": variant.name}, state,
                                  f"{config} b{batch} {variant.name} seed {rec['decide']['seed']}")

            if warm_start is not None:
                shutil.copytree(warm_start, f"{tmp}/run", symlinks=True)  # latest: a relative link
            end = args.ne_from + total_steps if warm_start is not None else total_steps
            overrides = job_overrides(
                args, config, batch, variant, f"{tmp}/run",
                steps=end, eval_batches=args.eval_batches,
                extra=(
                    f"trainer.seed={seed}", *decay_overrides(args, end, total_steps),
                    *(("loka.ledger=true",) if args.ledger and variant.loka != "off" else ()),
                ),
                resume="must" if warm_start is not None else "never",
            )
            rec["overrides"] = overrides
            if device_type == "cuda":
                # What earlier runs of this process (another variant, the decision run) left
                # allocated: inside this run's peaks, not its own.
                rec["gpu_allocated_before_gb"] = torch.cuda.memory_allocated() / 2**30
            job = composer.job(overrides)
            if job.loka.enabled:
                loka_cb = LokaCallback(job.loka)
                if state is not None:
                    loka_cb.load_state_dict(state)
                callbacks.append(loka_cb)
            if variant.torchao:
                torchao_cb = TorchaoFloat8(variant.torchao)
                callbacks.append(torchao_cb)
            clock = StepClock(
                warmup=args.warmup,
                timed=args.steps,
                profile_steps=profile_steps,
                sampled_every=(
                    job.loka.probe.every_k_steps if job.loka.enabled and job.loka.probe.enabled else None
                ),
                device=torch.device(device_type),
                timing=args.timing,
                pyprofile=bool(args.pyprofile) and seed == 0,
                step_diag=args.step_diag,
                memory_trace=getattr(args, "memory_trace", False),
                memory_trace_running=trace_early,
            )
            if device_type == "cuda":
                torch.cuda.reset_peak_memory_stats()  # cleanup() emptied the cache of the last run
            setup_t, started_unix = time.perf_counter(), time.time()
            trainer = Trainer(
                model=job.model, data=job.data, trainer=job.trainer, callbacks=[*callbacks, clock]
            )
            try:
                summary = trainer.fit()
            finally:
                clock.close()
            run_s = time.perf_counter() - setup_t
            times = clock.step_ms()
            if len(times) != args.steps:
                raise RuntimeError(f"timed {len(times)} steps, expected {args.steps}")
            median = statistics.median(times)
            rec.update(
                step_ms_median=median,
                step_ms_p10=percentile(times, 0.1),
                step_ms_p90=percentile(times, 0.9),
                step_ms_mean=statistics.fmean(times),
                step_ms=times,
                samples_per_s=batch * 1000.0 / median,
                eval_ne=summary["eval/ne"],
                eval_auc=summary["eval/auc"],
                train_loss=summary["train/loss"],
                steps=summary["steps"],
                compiled=summary.get("compiled", []),
                fallbacks=summary["fallbacks"],
                compile_skipped_frames=summary.get("compile_skipped_frames", []),
                cuda_graphs=summary.get("cuda_graphs"),
                run_s=run_s,
                # Drift diagnostics (step times grew 30-50% over one process on the H100).
                gc_pauses=len(clock.gc_pauses_ms),
                gc_ms_per_step=sum(clock.gc_pauses_ms) / len(times),
                gpu_reserved_gb=clock.gpu_reserved_gb,
                # Peaks of this run (reset before it): the memory figure of issue 26.
                gpu_peak_allocated_gb=clock.peak_gb()[0],
                gpu_peak_reserved_gb=clock.peak_gb()[1],
                by_sampling=clock.split_by_sampling(),
                host_rss_gb=rss_gb(),
                started_unix=started_unix,
            )
            if clock.memory_peak is not None:
                rec["memory_peak"] = clock.memory_peak
            if args.step_diag:
                rec["step_diag"] = clock.step_diagnostics()
                rec["first_timed_step"] = clock.first_step + clock.warmup
            if loka_cb is not None:
                rec["loka"] = loka_summary(loka_cb, trainer, median)
                if args.ne_steps > 0:
                    try:
                        rec["eval_ne_forwards_high"] = forwards_high_ne(trainer, loka_cb.sites)
                    except Exception as exc:  # the run's timings and NE stand without it
                        rec["eval_ne_forwards_high_error"] = f"{type(exc).__name__}: {exc}"
                        logger.error("%s b%d %s: the evaluation with the forwards high failed: %s",
                                     config, batch, variant.name, exc)
            if torchao_cb is not None:
                rec["torchao"] = {"converted": torchao_cb.converted, "skipped": torchao_cb.skipped}
            if clock.pystats:
                name = re.sub(r"[^A-Za-z0-9._-]", "_", f"py_{config}_b{batch}_{variant.name}") + ".txt"
                Path(args.pyprofile).mkdir(parents=True, exist_ok=True)
                (Path(args.pyprofile) / name).write_text(clock.pystats)
            if clock.profile is not None:
                if args.trace and seed == 0:
                    try:
                        rec["trace"] = export_trace(clock.profile, Path(args.trace), config, batch, variant.name)
                    except Exception as exc:  # the timings stand without the trace
                        rec["trace_error"] = f"{type(exc).__name__}: {exc}"
                        logger.error("%s b%d %s: trace not written: %s", config, batch, variant.name, exc)
                try:
                    rec["profile"] = summarize_profile(clock, median)
                except Exception as exc:  # the timings stand without the breakdown
                    rec["profile_error"] = f"{type(exc).__name__}: {exc}"
                    logger.error("%s b%d %s: profile not summarized: %s", config, batch, variant.name, exc)
        except Exception as exc:  # recorded, reported, and the benchmark goes on
            rec["status"] = "error"
            rec["error"] = f"error: {type(exc).__name__}: {exc}"[:2000]
            rec["traceback"] = traceback.format_exc()[-6000:]
            logger.error("%s b%d %s failed:\n%s", config, batch, variant.name, rec["traceback"])
        finally:
            if trace_early:  # also when the run failed before its clock stopped the recording
                try:
                    torch.cuda.memory._record_memory_history(enabled=None)
                except RuntimeError as exc:  # a sticky CUDA error: the clean-up below still runs
                    logger.error("stopping the memory recording failed: %s", exc)
            job = trainer = decider = clock = loka_cb = torchao_cb = None
            callbacks = []
            cleanup(device_type)
    rec["wall_s"] = time.perf_counter() - started
    return rec


def run_order(variants: list[Variant], repeats: int) -> list[tuple[Variant, int]]:
    """(variant, round) in the order they run: round i runs every variant once, starting at
    variant ``i mod len(variants)`` (A B C, B C A, C A B, ...).

    On an H100 the host-bound steps of one process drifted by 30-50% over minutes
    (the same variant at 6.3 and 8.6 ms in two rounds, later variants slower within a round),
    so a fixed order within each round would charge that drift to the variants that come last.
    Every variant runs first equally often when ``repeats`` is a multiple of ``len(variants)``.
    """
    n = len(variants)
    return [(variants[(i + j) % n], i) for i in range(repeats) for j in range(n)]


# -------------------------------------------------------------------------- rounds
DRIFT_KEYS = ("gc_ms_per_step", "gpu_reserved_gb", "host_rss_gb", "started_unix")
"""Per-run figures that may explain step times drifting over one process."""


def aggregate(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (config, batch, variant) from its repeated runs (``--repeats``).

    A single run is returned as it is. Several: the first run's record with the median over
    runs of the step-time figures, the mean eval NE / AUC, ``eval_ne_std`` (sample standard
    deviation over runs) and every run's own figures under ``repeats``. Any failed run makes
    the record an error naming it (a partial mean would hide it).
    """
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for r in raw:
        groups.setdefault((r["config"], r["batch"], r["variant"]), []).append(r)
    out: list[dict[str, Any]] = []
    for runs in groups.values():
        if len(runs) == 1:
            out.append(dict(runs[0]))  # a copy: add_ratios writes into the aggregated records
            continue
        failed = [r for r in runs if r["status"] != "ok"]
        rec = dict(failed[0] if failed else runs[0])
        rec["repeats"] = [
            {**{k: r.get(k) for k in ("seed", "status", "step_ms_median", "step_ms_p10", "step_ms_p90",
                                      "eval_ne", "eval_auc", "eval_ne_forwards_high", "eval_ne_forwards_high_error", "error") + DRIFT_KEYS
                if k in r},
             # Dispatch decides anew in every round (it may choose differently).
             **({"fp8_coverage": r["loka"]["fp8_coverage"]} if "loka" in r else {})}
            for r in runs
        ]
        if failed:
            rec["error"] = f"{len(failed)} of {len(runs)} runs failed; first: " + str(failed[0].get("error", ""))
            out.append(rec)
            continue
        for key in ("step_ms_median", "step_ms_p10", "step_ms_p90", "step_ms_mean"):
            rec[key] = statistics.median(r[key] for r in runs)
        rec["samples_per_s"] = rec["batch"] * 1e3 / rec["step_ms_median"]
        rec["step_ms"] = [t for r in runs for t in r["step_ms"]]
        for key in ("eval_ne", "eval_auc", "eval_ne_forwards_high"):
            # A mean over every round or none (a round without it leaves the key out: run 0's
            # value copied above would pass for the mean).
            rec.pop(key, None)
            if all(key in r for r in runs):
                rec[key] = statistics.fmean(r[key] for r in runs)
        rec["eval_ne_std"] = statistics.stdev(r["eval_ne"] for r in runs)
        out.append(rec)
    return out


@dataclass
class Runs:
    """What the benchmark has run so far; the report is rewritten from it after every run."""

    results: list[dict[str, Any]] = field(default_factory=list)
    """One record per (config, batch, variant), aggregated over its rounds."""
    raw: list[dict[str, Any]] = field(default_factory=list)
    """Every run (several per variant with ``--repeats``), in the order they ran."""
    bases: list[dict[str, Any]] = field(default_factory=list)
    """The runs that trained the ``--ne-from`` checkpoints."""
    warm_runs: list[dict[str, Any]] = field(default_factory=list)
    """``--warm-run``: the discarded first run."""


def run_grid(
    args: argparse.Namespace,
    variants: list[Variant],
    ne_base: Variant,
    runs: Runs,
    *,
    t0: float,
    torchao_missing: str | None,
    on_run: Callable[[], object],
) -> None:
    """Every variant of every (config, batch) of ``args``, in rotated rounds, into `runs`.

    Per (config, batch): the shared batches are generated first, outside every measurement;
    then the ``--warm-run`` (once, before the first measured run), the ``--ne-from``
    checkpoint of each seed (by `ne_base`, before that seed's first run) and the runs.
    `on_run` is called after every run (the caller rewrites the report: a benchmark cut short
    by a time limit still leaves its results). Needs the process group of world size 1.

    Args:
        args: the parsed command line (``bench.e2e.cli.parse_args``).
        variants: the variants to run, in the order of the first round.
        ne_base: the variant that trains the ``--ne-from`` checkpoints.
        runs: where the records go.
        t0: the benchmark's start (``time.perf_counter()``), for the progress lines.
        torchao_missing: why torchao does not import, or None (its variants are then not run).
        on_run: called after every run.
    """
    with contextlib.ExitStack() as stack:
        composer = Composer(stack)
        make = stack.enter_context(shared_datasets())
        for config in args.config_names:
            for batch in args.batch_sizes:
                # Generate the shared batches once, outside every measurement.
                job = composer.job(job_overrides(args, config, batch, variants[0], "unused", steps=1,
                                                 eval_batches=args.eval_batches))
                started = time.perf_counter()
                for split, n in (("train", args.cache_batches), ("eval", args.eval_batches)):
                    generate_batches(make(job.data, split=split, rank=0, world_size=1, batch_size=batch), n)
                progress(t0, f"{config} b{batch}: data ready ({time.perf_counter() - started:.1f}s)")
                warm: dict[int, Path] = {}  # seed -> the base run's out_dir (--ne-from)
                # --share-decisions: decision_key -> (variant that decided, its record, the state).
                decisions: dict[tuple[Any, ...], Any] | None = {} if args.share_decisions else None
                # This (config, batch)'s shared checkpoints, deleted once its runs are done
                # (or with the stack, when a run raises).
                base_dir = tempfile.TemporaryDirectory(prefix="e2e_base_")
                stack.callback(base_dir.cleanup)
                base_root = Path(base_dir.name)
                if args.warm_run and not runs.warm_runs:
                    runs.warm_runs.append(warm_run(args, composer, config, batch, variants[0], t0, torchao_missing))
                for variant, round_ in run_order(variants, args.repeats):
                    repeat = args.first_seed + round_  # the round's trainer.seed
                    if args.ne_from and repeat not in warm:
                        warm[repeat], base_rec = base_checkpoint(
                            args, composer, config, batch, ne_base, repeat, base_root)
                        runs.bases.append(base_rec)
                        progress(t0, f"{config} b{batch} seed {repeat}: {ne_base.name} checkpoint at step "
                                     f"{args.ne_from}, NE {base_rec['eval_ne']:.5f} ({base_rec['wall_s']:.1f}s)")
                    with cast_grid(variant):
                        rec = run_one(args, composer, config, batch, variant, t0, torchao_missing, seed=repeat,
                                      warm_start=warm.get(repeat), decisions=decisions)
                    runs.raw.append(rec)
                    runs.results[:] = aggregate(runs.raw)
                    tag = f" (run {round_ + 1}/{args.repeats}, seed {repeat})" if args.repeats > 1 else ""
                    if rec["status"] == "ok":
                        base = next((r for r in runs.raw if r["config"] == config and r["batch"] == batch
                                     and r["variant"] == REFERENCE and r["status"] == "ok"
                                     and r["seed"] == repeat), None)
                        cov = f", FP8 {rec['loka']['fp8_coverage']:.0%}" if "loka" in rec else ""
                        if base is None:
                            # A rotated round may run bf16 later: the report has the ratio.
                            vs = f"bf16 of seed {repeat} not run yet, NE {rec['eval_ne']:.5f}"
                        else:
                            ratio = base["step_ms_median"] / rec["step_ms_median"]
                            ne = (rec["eval_ne"] - base["eval_ne"]) / base["eval_ne"]
                            vs = f"{fmt_x(ratio)} vs bf16, NE {rec['eval_ne']:.5f} ({fmt_pct(ne, 3)})"
                        progress(
                            t0,
                            f"{config} b{batch} {variant.name}{tag}: {rec['step_ms_median']:.2f} ms/step "
                            f"(p10 {rec['step_ms_p10']:.2f}, p90 {rec['step_ms_p90']:.2f}), "
                            f"{vs}{cov} [{rec['wall_s']:.1f}s]",
                        )
                    else:
                        progress(t0, f"{config} b{batch} {variant.name}{tag}: {rec['error'][:300]}")
                    on_run()
                base_dir.cleanup()
