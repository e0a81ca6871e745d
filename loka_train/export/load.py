"""The model a run trained, from its checkpoint, unsharded on one process, with its LoKA plans.

A run's checkpoint holds its model and optimizer through ``torch.distributed.checkpoint``
(the embedding tables as shards of however many ranks trained them) and each rank's callback
states (``runtime.checkpoint``). :func:`load_trained` builds the run's model from its
:class:`~loka_train.job.JobConfig` (a run directory's ``config.yaml``, composed by
``launch/export.py``), converts it as the run's ``loka.mods`` did, reads the model's weights
into it (every table whole, on one device; no process group needed) and the plans Dispatch
held at that step from the LoKA callback's state. :func:`loka_train.export.serve` then
prepares it for inference.

Example::

    trained = load_trained(job, Path("runs/latest"))
    model = serve(trained.model, plans=trained.plans)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from loka_train.data import make_dataset
from loka_train.job import JobConfig
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import convert, sites
from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.rundirs import find_checkpoint
from loka_train.runtime.train_model import prepare_model

logger = logging.getLogger(__name__)

__all__ = ["TrainedModel", "load_trained"]

LOKA_STATE = "LokaCallback"
"""The LoKA callback's key among a checkpoint's callback states."""


@dataclass(frozen=True)
class TrainedModel:
    """What :func:`load_trained` read."""

    model: nn.Module
    """The run's model (``RecTrainModel``: ``model.model(dense, sparse) -> logits``), converted
    as the run converted it, with the checkpoint's weights, in eval mode."""
    plans: dict[str, LinearPlan]
    """Site name -> the plan Dispatch held at the checkpoint's step (empty: the job's LoKA is
    off, so the model has no site)."""
    checkpoint: Path
    """The ``step_*`` directory read."""
    step: int
    """Its step."""


def load_trained(job: JobConfig, path: str | Path, *, device: str | torch.device = "cpu") -> TrainedModel:
    """Read the model and plans of the run `job` describes from its checkpoint at `path`.

    Args:
        job: the run's config (its ``config.yaml``).
        path: a run directory, its ``checkpoints/`` directory or one ``step_*`` directory (a
            run directory means its latest checkpoint).
        device: where the model goes.

    Raises:
        CheckpointError: `path` holds no checkpoint, or the checkpoint is not this job's (its
            keys or shapes differ: another model config, or another ``loka.mods``).
    """
    checkpoint = find_checkpoint(Path(path))
    if checkpoint is None:
        raise CheckpointError(
            f"{path}: no checkpoint there; give a run directory (runs/<run>) whose training saved "
            "one (trainer.checkpoint_every or trainer.checkpoint_at_end), or its checkpoints/step_* directory"
        )
    data = make_dataset(job.data, split="train", rank=0, world_size=1, batch_size=job.trainer.batch_size)
    built = prepare_model(job.model, data=data, seed=job.trainer.seed).module
    if job.loka.enabled and job.loka.mods.enabled:
        convert(built, config=job.loka.mods)
    # The embedding tables are built on the meta device: storage for them (the checkpoint
    # fills it), the rest of the model as built.
    on_meta = {name for name, t in [*built.named_parameters(), *built.named_buffers()] if t.is_meta}
    for module in built.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    model = built.to(device)
    state = model.state_dict()
    uncovered = sorted(on_meta - set(state))
    if uncovered:  # storage the checkpoint would not fill
        raise CheckpointError(f"the model's {uncovered[:3]} are built on the meta device and are not in its state dict")
    try:
        dcp.load({"model": state}, checkpoint_id=str(checkpoint))
    except (CheckpointException, RuntimeError, ValueError) as exc:  # a missing key, another shape
        raise CheckpointError(
            f"{checkpoint} does not hold this job's model ({type(exc).__name__}: "
            f"{(str(exc).strip().splitlines() or [''])[-1]}); "
            "load it with the run's own config.yaml (model, data and loka.mods as it trained)"
        ) from exc
    model.load_state_dict(state)  # DCP loads in place; entries it replaced are taken too
    model.eval()
    plans = _plans(checkpoint, set(sites(model)))
    step = int(checkpoint.name.rsplit("_", 1)[-1]) if checkpoint.name.startswith("step_") else -1
    logger.info("export: %s (step %d): %d sites, %d with an FP8 plan", checkpoint, step, len(plans),
                sum(any(gp.is_fp8 for gp in (p.forward, p.grad_input, p.grad_weight)) for p in plans.values()))
    return TrainedModel(model=model, plans=plans, checkpoint=checkpoint, step=step)


def _plans(checkpoint: Path, names: set[str]) -> dict[str, LinearPlan]:
    """The LoKA callback's plans in rank 0's state of `checkpoint` (every rank holds the same)."""
    rank0 = checkpoint / "rank_0.pt"
    if not rank0.is_file():
        raise CheckpointError(f"{checkpoint}: rank_0.pt is missing; the checkpoint is incomplete")
    if not names:  # a model loaded without LoKA's sites (loka off): its plans mean nothing here
        return {}
    local = torch.load(rank0, map_location="cpu", weights_only=False)
    loka = local.get("callbacks", {}).get(LOKA_STATE) or {}
    saved = loka.get("dispatch", {}).get("plans", {})
    if not saved:
        raise CheckpointError(
            f"{checkpoint}: the run trained without LoKA (its checkpoint holds no plans); load it with the "
            "run's own config (loka off), or convert and serve the loaded model with plans of your own"
        )
    if set(saved) != names:
        raise CheckpointError(
            f"{checkpoint}: its LoKA plans name the sites {sorted(saved)[:4]}..., this model's are "
            f"{sorted(names)[:4]}...; load it with the run's own loka.mods"
        )
    return {name: LinearPlan.from_dict(plan) for name, plan in saved.items()}
