"""An export of a trained run, what ``launch/export.py`` runs: the run's model and plans from
its checkpoint (:func:`~loka_train.export.load_trained`), served
(:func:`~loka_train.export.serve`), evaluated on held-out batches next to the same weights in
high precision, its numerics per site on the first batch
(:func:`~loka_train.export.compare_sites`), written to a directory:

* ``export.json``: the checkpoint and step, every site's plan (as served) and how it is served, NE, AUC and
  calibration of the served and of the high-precision model and their NE difference, the
  numerics rows;
* ``numerics.md``: the debugger's table;
* with ``decide_batch``, ``decisions.md``: the plans re-decided for that serving batch size
  (:func:`~loka_train.export.decide_for_batch`), which the served model then runs;
* with ``ne_budget``, ``gate.md``: the FP8 forwards moved to row-wise scales or high precision to
  hold the NE within the budget on the next held-out batches (:func:`~loka_train.export.hold_ne`), whose
  plans the served model then runs (the steps also in ``export.json``);
* ``served.pt``: the served model's state dict (the FP8 weight payloads ``<site>.served.*``
  included), its plans and serve config: :func:`load_trained` and :func:`serve` rebuild the
  same model from the checkpoint, and this state dict loads into it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from loka_train.data import make_dataset
from loka_train.data.metrics import auc, calibration, normalized_entropy
from loka_train.export.config import ExportConfig, ServeConfig
from loka_train.export.debugger import compare_sites, format_numerics
from loka_train.export.decide import InferenceDecision, decide_for_batch, format_decisions
from loka_train.export.gate import GateStep, format_gate, hold_ne
from loka_train.export.load import load_trained
from loka_train.export.program import export_dense, save_programs
from loka_train.export.serving import serve, serve_embeddings, served_sites
from loka_train.job import JobConfig
from loka_train.kernels.plan import LinearPlan
from loka_train.mods.convert import sites as find_sites
from loka_train.runtime.distributed import resolve_device

logger = logging.getLogger(__name__)

__all__ = ["export_run"]


def export_run(job: JobConfig, cfg: ExportConfig) -> dict[str, Any]:
    """Export the run `job` describes as `cfg` says (see the module docstring); returns the
    summary written to ``export.json``.

    Args:
        job: the run's config (its ``config.yaml``).
        cfg: what to export, where, in which dtype.

    Raises:
        CheckpointError: no checkpoint at ``cfg.run``, or not this job's.
    """
    device = resolve_device(cfg.device or job.trainer.device, 0)
    dtype = cfg.dtype or job.trainer.dense_dtype
    serve_cfg = ServeConfig(dtype=dtype, quantize_weights_once=cfg.quantize_weights_once, embeddings=cfg.embeddings,
                            fast_accum=cfg.fast_accum)
    trained = load_trained(job, cfg.run, device=device)
    high = load_trained(job, trained.checkpoint, device=device)
    if trained.plans:
        unavailable = sorted({p.forward.backend for p in trained.plans.values() if p.forward.is_fp8
                              and not _runs_on(p.forward.backend, device)})
        if unavailable:
            raise ValueError(
                f"the run's FP8 plans take the backends {unavailable}, which do not run on {device}: export "
                "it on the device it trained on (device=cuda for a GPU run)"
            )
        serve(trained.model, plans=trained.plans, config=serve_cfg)
        serve(high.model, plans={name: LinearPlan() for name in high.plans}, config=serve_cfg)
    elif cfg.embeddings != "trained":  # no site to serve: the tables only
        serve_embeddings(trained.model, cfg.embeddings)
        serve_embeddings(high.model, cfg.embeddings)
    data = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=job.trainer.batch_size)
    batches = [b.to(device) for b in data.batches(0, cfg.eval_batches or job.trainer.eval_batches)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    plans: dict[str, LinearPlan] = dict(trained.plans)
    decisions: list[InferenceDecision] = []
    if trained.plans and cfg.decide_batch is not None:
        try:
            held_out = make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=cfg.decide_batch)
        except ValueError as exc:
            raise ValueError(f"export decide_batch={cfg.decide_batch}: {exc}; or choose a batch size it takes") from exc
        at = next(iter(held_out.batches(0, 1))).to(device)

        def call(model: nn.Module) -> None:
            with autocast:
                model(at)

        safe = trained.safe_forwards
        if safe is not None and cfg.programs and cfg.dynamic_batch:
            # A block-scaled forward's padding depends on the rows: no program for any batch size.
            safe = dataclasses.replace(safe, config=dataclasses.replace(
                safe.config, scalings=tuple(s for s in safe.config.scalings if s != "block")))
        plans, decisions = decide_for_batch(trained.model, call, device=device, safe=safe,
                                            out_dtype=serve_cfg.torch_dtype,
                                            quantize_weights_once=serve_cfg.quantize_weights_once,
                                            fast_accum=serve_cfg.fast_accum)
        serve(trained.model, plans=plans, config=serve_cfg)
    gate: list[GateStep] = []
    if trained.plans and cfg.ne_budget is not None:  # judged on the next held-out batches, not the reported ones
        judged = [b.to(device) for b in data.batches(len(batches), len(batches))]
        if len(judged) < len(batches):
            fits = (len(batches) + len(judged)) // 2
            raise ValueError(
                f"export ne_budget: the gate judges on the {len(batches)} held-out batches after the "
                f"{len(batches)} evaluated, but the eval split has {len(batches) + len(judged)} of batch "
                f"{job.trainer.batch_size}: " + (f"lower eval_batches to {fits} or less" if fits else
                                                 "drop ne_budget (a split this short cannot judge it)")
            )
        gate = hold_ne(trained.model, lambda m: _evaluate(m, judged, autocast)["ne"],
                       reference_ne=_evaluate(high.model, judged, autocast)["ne"], budget=cfg.ne_budget,
                       config=serve_cfg, verdicts=None if trained.safe_forwards is None else trained.safe_forwards.verdicts)
    if trained.plans:  # the forwards as served: re-decided, moved by the gate, with fast accumulation
        now = find_sites(trained.model)
        plans = {n: dataclasses.replace(p, forward=now[n].plan.forward) if n in now else p for n, p in plans.items()}
    metrics = {"served": _evaluate(trained.model, batches, autocast), "high": _evaluate(high.model, batches, autocast)}
    rows = []
    if trained.plans:
        with torch.no_grad(), autocast:
            rows = compare_sites(trained.model, lambda m: m(batches[0]), reference=high.model)
    out = Path(cfg.out) if cfg.out else trained.checkpoint.parent.parent / "export" / trained.checkpoint.name
    out.mkdir(parents=True, exist_ok=True)
    ne_delta = metrics["served"]["ne"] / metrics["high"]["ne"] - 1 if metrics["high"]["ne"] else float("nan")
    summary: dict[str, Any] = {
        "checkpoint": str(trained.checkpoint),
        "step": trained.step,
        "serve": dataclasses.asdict(serve_cfg),
        "device": str(device),
        "eval_batches": len(batches),
        "eval_samples": sum(int(b.labels.numel()) for b in batches),
        "metrics": metrics,
        "ne_delta_rel_vs_high": ne_delta,
        "sites": served_sites(trained.model) if trained.plans else {},
        "plans": {name: plan.to_dict() for name, plan in plans.items()},
        "decide_batch": cfg.decide_batch,
        "decisions": [dataclasses.asdict(d) | {"fp8_ms": d.fp8_ms if math.isfinite(d.fp8_ms) else None}
                      for d in decisions],
        "numerics": [r.to_dict() for r in rows],
        "ne_budget": cfg.ne_budget,
        "ne_gate": [dataclasses.asdict(st) for st in gate],
        # Restored from the Probe's window, as a resumed run restores them.
        "static_scales": bool(job.loka.enabled and job.loka.mods.static_scales),
        "out": str(out),
    }
    (out / "export.json").write_text(json.dumps(summary, indent=1) + "\n")
    if decisions:
        (out / "decisions.md").write_text(
            f"# Plans re-decided for batch {cfg.decide_batch} on {device}: {trained.checkpoint}\n\n"
            + format_decisions(decisions) + "\n")
    if gate:
        (out / "gate.md").write_text(
            f"# NE budget {cfg.ne_budget:.4%}: {trained.checkpoint}, {len(batches)} held-out "
            "batches after the evaluated ones\n\n" + format_gate(gate) + "\n")
    (out / "numerics.md").write_text(
        f"# Numerics per site: {trained.checkpoint} (step {trained.step}), first eval batch, {dtype}\n\n"
        + (format_numerics(rows) if rows else "no LoKA site in this model: nothing in FP8") + "\n"
    )
    torch.save(
        {"state_dict": trained.model.state_dict(), "plans": summary["plans"], "serve": summary["serve"],
         "checkpoint": summary["checkpoint"], "step": trained.step},
        out / "served.pt",
    )
    if cfg.programs:  # last: a model torch.export cannot trace loses none of the files above
        try:
            programs = export_dense(cast(nn.Module, trained.model.model), batches[0], dynamic_batch=cfg.dynamic_batch,
                                    autocast=torch.bfloat16 if dtype == "bf16" else None)
        except Exception as exc:
            raise RuntimeError(
                f"export: {out} holds the export, but torch.export failed on the dense towers "
                f"({type(exc).__name__}: {exc}); export again with programs=false to skip the programs"
            ) from exc
        summary["programs"] = [str(p) for p in save_programs(programs, out / "dense")]
        (out / "export.json").write_text(json.dumps(summary, indent=1) + "\n")
    logger.info("export: %s -> %s (NE %.5f served, %.5f high precision)", trained.checkpoint, out,
                metrics["served"]["ne"], metrics["high"]["ne"])
    return summary


def _runs_on(backend: str, device: torch.device) -> bool:
    """Whether `backend` runs on `device` (its own capability check, at a small aligned shape)."""
    from loka_train.kernels.formats import Fp8Format, Scaling
    from loka_train.kernels.gemm import GemmProblem
    from loka_train.kernels.registry import get_backend

    problem = GemmProblem(m=16, k=16, n=16, fmt=Fp8Format.E4M3, scaling=Scaling.ROWWISE, device_type=device.type,
                          out_dtype=torch.bfloat16)
    return bool(get_backend(backend).supports(problem)[0])


def _evaluate(model: nn.Module, batches: list[Any], autocast: torch.autocast) -> dict[str, float]:
    """NE, AUC and calibration of `model` (``RecTrainModel``) on `batches`, without autograd."""
    logits, labels = [], []
    with torch.no_grad(), autocast:
        for batch in batches:
            _, (_, logits_B, labels_B) = model(batch)
            logits.append(logits_B.float())
            labels.append(labels_B.float())
    lg, lb = torch.cat(logits).cpu(), torch.cat(labels).cpu()
    return {"ne": normalized_entropy(lg, lb), "auc": auc(lg, lb), "calibration": calibration(lg, lb)}
