"""The model a run trained, from its checkpoint, unsharded on one process, with its LoKA plans.

A run's checkpoint holds its model and optimizer through ``torch.distributed.checkpoint``
(the embedding tables as shards of however many ranks trained them) and each rank's callback
states (``runtime.checkpoint``). :func:`load_trained` builds the run's model from its
:class:`~loka_train.job.JobConfig` (a run directory's ``config.yaml``, composed by
``launch/export.py``), converts it as the run's ``loka.mods`` did, reads the model's weights
into it (every table whole, on one device; no process group needed), and restores the LoKA
callback's state as a resumed run of one process does: the plans Dispatch held at that step,
and the static scales (``loka.mods.static_scales``) from the Probe's window. :func:`loka_train.export.serve` then
prepares it for inference.

Example::

    trained = load_trained(job, Path("runs/latest"))
    model = serve(trained.model, plans=trained.plans)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from loka_train.data import make_dataset
from loka_train.export.decide import SafeForwards
from loka_train.job import JobConfig
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import sites
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.checkpoint import CheckpointError, read_meta
from loka_train.runtime.config import TORCH_DTYPES
from loka_train.runtime.context import RunContext
from loka_train.runtime.rundirs import find_checkpoint
from loka_train.runtime.train_model import prepare_model

logger = logging.getLogger(__name__)

__all__ = ["TrainedModel", "load_trained"]



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
    safe_forwards: SafeForwards | None = None
    """The FP8 forwards the run's Probe judged safe when it stopped, with its Dispatch config:
    ``decide_for_batch``'s candidates beyond the trained plans (None: the job's LoKA is off)."""


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
    device = torch.device(device)
    # The LoKA callback converts the model as the run did and, after the weights, restores its
    # state as a resumed run does: the plans, and static scales from the Probe's window.
    loka = LokaCallback(job.loka) if job.loka.enabled else None
    ctx = RunContext(model=built, device=device, out_dir=checkpoint.parent.parent,
                     dense_dtype=TORCH_DTYPES[job.trainer.dense_dtype])
    if loka is not None:
        loka.on_before_shard(ctx)
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
    plans: dict[str, LinearPlan] = {}
    safe = None
    if loka is not None and sites(model):
        loka.load_state_dict(_loka_state(checkpoint, loka))
        ctx.model = model
        loka.on_train_start(ctx)
        assert loka.dispatcher is not None and loka.probe is not None
        plans = dict(loka.dispatcher.plans)
        safe = SafeForwards(verdicts={k: v for k, v in loka.probe.verdicts().items() if k[1] == "forward"},
                            config=job.loka.dispatch)
    model.eval()
    step = int(checkpoint.name.rsplit("_", 1)[-1]) if checkpoint.name.startswith("step_") else -1
    logger.info("export: %s (step %d): %d sites, %d with an FP8 plan", checkpoint, step, len(plans),
                sum(any(gp.is_fp8 for gp in (p.forward, p.grad_input, p.grad_weight)) for p in plans.values()))
    return TrainedModel(model=model, plans=plans, checkpoint=checkpoint, step=step, safe_forwards=safe)


def _loka_state(checkpoint: Path, loka: LokaCallback) -> dict[str, Any]:
    """The LoKA callback's state for one process from `checkpoint` (its ranks' merged where
    several wrote it, as a resumed run of one process merges them)."""
    meta = read_meta(checkpoint)
    world_size = int(meta["world_size"])
    states = []
    for rank in range(world_size):
        path = checkpoint / f"rank_{rank}.pt"
        if not path.is_file():
            raise CheckpointError(f"{checkpoint}: {path.name} is missing; the checkpoint is incomplete")
        callbacks = torch.load(path, map_location="cpu", weights_only=False)["callbacks"]
        if loka.name not in callbacks:  # the key a checkpoint keeps the callback's state under
            raise CheckpointError(
                f"{checkpoint}: the run trained without LoKA (its checkpoint holds no LoKA state); load it "
                "with the run's own config (loka off), or convert and serve the loaded model with plans of "
                "your own"
            )
        states.append(callbacks[loka.name])
    return states[0] if world_size == 1 else loka.merge_rank_states(states, rank=0, world_size=1)
