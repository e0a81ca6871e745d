"""The LoKA callback: Probe, Mods, Dispatch and quantized comms, driven by the trainer's hooks.

One object a user adds to the trainer's callbacks:

* `on_before_shard`: `mods.convert` turns the dense GEMMs into FP8-capable sites (before
  DistributedModelParallel, which still finds the embedding modules by type); with comms on,
  the embedding all-to-all codecs are handed to the sharder (not with
  ``trainer.sharding_group_size=1``, where the all-to-alls span one rank).
* `on_train_start`: sites are registered with the Probe and Dispatch; a checkpointed state
  (probe windows, plans, history) is applied to the sites; the dense-gradient hook is installed.
* every step (`on_step_start`): the Probe's schedule picks the sites it samples
  (`mods.mark_sampled`), which report inside their forwards (no host sync) and which the loop
  runs eagerly (`eager_modules`);
* every Probe interval (`on_step_end`): statistics are all-reduced, verdicts updated, Dispatch
  re-plans (collectively, so every rank applies the same plan at the same step), the comm
  policy moves precisions, metrics are logged and the progress bar shows FP8 coverage;
* `on_eval_end`: the quality guard compares held-out NE with its best so far and moves every
  site back to high precision when it regresses beyond the tolerance; with
  ``guard.forward_ne``, where a site's forward runs in FP8, it evaluates once more with those
  forwards in high precision and logs what they cost the NE; the evaluation's NE and AUC are
  kept for the report;
* `on_train_end`: rank 0 writes the run report (JSON, Markdown, PNG plots).

With ``LokaConfig(enabled=False)`` (the ``off`` preset) every hook returns at once: nothing is
converted, no hook or codec installed, nothing sampled, no report written, no state kept.

Using it in your own TorchRec loop (TrainPipelineSparseDist or not) takes the same calls a
Trainer makes; see `examples/own_loop.py`.

Example:
    >>> from loka_train.plugin import LokaCallback, LokaConfig
    >>> trainer = Trainer(model=..., data=..., trainer=...,
    ...                   callbacks=[LokaCallback(LokaConfig.preset("safe"))])
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from loka_train.dispatch import Dispatcher, PlanChange
from loka_train.dispatch.ledger import Ledger, measure_ledger
from loka_train.kernels import static_scales
from loka_train.kernels.linear import reference_fallbacks
from loka_train.kernels.roles import ROLES
from loka_train.mods import ConvertReport, convert, forwards_high, mark_sampled, sites
from loka_train.mods.site import GemmSite
from loka_train.plugin.config import LokaConfig
from loka_train.plugin.report import run_report, write_report
from loka_train.probe import Probe
from loka_train.probe.window import merge_window_states
from loka_train.runtime.callbacks import Callback
from loka_train.utils.console import TABLE
from loka_train.utils.profiling import profiled

if TYPE_CHECKING:
    from loka_train.runtime.context import LoopState as Trainer

logger = logging.getLogger(__name__)

LEDGER_STEPS = 20
"""Last steps whose median interval is the ledger's step time."""


class LokaCallback(Callback):
    """Measures, decides and re-decides where FP8 runs, while the job trains.

    Args:
        config: the plugin configuration (e.g. ``LokaConfig.preset("safe")``); with
            ``enabled=False`` the callback does nothing at all.
    """

    replayable_requests = True
    """The Probe's work inside a sampled site defers its host part (writing the sample into
    its window slot) to replays: with ``trainer.cuda_graphs`` a sampled step replays a capture
    of the sampled modules' uncompiled forwards instead of running them eagerly."""

    def __init__(self, config: LokaConfig) -> None:
        self.config = config
        self.sites: dict[str, Any] = {}
        self._logit_feeder: str | None = None  # mods' ConvertReport.logit_feeder
        self._sampled: Collection[nn.Module] = ()
        """The sites the Probe samples on the current step."""
        self.probe: Probe | None = None
        self.dispatcher: Dispatcher | None = None
        self.comm_state: Any = None
        self.comm_policy: Any = None
        self.replica_syncer: Any = None
        """The replica sync of 2D sparse parallelism through the codecs (``comm.ReplicaSync``)."""
        self.timeline: list[tuple[int, dict[str, str]]] = []
        """(step, site -> short plan) at every interval, for the plan timeline."""
        self.guard_trips: list[dict[str, Any]] = []
        self._fallbacks_at_start: dict[str, int] = {}
        """``kernels.linear.reference_fallbacks()`` when this run began: the report counts from it."""
        self.evals: list[dict[str, float]] = []
        """The run's evaluations (step, NE, AUC), for the report."""
        self.best_ne: float | None = None
        self._cooldown = 0
        self._pending_state: dict[str, Any] | None = None
        self._pending_comp: list[dict[str, Any]] | None = None
        self._dropped_residuals = ""
        """Why the checkpoint's error-feedback residuals were dropped at a resume on another
        number of processes (reported as a fallback at on_train_start), or ''."""
        self.compressors: list[Any] = []
        self._carried_comm: dict[str, Any] | None = None
        """On one process (no comm installed): the checkpoint's comm state and policy, saved
        again as they were, so that a later run on several processes continues them."""
        self._out_dir: Path | None = None
        self._rank = 0
        self.ledger: Ledger | None = None
        """The per-GEMM ledger (``config.ledger``, rank 0, measured at the end of training)."""
        self.step_ms: float | None = None
        """The run's step time for the ledger's predictions: the median interval between the
        last step ends (steady state: no compilation, capture or evaluation in it)."""
        self._step_ends: deque[float] = deque(maxlen=LEDGER_STEPS + 1)

    @property
    def enabled(self) -> bool:
        """Whether the callback does anything (``config.enabled``)."""
        return self.config.enabled

    @property
    def stateful(self) -> bool:
        """Only an enabled callback keeps state across a resume."""
        return self.enabled

    # ------------------------------------------------------------------------- set-up
    def on_before_shard(self, trainer: Trainer) -> None:
        if not self.enabled:
            logger.info("LoKA off (LokaConfig.enabled=False): the callback changes nothing")
            return
        if self.config.mods.enabled:
            convert(trainer.model, config=self.config.mods)
            report = getattr(trainer.model, "loka_mods_report", None)
            self._logit_feeder = report.logit_feeder if isinstance(report, ConvertReport) else None
        if self.config.comm_enabled and trainer.world_size == 1:
            # No all-to-all, no gradient all-reduce to compress: codecs and hooks would only cost.
            logger.info("LoKA comm: one process, nothing to communicate: the comm codecs and the "
                        "dense-gradient hook are not installed")
        elif self.config.comm_enabled:
            from loka_train.comm import CommPolicy, CommState, make_qcomm_codecs_registry

            nccl = trainer.device.type == "cuda"
            self.comm_state = CommState(
                self.config.comm, device=trainer.device if nccl else torch.device("cpu")
            )
            self.comm_policy = CommPolicy(self.comm_state)
            layout = trainer.sparse2d
            if layout is not None and layout.sharding_group_size == 1:
                # Every rank holds every table: the all-to-alls span one rank and send nothing,
                # so codecs would only encode and decode.
                logger.info("LoKA comm: trainer.sharding_group_size=1, the embedding all-to-alls stay "
                            "on each rank: their codecs are not installed (the comm state serves the "
                            "replica sync and the dense-gradient hook)")
            else:
                trainer.qcomm_codecs_registry = make_qcomm_codecs_registry(self.comm_state)

    def on_train_start(self, trainer: Trainer) -> None:
        if not self.enabled:
            return
        if self.config.guard.forward_ne and getattr(trainer, "evaluate_again", None) is None:
            raise ValueError("loka.guard.forward_ne=true evaluates the model again at each evaluation: "
                             "this loop offers no evaluate_again (set RunContext.evaluate_again to a function "
                             "that returns your held-out metrics) or set loka.guard.forward_ne=false")
        self._fallbacks_at_start = reference_fallbacks()
        self._out_dir = trainer.out_dir
        self._rank = trainer.rank
        self.sites = sites(trainer.model)
        if not self.sites:
            logger.warning("LoKA: no FP8-capable site in the model (mods.sites=%s)", self.config.mods.sites)
        self.probe = Probe(self.config.probe, device=trainer.device)
        mods = self.config.mods
        self.dispatcher = Dispatcher(
            self.config.dispatch,
            device=trainer.device,
            out_dtype=trainer.dense_dtype,
            graphed=trainer.graphs is not None,
            static_scales=mods.static_scales,
        )
        if mods.static_scales:
            for site in self.sites.values():
                if isinstance(site, GemmSite):
                    site.enable_static_scales(
                        margin=mods.static_scale_margin, spread=mods.static_scale_spread, device=trainer.device
                    )
        floors = self.config.probe.logit_feeder_floors
        if floors and self._logit_feeder is None:
            logger.warning("LoKA: probe.logit_feeder_budget_db=%s applies to no site: no site feeds the "
                           "model's last Linear (mods.sites=%s)", floors, self.config.mods.sites)
        elif floors:
            logger.info("LoKA: %s, which feeds the logit layer, has its own SQNR floors %s",
                        self._logit_feeder, floors)
        for name, site in self.sites.items():
            if name == self._logit_feeder and floors:
                self.probe.register_site(name, **site.probe_spec(), sqnr_budget_db=floors)
            else:
                self.probe.register_site(name, **site.probe_spec())
            site.attach_observer(self.probe)
            self.dispatcher.register(
                name, plan=site.plan, supports=site.supports_plan,
                pad_to_multiple=getattr(site, "pad_to_multiple", 1), shares_operands=site.shares_operands,
                input_relu=site.input_relu,
            )
        if self._pending_state is not None:
            self.probe.load_state_dict(self._pending_state["probe"])
            # Plans the current dispatch config does not allow are reset (logged, counted in
            # the history); every site then takes the restored plan.
            self.dispatcher.load_state_dict(self._pending_state["dispatch"], step=self.probe.step)
            # A GEMM whose SQNR floor this run raises runs high until the Probe judges it again.
            for name, role, saved, now in self.probe.budget_changes:
                if now > saved:
                    self.dispatcher.force_high(
                        step=self.probe.step, sites=[name], roles=(role,),
                        reason=f"SQNR floor raised from {saved:.1f} to {now:.1f} dB since the checkpoint",
                    )
            for name, site in self.sites.items():
                site.set_plan(self.dispatcher.plans[name])
            self._pending_state = None
        if mods.static_scales:
            # A resumed run's slots start from the restored window, as the saved run's stood.
            self._refresh_static_scales()
        if self._dropped_residuals:
            logger.warning(self._dropped_residuals)
            trainer.fallbacks.append(self._dropped_residuals)
            self._dropped_residuals = ""
        if self.comm_state is not None:
            self._install_dense_grad_hook(trainer)
            self._install_replica_sync(trainer)
            if self._pending_comp is not None:
                if len(self._pending_comp) == len(self.compressors):
                    for comp, st in zip(self.compressors, self._pending_comp):
                        comp.load_state_dict(st)
                elif self._pending_comp:
                    msg = (
                        f"LoKA comm: the checkpoint holds {len(self._pending_comp)} dense-gradient "
                        f"hook state(s), this run has {len(self.compressors)} DDP module(s); their "
                        "error-feedback residuals are dropped (up to one step of rounding error is "
                        "not fed back)"
                    )
                    logger.warning(msg)
                    trainer.fallbacks.append(msg)
                self._pending_comp = None
        trainer.progress_postfix["fp8"] = f"{self.dispatcher.fp8_coverage():.0%}"
        objective = self.dispatcher.objective
        logger.info(
            "LoKA on: %d sites, probe every %d steps, interval %d, dispatch objective %s%s",
            len(self.sites),
            self.config.probe.every_k_steps,
            self.config.probe.interval,
            objective,
            f" ({_cpu_note(objective)})" if trainer.device.type == "cpu" else "",
        )

    def _install_replica_sync(self, trainer: Trainer) -> None:
        """2D sparse parallelism: the replicas sync through LoKA's codecs (`comm.ReplicaSync`)
        when the ``replica_sync`` channel may leave FP32; a static FP32 channel keeps
        DMPCollection's own sync (the same mean, one coalesced all-reduce). A lossy or adaptive
        channel without replicas (no 2D layout, or no sync hook in the loop) is a logged fallback."""
        from loka_train.comm import CommChannel, CommPrecision, ReplicaSync
        from loka_train.runtime.sparse2d import (
            replica_process_group,
            replicated_shards,
            require_live_shards,
        )

        layout = trainer.sparse2d
        channel = CommChannel.REPLICA_SYNC
        static_fp32 = channel not in self.config.comm.adaptive_channels
        if static_fp32 and self.comm_state.precision(channel) is CommPrecision.FP32:
            return
        if layout is None or trainer.replica_sync is None:
            missing = (
                "trainer.sharding_group_size (2D sparse parallelism) is not set" if layout is None else
                "the loop gives no replica_sync hook to replace (RunContext.replica_sync)"
            )
            msg = (
                f"LoKA comm: loka.comm.replica_sync={self.config.comm.replica_sync.name}"
                f"{' (adaptive)' if not static_fp32 else ''} is ignored: {missing}, so there are "
                "no replicas to sync"
            )
            logger.warning(msg)
            trainer.fallbacks.append(msg)
            return
        self.replica_syncer = ReplicaSync(
            self.comm_state, group=replica_process_group(trainer.model, layout, trainer.rank)
        )
        model, fused = trainer.model, trainer.model.fused_optimizer
        require_live_shards(model, fused, device=trainer.device)  # on every rank, or none
        shards = replicated_shards(model, fused)  # live tensors (checked above): listed once
        trainer.replica_sync = lambda step: self.replica_syncer.sync(*shards)
        # An fp32 anchor per shard, and an fp32 residual per shard while lossy with feedback.
        copy_bytes = sum(t.numel() for t in shards[0].values()) * 4
        copies = 2 if self.config.comm.dense_error_feedback else 1
        logger.info(
            "LoKA comm: replica sync of %d embedding shards through the codecs (%s, %s); it keeps "
            "up to %.1f MiB per rank (%d fp32 cop%s of the replicated shards: the anchor%s)",
            len(shards[0]), self.comm_state.precision(channel).name,
            "adaptive" if not static_fp32 else "static", copies * copy_bytes / 2**20, copies,
            "ies" if copies > 1 else "y", ", the error-feedback residual" if copies > 1 else "",
        )

    def _install_dense_grad_hook(self, trainer: Trainer) -> None:
        """The dense-gradient comm hook on every DDP module of the model; a model without one
        (not wrapped in DistributedModelParallel or DDP) goes without it: a logged fallback."""
        from torch.nn.parallel import DistributedDataParallel

        from loka_train.comm import install_dense_grad_hook

        if any(isinstance(m, DistributedDataParallel) for m in trainer.model.modules()):
            self.compressors = install_dense_grad_hook(trainer.model, self.comm_state)
            return
        msg = (
            "LoKA comm: dense-gradient hook left out: no DistributedDataParallel inside "
            f"{type(trainer.model).__name__}, so dense gradients are not all-reduced through a "
            "DDP comm hook; wrap the model in DistributedModelParallel (or DDP) after "
            "on_before_shard for LoKA to compress them"
        )
        logger.warning(msg)
        trainer.fallbacks.append(msg)
        self.compressors = []

    # ------------------------------------------------------------------------ per step
    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if not self.enabled:
            return
        assert self.probe is not None
        self.probe.begin_step(step)
        self._sampled = mark_sampled(self.sites.values(), step)
        if self.comm_state is not None:
            self.comm_state.begin_step(step)

    def eager_modules(self, trainer: Trainer, step: int) -> Collection[nn.Module]:
        """The sites the Probe samples on `step`: their statistics are host work that CUDA graph
        replays would skip (compiled code keeps it as opaque ops, ``mods.probe_tap``, which the
        loop runs with ``trainer.compile_sampled``)."""
        return self._sampled

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        assert self.probe is not None and self.dispatcher is not None
        if self.config.ledger:
            self._step_ends.append(time.perf_counter())
        if self.comm_state is not None:
            metrics.update(self.comm_state.end_step())
            for event in self.comm_policy.maybe_update(step):
                logger.info("LoKA comm: %s", event)
            metrics.update(self.comm_policy.metrics())
        if self.probe.should_reduce(step):
            self._interval(trainer, step, metrics)
        # Independent of the Probe interval: a report every `report_every` steps.
        if self.config.report_every and (step + 1) % self.config.report_every == 0:
            self.write_report(trainer)

    def _interval(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """Reduce the window, re-plan, apply the changes, log the interval's metrics."""
        assert self.probe is not None and self.dispatcher is not None
        with torch.profiler.record_function("loka/interval"):
            for name, site in self.sites.items():
                self.dispatcher.update_shapes(name, site.gemm_shapes())
            verdicts = self.probe.reduce()
            if self._cooldown > 0:
                changes: list[PlanChange] = []
            else:
                changes = self.dispatcher.replan(step=step, verdicts=verdicts)
            self._apply(changes)
            self._refresh_static_scales()
        self.timeline.append((step, self._short_plans()))
        coverage = self.dispatcher.fp8_coverage()
        metrics.update(self.probe.metrics())
        metrics["loka/fp8_coverage"] = coverage
        metrics["loka/plan_changes"] = float(self.dispatcher.num_changes)
        trainer.progress_postfix["fp8"] = f"{coverage:.0%}"

    def _refresh_static_scales(self) -> None:
        """Set the sites' static scales (``mods.static_scales``) from the Probe's reduced window:
        the largest amax of ``x`` (forward) and ``dY`` (grad-input) over its valid slots, the
        same on every rank, in the format the site's plan quantizes them to."""
        assert self.probe is not None
        if not self.probe.has_reduced_window:  # a fresh run: the slots seed themselves
            return
        for name, site in self.sites.items():
            slots = site.static_slots
            if slots is None:
                continue
            for row, role, gemm in ((0, "forward", site.plan.forward), (1, "grad_input", site.plan.grad_input)):
                stats = self.probe.window_stats(name, role)
                amax = stats["amax_a"][stats["valid"].bool()]
                if amax.numel():
                    static_scales.set_from_amax(slots[row], float(amax.max()), gemm.fmt)

    def _apply(self, changes: list[PlanChange]) -> None:
        assert self.dispatcher is not None
        for name in sorted({c.site for c in changes}):
            self.sites[name].set_plan(self.dispatcher.plans[name])

    def _short_plans(self) -> dict[str, str]:
        assert self.dispatcher is not None
        return {
            name: "/".join(
                getattr(plan, r).scaling.value[:3] if getattr(plan, r).is_fp8 else "hi"
                for r in ROLES
            )
            for name, plan in self.dispatcher.plans.items()
        }

    # --------------------------------------------------------------------- quality guard
    def on_eval_start(self, trainer: Trainer, step: int) -> None:
        if not self.enabled:
            return
        if self.comm_state is not None:
            self.comm_state.begin_eval()

    def on_eval_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        ne = metrics.get("eval/ne")
        if ne is not None and self.config.guard.forward_ne:
            self._forward_ne(trainer, ne, metrics)
        if self.comm_state is not None:
            self.comm_state.end_eval()
        assert self.dispatcher is not None
        if self._cooldown > 0:
            self._cooldown -= 1
        if ne is not None and "eval/auc" in metrics:
            entry = {"step": step, "ne": ne, "auc": metrics["eval/auc"]}
            if "loka/ne_forwards_high" in metrics:
                entry["ne_forwards_high"] = metrics["loka/ne_forwards_high"]
            self.evals.append(entry)
        if ne is None or not self.config.guard.enabled:
            return
        if self.best_ne is None or ne < self.best_ne:
            self.best_ne = ne
            return
        limit = self.best_ne * (1.0 + self.config.guard.ne_tolerance)
        if ne > limit and self.dispatcher.fp8_coverage() > 0:
            reason = (
                f"quality guard: eval NE {ne:.5f} > best {self.best_ne:.5f} x "
                f"(1 + {self.config.guard.ne_tolerance})"
            )
            changes = self.dispatcher.force_high(step=step, reason=reason)
            self._apply(changes)
            self._cooldown = self.config.guard.cooldown_evals
            self.guard_trips.append({"step": step, "ne": ne, "best_ne": self.best_ne, "gemms": len(changes)})
            trainer.fallbacks.append(reason)

    def _forward_ne(self, trainer: Trainer, ne: float, metrics: dict[str, float]) -> None:
        """``guard.forward_ne``: the held-out NE again with every FP8 forward in high precision
        (the same on every rank: the evaluation gathers every rank's logits), into `metrics`."""
        evaluate = trainer.evaluate_again
        assert evaluate is not None  # on_train_start refused a loop without it
        with forwards_high(self.sites) as moved:
            if not moved:
                return
            high = evaluate()["eval/ne"]
        metrics["loka/ne_forwards_high"] = high
        metrics["loka/forward_ne_cost"] = ne / high - 1.0

    # ------------------------------------------------------------------------ reporting
    def report(self, trainer: Trainer | None = None) -> dict[str, Any]:
        """The run report as plain data (rank-independent content; :mod:`loka_train.plugin.report`).

        Raises:
            RuntimeError: the callback is off (``config.enabled=False``): there is no report.
        """
        if not self.enabled:
            raise RuntimeError("LoKA is off (LokaConfig.enabled=False): it keeps no report")
        assert self.probe is not None and self.dispatcher is not None
        fallbacks = [
            *(trainer.fallbacks if trainer is not None else ()), *_quantizer_fallbacks(self._fallbacks_at_start),
        ]
        return run_report(
            sites=self.sites, probe=self.probe, dispatcher=self.dispatcher, comm_state=self.comm_state,
            compressors=self.compressors, guard_trips=self.guard_trips,
            fallbacks=fallbacks, evals=self.evals, timeline=self.timeline,
        )

    def write_report(self, trainer: Trainer) -> Path | None:
        """Write loka_report.{json,md} and PNG plots under out_dir/loka (rank 0 only; nothing
        when the callback is off)."""
        if not self.enabled or trainer.rank != 0:
            return None
        report = self.report(trainer)
        assert self.probe is not None and self.dispatcher is not None
        out = trainer.out_dir / "loka"
        # A periodic report (report_every) meets the same fallback (plots skipped) each time.
        new = write_report(report, out, history=self.dispatcher.history)
        trainer.fallbacks.extend(f for f in new if f not in trainer.fallbacks)
        if self.ledger is not None:
            (out / "ledger.json").write_text(json.dumps(self.ledger.to_dict(self.step_ms), indent=2))
            (out / "ledger.md").write_text("# LoKA per-GEMM ledger\n\n" + self.ledger.markdown(self.step_ms) + "\n")
        return out

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self.dispatcher is not None
        summary["loka/fp8_coverage"] = self.dispatcher.fp8_coverage()
        summary["loka/plan_changes"] = self.dispatcher.num_changes
        summary["loka/guard_trips"] = len(self.guard_trips)
        if self.config.ledger and trainer.rank == 0:
            ends = list(self._step_ends)
            gaps = [b - a for a, b in zip(ends, ends[1:])]
            self.step_ms = statistics.median(gaps) * 1e3 if gaps else None
            for name, site in self.sites.items():  # the shapes of the last step, interval or not
                self.dispatcher.update_shapes(name, site.gemm_shapes())
            with profiled("loka/ledger"):
                self.ledger = measure_ledger(
                    self.dispatcher.ledger_gemms(), device=trainer.device, high_dtype=trainer.dense_dtype,
                    static_scales=self.config.mods.static_scales,
                )
        out = self.write_report(trainer)
        if out is not None:
            summary["loka/report"] = str(out / "loka_report.md")
            # Logged, not printed, so that the tables land in the run's log too; the launcher prints
            # them to the console as they are (utils.console).
            logger.info("\nLoKA plan\n%s", self.dispatcher.table(), extra=TABLE)
            if self.ledger is not None:
                summary["loka/ledger"] = str(out / "ledger.md")
                logger.info("\nLoKA per-GEMM ledger (15 largest GEMMs; all in ledger.md)\n%s",
                            self.ledger.markdown(self.step_ms, top=15), extra=TABLE)

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        assert self.probe is not None and self.dispatcher is not None
        return {
            "probe": self.probe.state_dict(),
            "dispatch": self.dispatcher.state_dict(),
            **(
                {"comm": self.comm_state.state_dict(), "comm_policy": self.comm_policy.state_dict()}
                if self.comm_state is not None
                else self._carried_comm or {"comm": None, "comm_policy": None}
            ),
            "compressors": [c.state_dict() for c in self.compressors],
            "timeline": self.timeline,
            "guard": {"best_ne": self.best_ne, "cooldown": self._cooldown, "trips": self.guard_trips},
            "evals": self.evals,
        }

    def merge_rank_states(self, states: list[dict[str, Any]], *, rank: int, world_size: int) -> dict[str, Any]:
        """The LoKA state this rank loads from a checkpoint of another number of processes:
        plans, verdicts and the guard are the same on every rank (rank 0's); the Probe window
        is merged so that its next reduction is the one the saved run would have made
        (`merge_window_states`); the dense-gradient error-feedback residuals, a rank's own
        unflushed rounding, are dropped (logged)."""
        state = dict(states[0])
        if not self.enabled or not state:
            return state
        state["probe"] = merge_window_states([s["probe"] for s in states], rank=rank)
        if state.get("compressors") and world_size == 1:
            # One process installs no dense-gradient hook: the residuals have nothing to feed.
            state["compressors"] = []
        if state.get("compressors"):
            # Reported as a fallback once the trainer is there (on_train_start).
            self._dropped_residuals = (
                f"LoKA comm: resuming {len(states)} processes' state on {world_size}: the "
                "dense-gradient error-feedback residuals (each rank's own) start empty (up to one "
                "step of rounding error is not fed back)"
            )
            state["compressors"] = []
        elif rank == 0:
            logger.info("LoKA: resuming %d processes' state on %d: plans restored, the Probe window merged",
                        len(states), world_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called before on_train_start (sites not registered yet): keep and apply there.
        if not self.enabled:
            return
        self._pending_state = state
        self.timeline = [tuple(x) for x in state["timeline"]]  # type: ignore[misc]
        self.best_ne = state["guard"]["best_ne"]
        self._cooldown = state["guard"]["cooldown"]
        self.guard_trips = state["guard"]["trips"]
        # A checkpoint written without evaluations in its state restores none.
        self.evals = [dict(e) for e in state["evals"]] if "evals" in state else []
        if self.comm_state is not None and state["comm"] is not None:
            self.comm_state.load_state_dict(state["comm"])
            self.comm_policy.load_state_dict(state["comm_policy"])
            self._pending_comp = state["compressors"]
        elif self.comm_state is None and state["comm"] is not None and self.config.comm_enabled:
            # One process: the channels' precisions are kept for a later run on several.
            self._carried_comm = {"comm": state["comm"], "comm_policy": state["comm_policy"]}


def _cpu_note(objective: str) -> str:
    """What the dispatch objective means on a CPU, where FP8 is emulated."""
    if objective == "coverage":
        return (
            "CPU: FP8 is emulated; the coverage objective puts FP8 wherever it is measured safe, "
            "which exercises its numerics, not its speed"
        )
    return (
        "CPU: FP8 is emulated; the speed objective weighs a GPU cost model's times, not this "
        "CPU's, and takes FP8 only where that model predicts a gain"
    )


__all__ = ["LokaCallback"]


def _quantizer_fallbacks(at_start: dict[str, int]) -> list[str]:
    """The operands the FP8 sites had quantized by the reference quantizer where a Triton
    quantizer runs for their plan (``kernels.linear.reference_fallbacks``) since ``at_start``
    (the counts when this run began), one line each."""
    since = {what: n - at_start.get(what, 0) for what, n in reference_fallbacks().items()}
    return [
        f"kernels: the reference quantizer took {n} x a {what} (no Triton quantizer takes its shape or layout)"
        for what, n in sorted(since.items()) if n > 0
    ]
