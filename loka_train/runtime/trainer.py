"""The Trainer: shards a DLRM-family model or your own TorchRec model, trains, evaluates, checkpoints.

It is deliberately a thin, explicit loop around TorchRec's public pieces (DistributedModelParallel,
a sharding planner or an explicit plan, fused row-wise Adagrad on the tables,
TrainPipelineSparseDist), with a `Callback` seam that the LoKA plugin uses; one code path serves
CPU (gloo) and GPU (nccl). Its parts: `runtime.sharding` (sharder and plan), `runtime.compile`
and `runtime.graphs` (compiled and CUDA-graphed dense modules), `runtime.preflight` (checks),
`runtime.rundirs` (the run's directory), `runtime.checkpoint`, and `runtime.train_model` (the
model: built from a `ModelConfig`, or your own, and what your own must provide).

Shape legend: B batch (per rank), G global batch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from loka_train.data import DataConfig, make_dataset
from loka_train.data.metrics import auc, calibration, normalized_entropy
from loka_train.data.pinning import PinnedBatches, pin_batch
from loka_train.data.prefetch import Prefetcher
from loka_train.data.protocol import CachedBatches
from loka_train.models import init_embedding_tables
from loka_train.runtime.callbacks import Callback, CallbackList
from loka_train.runtime.checkpoint import CheckpointError, CheckpointManager, read_meta, restore
from loka_train.runtime.compile import (
    FrameSkips,
    allow_recompiles,
    compile_in_place,
    compile_options,
)
from loka_train.runtime.config import TORCH_DTYPES, TrainerConfig
from loka_train.runtime.distributed import (
    DistInfo,
    init_distributed,
    on_rank_zero,
    raise_on_all_ranks,
)
from loka_train.runtime.eager import EagerSteps
from loka_train.runtime.graphs import (
    DENSE_SUBMODULES,
    INNER_SUBMODULES,
    DenseGraphs,
    dense_submodules,
)
from loka_train.runtime.metrics import MetricsLogger
from loka_train.runtime.preflight import (
    check_cuda_graphs,
    check_eval_data,
    check_resumable,
    short_data_error,
)
from loka_train.runtime.rundirs import RunDirs, RunStart
from loka_train.runtime.sharding import make_sharder, make_sharding_plan
from loka_train.runtime.sparse2d import check_sparse2d, model_parallel, sync_due
from loka_train.runtime.train_model import ModelSpec, check_train_output, prepare_model

logger = logging.getLogger(__name__)

_WARMUP_STEPS = 3
"""Steps excluded from the steps/s figure (first-step allocations, pipeline fill)."""


class _StepHook:
    """Optimizer facade for the train pipelines: runs `on_after_backward` before stepping.

    TorchRec's pipelines own forward, backward and `optimizer.step()`; this is the one
    place between backward and the dense update where callbacks can look at gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
        self.optimizer = optimizer
        self.trainer = trainer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        self.trainer.callbacks.call("on_after_backward", self.trainer, self.trainer.step)
        self.optimizer.step()


class Trainer:
    """Trains a sharded DLRM-family model, or your own TorchRec model, with callbacks.

    Args:
        model: a `ModelConfig` (one of the DLRM family, built for the data), your own unsharded
            model, or a function that builds it (called once per process with the RNG seeded
            from ``trainer.seed``). Your own model is called as ``model(batch) -> (loss,
            (loss, logits, labels))`` (TorchRec's ``DLRMTrain`` does so) and keeps its tables in
            ``EmbeddingBagCollection`` modules over the data's features; `runtime.train_model` says
            what else it must provide, and a model that lacks it is refused with the fix.
        data: which dataset to read.
        trainer: how to train (steps, batch, sharding, checkpoints, ...).
        callbacks: plug-ins called at each hook (the LoKA callback is one).

    Example:
        >>> summary = Trainer(model=ModelConfig(), data=DataConfig(),
        ...                   trainer=TrainerConfig(steps=50)).fit()
        >>> summary["eval/ne"]
        >>> Trainer(model=lambda: DLRMTrain(DLRM(...)), data=DataConfig(),
        ...         trainer=TrainerConfig(steps=50), callbacks=[LokaCallback(LokaConfig.preset("safe"))])
    """

    out_dir: Path
    """This run's directory (``<trainer.out_dir>/<time>``, `runtime.rundirs`), set by `fit` once
    the run's checks passed; every file of the run goes there."""
    metrics: MetricsLogger
    """The run's metrics (rank 0 writes them), set with `out_dir`."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        data: DataConfig,
        trainer: TrainerConfig,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.data_cfg = data
        self.cfg = trainer
        self.callbacks = CallbackList(list(callbacks))
        self.step = 0
        self.progress_postfix: dict[str, str] = {}
        """Extra items callbacks want on the progress bar (e.g. FP8 coverage)."""
        self.fallbacks: list[str] = []
        """Every fallback taken during the run (logged and reported)."""
        self.compiled_modules: list[str] = []
        """Dense submodules compiled by ``trainer.compile_dense`` (names without wrappers)."""
        self._frame_skips: FrameSkips | None = None
        """Frames of the compiled dense modules that dynamo gave up on (``compile_skipped_frames``)."""
        self.graphs: DenseGraphs | None = None
        """The CUDA graphs of the dense submodules (``trainer.cuda_graphs``)."""
        self.eager = EagerSteps()
        """Which compiled or graphed dense submodules run eagerly on the current step (the
        callbacks' ``eager_modules``)."""

        self.dist: DistInfo = init_distributed(trainer.device)
        self.rank = self.dist.rank
        self.world_size = self.dist.world_size
        self.device = self.dist.device
        check_cuda_graphs(trainer, self.device)
        self.sparse2d = check_sparse2d(trainer, world_size=self.world_size, device=self.device)
        self.replica_sync: Callable[[int], None] | None = None
        """2D sparse parallelism (`sparse2d`): ``sync(step)`` of the replicas; a callback may replace it in on_train_start."""
        self.dense_dtype = TORCH_DTYPES[trainer.dense_dtype]
        """The dtype the dense towers compute in (``trainer.dense_dtype``): bf16 autocast around
        forward and backward, or fp32. Callbacks read it (`LoopState.dense_dtype`)."""
        if trainer.pin_memory and self.device.type != "cuda":
            raise ValueError(
                f"trainer.pin_memory=true needs a CUDA device, this run is on {self.device}: "
                "set trainer.pin_memory=null (auto) or false"
            )
        self.pins_memory = self.device.type == "cuda" if trainer.pin_memory is None else trainer.pin_memory
        """The train batches are pinned before the step (``trainer.pin_memory``)."""
        self.runs = RunDirs(trainer.out_dir, keep=trainer.keep_runs)
        """The run directories under ``trainer.out_dir``."""

        self.train_data = make_dataset(
            data, split="train", rank=self.rank, world_size=self.world_size,
            batch_size=trainer.batch_size,
        )
        self.eval_data = make_dataset(
            data, split="eval", rank=self.rank, world_size=self.world_size,
            batch_size=trainer.batch_size,
        )
        prepared = prepare_model(model, data=self.train_data, seed=trainer.seed)
        self.model: nn.Module = prepared.module
        self.model_name = prepared.name
        """``ModelConfig.kind``, or your own model's class name."""
        self.tables = prepared.tables
        """Embedding table name -> (rows, dim): filled from ``trainer.seed`` after sharding."""
        # Callbacks may change these in on_before_shard (e.g. quantized comm codecs).
        self.qcomm_codecs_registry: dict[str, Any] | None = None
        self.data_parallel_wrapper: Any = None
        self.sharding_plan: ShardingPlan | None = None
        self.optimizer: CombinedOptimizer | None = None
        self._checkpoints: CheckpointManager | None = None
        self._eval_pipeline: Any = None
        """The train pipeline while an evaluation's callbacks run (:meth:`evaluate_again`)."""

    # ----------------------------------------------------------------------------- set-up
    def _shard(self) -> None:
        self.callbacks.call("on_before_shard", self)
        sharder = make_sharder(self.cfg, qcomm_codecs_registry=self.qcomm_codecs_registry)
        group = self.sparse2d.sharding_group_size if self.sparse2d is not None else self.world_size
        self.sharding_plan = make_sharding_plan(
            self.model, sharder, kind=self.cfg.sharding, world_size=group,
            local_world_size=min(self.dist.local_world_size, group), device=self.device,
        )
        self.model = model_parallel(self.model, device=self.device, plan=self.sharding_plan, sharders=[sharder], layout=self.sparse2d, data_parallel_wrapper=self.data_parallel_wrapper)
        if self.sparse2d is not None:  # DMPCollection's own sync (fp32 mean) unless a callback sets one
            self.replica_sync = lambda step: self.model.sync()  # type: ignore[operator]
        found = init_embedding_tables(self.model, seed=self.cfg.seed, tables=self.tables)
        # Each table appears once per weight key; a sharded model may split none of them.
        assert found >= len(self.tables), f"initialised {found} of {len(self.tables)} tables"
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=self.cfg.dense_lr, eps=self.cfg.eps),
        )
        self._dense_optimizer = dense
        self._sparse_optimizer: KeyedOptimizer = self.model.fused_optimizer  # type: ignore[assignment]
        self.optimizer = CombinedOptimizer([("sparse", self._sparse_optimizer), ("dense", dense)])
        if self.cfg.compile_dense:
            self._compile_dense()
        elif self.cfg.cuda_graphs:
            self.graphs = self._install_graphs()

    def _install_graphs(self, **kwargs: Any) -> DenseGraphs:
        """``trainer.cuda_graphs``: graph the dense submodules, the inner ones sharing their
        outputs unless ``trainer.cuda_graphs_share_outputs=false``."""
        inner = INNER_SUBMODULES if self.cfg.cuda_graphs_share_outputs else ()
        return DenseGraphs.install(self.model, names=DENSE_SUBMODULES, inner=inner, eager=self.eager, **kwargs)

    def _compile_dense(self) -> None:
        """Compile the dense submodules, after sharding (``runtime.compile``): without CUDA graphs
        in place or behind :func:`~loka_train.runtime.compile.eager_or_compiled`; with
        ``cuda_graphs``, each module's forward under the graphs' router (the router's
        bookkeeping stays outside the compiled code, and the captures record the compiled
        kernels). TorchRec's train pipeline treats modules without a sharded child as FX leaves,
        so its tracing calls these modules without entering them.
        """
        self._frame_skips = FrameSkips()
        self.eager.compiled_requests = self.cfg.sampled_compiled
        options = compile_options(self.cfg.compile_backend)
        if self.cfg.cuda_graphs:
            self.graphs = self._install_graphs(compile=lambda fn: torch.compile(fn, **options))
            self.compiled_modules.extend(self.graphs.names)
        else:
            found = dense_submodules(self.model, DENSE_SUBMODULES, setting="trainer.compile_dense", verb="compile")
            self.compiled_modules.extend(compile_in_place(found, options=options, eager=self.eager))
        allow_recompiles(self.model)
        logger.info(
            "compiled %s with torch.compile(backend=%r)%s",
            ", ".join(self.compiled_modules),
            self.cfg.compile_backend,
            " under CUDA graphs" if self.graphs is not None else "",
        )

    @property
    def compile_skipped_frames(self) -> list[str]:
        """Frames of the compiled dense modules that dynamo gave up on during the run and runs
        eagerly, as ``"function (file line N)"`` (each also a fallback)."""
        return list(self._frame_skips.frames) if self._frame_skips is not None else []

    def _report_frame_skips(self) -> None:
        """A frame of the compiled dense modules that dynamo gave up on since they were compiled
        runs eagerly (unfused) for the rest of the run: a fallback, logged and listed."""
        if self._frame_skips is not None:
            self._frame_skips.report(self.fallbacks)

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": rng,
            "callbacks": self.callbacks.state_dict(),
        }

    def _meta(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "sharding": self.cfg.sharding,
            "batch_size": self.cfg.batch_size,
            "seed": self.cfg.seed,
        }

    def save_checkpoint(self) -> Path:
        """Save the whole run state at the current step (collective)."""
        assert self._checkpoints is not None, "fit() opens the run directory first"
        return self._checkpoints.save(self.step, self.state_dict(), self._meta())

    def _preflight(self) -> RunStart:
        """Refuse, before anything is trained or written, a run that cannot go as configured:
        the data (on every rank, agreed), then (rank 0) the checkpoint it would resume. Returns
        where the run writes and what it resumes; nothing on disk has changed yet."""
        error: Exception | None = None
        try:
            self._check_data_length()
        except Exception as exc:  # raised below on every rank
            error = exc
        raise_on_all_ranks(error, world_size=self.world_size, device=self._coll_device)
        return on_rank_zero(self._plan_run, rank=self.rank, world_size=self.world_size, device=self._coll_device)

    def _plan_run(self) -> RunStart:
        start = self.runs.plan(self.cfg.resume)
        if start.checkpoint is not None:
            now = {**self._meta(), "world_size": self.world_size}
            check_resumable(start.checkpoint, self.cfg, saved=read_meta(start.checkpoint), now=now)
        return start

    def _open_run(self, start: RunStart) -> None:
        """Create (or, continuing a run, reuse) the run directory on rank 0 and open its
        checkpoints and metrics on every rank."""
        self.out_dir = on_rank_zero(
            lambda: self.runs.open(start), rank=self.rank, world_size=self.world_size, device=self._coll_device
        )
        if self.rank == 0:
            how = "continues that run" if start.run_dir is not None else "new"
            logger.info("run directory %s (%s; %s points at it)", self.out_dir, how, self.runs.root / "latest")
        self._checkpoints = CheckpointManager(
            self.out_dir / "checkpoints", rank=self.rank, world_size=self.world_size, keep=self.cfg.keep_checkpoints,
        )
        self.metrics = MetricsLogger(self.out_dir if self.rank == 0 else None, tensorboard=self.cfg.tensorboard)
        self.fallbacks.extend(self.runs.fallbacks)  # rank 0's: it opened the run directory
        self.fallbacks.extend(self.metrics.fallbacks)

    def _check_data_length(self) -> None:
        """Finite eval data must hold `trainer.eval_batches` batches: checked before training
        (it is small). The train split is not read ahead (for a pass over a large data set
        that would read all of it, on every rank, before step 0): when it ends before
        `trainer.steps`, training stops there with the same kind of error
        (`_short_train_data`)."""
        check_eval_data(self.eval_data, self.cfg, self.data_cfg, world_size=self.world_size)

    def _short_train_data(self, step: int) -> ValueError:
        """The train data ended at `step` (0-based): every rank reads equal slices of each global
        batch, so all ranks reach this at the same step."""
        return short_data_error(
            self.cfg, self.world_size, needed=self.cfg.steps, have=step, needed_key="trainer.steps",
            source_key="data.path", source=self.data_cfg.path,
        )

    def _resumes_by_copy(self) -> bool:
        """Whether a resume copies the checkpoint's tables into this run's shards by their
        offsets (`checkpoint.load_by_copy`) instead of DCP loading into them: under 2D sparse
        parallelism, whose replicated shards DCP does not load into. So a 2D run can start from
        a fully sharded run's checkpoint."""
        return self.sparse2d is not None

    def _maybe_resume(self, path: Path | None) -> int:
        """Restore checkpoint `path` (checked by `_plan_run`) into the sharded run; returns its step."""
        if path is None:
            return 0
        assert self._checkpoints is not None and self.optimizer is not None
        live = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}  # loaded in place
        saved, meta = self._checkpoints.load(path, into=live, by_copy=self._resumes_by_copy())
        error: CheckpointError | None = None
        fresh: list[str] = []
        try:
            fresh = restore(saved, meta, path=path, manager=self._checkpoints, model=self.model, optimizer=self.optimizer,
                            callbacks=self.callbacks, device=self.device, allow_new=self.cfg.resume_new_callbacks)
        except CheckpointError as exc:
            error = CheckpointError(
                f"cannot resume from {path}: {exc}: resume it with the settings that wrote it "
                f"({path / 'meta.json'}), or start a new run with trainer.resume=never"
            )
        except Exception as exc:  # any failure, so no rank waits alone in the agreement below
            error = CheckpointError(f"cannot restore {path}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        raise_on_all_ranks(error, world_size=self.world_size, device=self._coll_device)
        step = int(saved["step"])
        if fresh:
            logger.warning("resumed %s without state for callbacks %s (trainer.resume_new_callbacks): "
                           "they start fresh at step %d", path, fresh, step)
        logger.info("resumed from %s at step %d", path, step)
        return step

    def _eval_between_steps(self, pipeline: Any) -> dict[str, float]:
        """Evaluate after the last finished step, bracketed by the callbacks' eval hooks (which
        get that step 0-based, as on_step_end does)."""
        self.callbacks.call("on_eval_start", self, self.step - 1)
        metrics = self._eval_with(pipeline)
        self._eval_pipeline = pipeline
        try:
            self.callbacks.call("on_eval_end", self, self.step - 1, metrics)
        finally:
            self._eval_pipeline = None
        if self.rank == 0:
            logger.info("step %d: eval NE %.4f, AUC %.4f, calibration %.4f (%d samples)", self.step,
                        metrics["eval/ne"], metrics["eval/auc"], metrics["eval/calibration"], metrics["eval/samples"])
        return metrics

    def _clock(self) -> float:
        """`time.perf_counter()` once the device has run the work queued so far, so a timed
        region is not billed for GPU work launched before it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def _coll_device(self) -> torch.device:
        return self.device if self.dist.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None) -> dict[str, float]:
        """NE, AUC and calibration on `eval_batches` held-out batches per rank, gathered over ranks."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        logits, labels = [], []
        try:
            for batch in self.eval_data.batches(0, self.cfg.eval_batches):
                with self._autocast():
                    _, (_, logits_B, labels_B) = model(batch.to(self.device))
                logits.append(logits_B.float())
                labels.append(labels_B.float())
        finally:
            model.train(was_training)
        local = torch.stack([torch.cat(logits), torch.cat(labels)]).to(self._coll_device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        both = torch.cat(gathered, dim=1).cpu()
        return {
            "eval/ne": normalized_entropy(both[0], both[1]),
            "eval/auc": auc(both[0], both[1]),
            "eval/calibration": calibration(both[0], both[1]),
            "eval/samples": float(both.shape[1]),
        }

    # ----------------------------------------------------------------------------- train
    def _autocast(self) -> torch.autocast:
        """bf16 autocast when the dense dtype is bf16, else a disabled one."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.dense_dtype == torch.bfloat16
        )

    def _set_lrs(self, step: int) -> None:
        # A function of the step alone, so a resumed run continues the same schedule. The fused
        # embedding optimizer hands its param_groups' lr to the tables in zero_grad(), which the
        # pipelines call before this step's backward (where the tables update).
        dense, sparse = self.cfg.dense_lr_at(step), self.cfg.sparse_lr_at(step)
        for group in self._dense_optimizer.param_groups:
            group["lr"] = dense
        for group in self._sparse_optimizer.param_groups:
            group["lr"] = sparse

    def _pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

        assert self.optimizer is not None
        hook = _StepHook(self.optimizer, self)
        cls = TrainPipelineSparseDist if self.cfg.pipeline == "sparse_dist" else TrainPipelineBase
        return cls(self.model, hook, self.device)  # type: ignore[arg-type]

    def evaluate_again(self) -> dict[str, float]:
        """The held-out metrics of the model as it is now, for a callback's ``on_eval_end`` that
        evaluates it once more in another form (the LoKA callback with its FP8 forwards in high
        precision): the train pipeline is set aside around it as for the evaluation itself, and
        no callback is called. Outside ``on_eval_end`` (after ``fit``, say) it is
        :meth:`evaluate`."""
        if self._eval_pipeline is not None:
            return self._eval_with(self._eval_pipeline)
        return self.evaluate()

    def _eval_with(self, pipeline: Any) -> dict[str, float]:
        # TrainPipelineSparseDist rewrites the sharded modules' forward; detach it for a
        # plain forward pass, then re-attach (in-flight training batches are kept).
        if hasattr(pipeline, "detach"):
            model = pipeline.detach()
            try:
                return self.evaluate(model)
            finally:
                pipeline.attach(model)
        return self.evaluate()

    def fit(self) -> dict[str, Any]:
        """Run the training loop to `trainer.steps`; returns the run summary."""
        plan = self._preflight()
        self._open_run(plan)
        self._shard()
        start = self._maybe_resume(plan.checkpoint)
        self.metrics.start_at(start)
        self.step = start
        self.callbacks.call("on_train_start", self)
        pipeline = self._pipeline()
        batches: Iterator[Batch] = self.train_data.batches(start, self.cfg.steps - start)
        pinned = None
        if self.pins_memory:
            if isinstance(self.train_data, CachedBatches):
                # Page-locking a batch the first time stalls the steps' launches (H100, batch
                # 32768: 16-24 ms steps instead of 14 until ~1 GiB was pinned); do it now.
                num, nbytes = self.train_data.pin_cache(pin_batch)
                if num:
                    logger.info("pinned %d cached train batches (%.2f GB) before the first step", num, nbytes / 1e9)
            batches = pinned = PinnedBatches(batches)
        prefetcher = None
        if self.cfg.prefetch:
            prefetcher = Prefetcher(batches, depth=self.cfg.prefetch)
            batches = prefetcher

        bar = None
        if self.rank == 0 and self.cfg.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=self.cfg.steps, initial=start, desc="train", dynamic_ncols=True)

        loss_sum = torch.zeros((), device=self.device)
        loss_count = 0
        last_loss = math.nan
        eval_metrics: dict[str, float] = {}
        timed_from: float | None = None
        timed_steps = 0
        paused_s = 0.0  # eval and checkpoint wall time since timed_from: not in steps/s
        stopped = False
        try:
            while self.step < self.cfg.steps:
                step = self.step
                self._set_lrs(step)
                self.callbacks.call("on_step_start", self, step)
                requested, replayable = self.callbacks.requests(self, step)
                self.eager.begin_step(requested, replayable=replayable and self.cfg.cuda_graphs_requested)
                # TorchRec pipelines return the model output's second element.
                with self._autocast():
                    try:
                        output = pipeline.progress(batches)
                    except StopIteration:
                        raise self._short_train_data(step) from None
                if step == start:
                    check_train_output(output, self.model_name)
                if self.replica_sync is not None and sync_due(step, every=self.cfg.sharding_sync_every, last_step=self.cfg.steps - 1):
                    self.replica_sync(step)
                loss, _, _ = output
                loss_sum += loss.detach()
                loss_count += 1
                self.step = step + 1
                done = self.step - start
                if done == _WARMUP_STEPS:
                    timed_from = self._clock()
                    self._report_frame_skips()
                elif done > _WARMUP_STEPS:
                    timed_steps += 1

                metrics: dict[str, float] = {}
                if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                    last_loss = (loss_sum / loss_count).item()
                    metrics["train/loss"] = last_loss
                    loss_sum.zero_()
                    loss_count = 0
                    if timed_from is not None and timed_steps:
                        train_s = time.perf_counter() - timed_from - paused_s
                        metrics["train/steps_per_s"] = timed_steps / train_s
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                    paused_from = self._clock()
                    eval_metrics = self._eval_between_steps(pipeline)
                    metrics.update(eval_metrics)
                    if timed_from is not None:
                        paused_s += self._clock() - paused_from
                self.callbacks.call("on_step_end", self, step, metrics)
                self.metrics.log(self.step, metrics)
                if bar is not None:
                    bar.update(1)
                    if "train/loss" in metrics:
                        bar.set_postfix({"loss": f"{last_loss:.4f}", **self.progress_postfix})

                is_last = self.step == self.cfg.steps
                due = self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0
                if due or (is_last and self.cfg.checkpoint_at_end):
                    paused_from = self._clock()
                    self.save_checkpoint()
                    if timed_from is not None:
                        paused_s += self._clock() - paused_from
                if self.cfg.stop_after_step is not None and self.step >= self.cfg.stop_after_step:
                    stopped = not is_last
                    break
        except BaseException:
            # Stop the input thread and the bar before the error propagates (no leaked thread).
            if prefetcher is not None:
                prefetcher.close()
            if bar is not None:
                bar.close()
            raise
        train_s = self._clock() - timed_from - paused_s if timed_from is not None else math.nan
        if prefetcher is not None:
            prefetcher.close()
        if bar is not None:
            bar.close()

        if not stopped and (not eval_metrics or self.step % max(self.cfg.eval_every, 1) != 0):
            eval_metrics = self._eval_between_steps(pipeline)
        self._report_frame_skips()
        summary: dict[str, Any] = {
            "steps": self.step,
            "stopped_early": stopped,
            "world_size": self.world_size,
            "device": str(self.device),
            "dense_dtype": self.cfg.dense_dtype,
            "model": self.model_name,
            "sharding": self.cfg.sharding,
            "sharding_group_size": self.cfg.sharding_group_size,
            "global_batch": self.cfg.batch_size * self.world_size,
            "train/loss": last_loss,
            "train/steps_per_s": timed_steps / train_s if timed_steps else math.nan,
            **eval_metrics,
            "fallbacks": list(self.fallbacks),
            "compiled": list(self.compiled_modules),
            "compile_skipped_frames": list(self.compile_skipped_frames),
        }
        if pinned is not None:
            summary["pinned_batches"] = {"pinned": pinned.pinned, "reused": pinned.reused}
        if self.graphs is not None:
            summary["cuda_graphs"] = self.graphs.stats()
            self.fallbacks.extend(f for f in self.graphs.fallbacks if f not in self.fallbacks)
        self.callbacks.call("on_train_end", self, summary)
        summary["fallbacks"] = list(self.fallbacks)  # again: on_train_end may have added some
        if self.rank == 0:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        self.metrics.close()
        if dist.is_initialized():
            dist.barrier()  # every rank done (rank 0 wrote the reports) before any tears down
        return summary

    def close(self) -> None:
        """Destroy the process group if this Trainer created it."""
        if self.dist.owns_group and dist.is_initialized():
            dist.destroy_process_group()
