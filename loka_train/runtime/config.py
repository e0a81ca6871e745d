"""Trainer configuration (the `trainer:` group of the hydra config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHARDING_TYPES = ("auto", "table_wise", "column_wise", "row_wise", "data_parallel")
PIPELINES = ("sparse_dist", "base")
DENSE_DTYPES = ("fp32", "bf16")
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The ``torch.dtype`` of each of :data:`DENSE_DTYPES`."""
SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("auto", "never", "must")
MLPERF_DECAY_POWER = 2.0
"""Exponent of MLPerf's DLRM reference learning-rate decay (the default of lr_decay_power)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """How the Trainer shards, steps, evaluates, logs and checkpoints.

    Example:
        >>> cfg = TrainerConfig(steps=100, batch_size=512, sharding="row_wise")
        >>> cfg.batch_size, cfg.sharding
        (512, 'row_wise')
    """

    steps: int = 300
    """Total optimizer steps of the run (a resumed run continues up to this number)."""

    batch_size: int = 256
    """Samples per rank per step; the global batch is batch_size * world_size."""

    dense_lr: float = 0.05
    """Learning rate of Adagrad on the dense (MLP / interaction) parameters."""

    dense_warmup_steps: int = 0
    """Linear warm-up of ``dense_lr`` over the first N steps (0: none). Adagrad's first step
    moves every dense weight by about the learning rate (g / sqrt(g^2)), which blows up wide
    towers (loss ~1e5-1e6 at step 2 for MLPerf-sized DLRM/DCN at lr 0.05); a warm-up avoids
    it. The cpu/gpu presets set it."""

    sparse_lr: float = 0.05
    """Learning rate of the fused row-wise Adagrad on the embedding tables."""

    lr_decay_steps: int = 0
    """Polynomial decay of both learning rates over N steps (0: none): at step
    ``lr_decay_start + k`` the rates are scaled by ``(1 - k / N) ** lr_decay_power``, so the
    full rate at the start step and exactly 0 from step ``lr_decay_start + N`` on (the form
    of MLPerf's DLRM reference scheduler, which stops at a small floor instead of 0).
    Decaying to 0 ends a run in a basin rather than wherever constant-rate noise leaves it,
    which is what makes the end NE of two runs comparable (``bench/e2e.py --ne-decay``)."""

    lr_decay_start: int = 0
    """The step (0-based) the decay counts from; the rates are ``dense_lr`` / ``sparse_lr``
    (after the warm-up) up to and at it. Needs ``lr_decay_steps``."""

    lr_decay_power: float = MLPERF_DECAY_POWER
    """Exponent of the decay (MLPerf's DLRM reference: 2). Needs ``lr_decay_steps``."""

    sparse_optimizer: str = "rowwise_adagrad"
    """Fused optimizer of the embedding tables: "rowwise_adagrad" (one accumulator per row,
    the DLRM standard) or "adagrad" (one per element; the GPU bundle ships only row-wise).
    Row-wise accumulators are per shard: a column-wise sharded table gets one accumulator
    per row of each column shard, which is not the same optimizer as the unsharded table's."""

    eps: float = 1e-8
    """Adagrad epsilon (dense and sparse)."""

    sharding: str = "auto"
    """Embedding sharding: "auto" (TorchRec planner) or one type forced on every table:
    table_wise (round-robin over ranks), column_wise (every table split over all ranks),
    row_wise, data_parallel (replicated, dense optimizer). On CPU the planner offers no
    row_wise; forcing it here builds an explicit plan, which TorchRec honours."""

    sharding_group_size: int | None = None
    """2D sparse parallelism (TorchRec's ``DMPCollection``): shard the tables over groups of
    this many ranks and replicate them across the ``world_size / sharding_group_size`` groups,
    which average their replicas every ``sharding_sync_every`` steps. Fewer ranks per table
    means smaller embedding all-to-alls; the price is a replica sync and a copy of the tables
    per group. ``trainer.sharding`` then plans for one group. None: every table sharded over
    all ranks (plain ``DistributedModelParallel``); 1: every rank holds every table. Needs CUDA
    (nccl) and a world size it divides (`runtime.sparse2d`). It writes no checkpoints (DCP on
    ``DMPCollection``'s replicated shards is not supported): set ``checkpoint_every=0`` and
    ``checkpoint_at_end=false``. It resumes from a checkpoint of a run with the same model and
    ``trainer.sharding`` (a fully sharded one), copying every table into its shards by their
    offsets (`checkpoint.load_by_copy`; each rank reads the whole tables it holds a piece of
    into host memory). With the LoKA comm policy on, the sync goes
    through LoKA's codecs (``loka.comm.replica_sync``), else through ``DMPCollection.sync``
    (fp32 mean of the weights and the optimizer state)."""

    sharding_sync_every: int = 1
    """With ``sharding_group_size``: steps between replica syncs (after steps N-1, 2N-1, ...
    and the last one). 1 syncs after every step, as TorchRec's ``DMPCollection`` is meant to
    be used (its ``sync()`` has no interval of its own); more lets the replicas drift apart
    for fewer syncs. ``eval_every`` must be a multiple of it, so that every evaluation sees
    synced replicas."""

    pipeline: str = "sparse_dist"
    """Train loop driver: "sparse_dist" (TorchRec TrainPipelineSparseDist, overlaps the
    sparse input dist with compute) or "base" (plain forward/backward/step)."""

    prefetch: int = 4
    """Batches generated ahead in a background thread (0: generate inline)."""

    pin_memory: bool | None = None
    """Pin the train batches in page-locked host memory before the step (in the prefetch
    thread), so that the pipeline's copy to the GPU is a DMA that does not hold up the host
    (``loka_train.data.pinning``). None: on when the run is on CUDA. A cached source's batches
    (``data.cache_batches``) are pinned once, up to 1 GiB of them."""

    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""

    dense_dtype: str = "fp32"
    """Compute dtype of the dense towers: "fp32", or "bf16" (torch.autocast around forward and
    backward, in training and eval; parameters, optimizer state and embedding tables stay
    fp32). Callbacks read it as ``trainer.dense_dtype``, a ``torch.dtype`` (the LoKA callback
    times its GEMMs with that output dtype)."""

    compile_dense: bool = False
    """After sharding, compile the dense submodules with ``torch.compile``: the bottom MLP
    (``dense_arch``), the interaction (``inter_arch``) and the top MLP (``over_arch``) of the
    DLRM family; in place (``nn.Module.compile``), or, with ``cuda_graphs``, each module's
    forward under the graphs' router. The sharded embedding collection stays eager (TorchRec's
    train pipeline traces around it). Parameter names and checkpoints are unchanged."""

    compile_backend: str = "inductor"
    """``torch.compile`` backend used by ``compile_dense``: "inductor" (generated kernels, the
    fast one on GPU), or a cheaper one for checks on CPU ("aot_eager", "eager")."""

    cuda_graphs: bool = False
    """After sharding, replay the forward and the backward of each dense submodule (bottom MLP,
    interaction, top MLP) as CUDA graphs (``loka_train.runtime.graphs``): a handful of launches
    per step instead of thousands, for host-bound steps. Needs a CUDA device (checked against the
    resolved ``device`` when the Trainer starts). Evaluation, the steps on which a callback
    requests a module eagerly (the LoKA Probe's sampled steps) and the first calls after a
    change of a ``forward_key()`` (a plan) run eagerly; such a change re-captures. Replays are
    bit-identical to the eager module. With ``compile_dense`` the graphs replay the compiled
    forward and backward (fused kernels, and none of the compiled code's host work on replayed
    steps); the capture's compiled variant (parameters as plain tensors) may round apart from the
    compiled code of eager calls."""

    cuda_graphs_requested: bool = False
    """With ``cuda_graphs``: on the steps where a callback requests a module eagerly and defers
    its host work to replays (``Callback.replayable_requests``: the LoKA Probe's sampled steps),
    capture the module's uncompiled forward as a graph of its own (kept beside the unrequested
    one, in the same memory pool) and replay it instead of running it eagerly. A sampled step
    then skips the host work of an eager step, which is what can pay on a host-bound step; it
    still pays its GPU work (the Probe's statistics, the uncompiled kernels), and the pool keeps
    what the larger capture needs on every step. Off by default: on a GPU-bound step (Wukong-
    style, batch 32768, H100) it left the sampled step's time unchanged and raised the peak
    reserved memory (``docs/performance.md``)."""

    compile_sampled: bool | None = None
    """With ``compile_dense``: on the steps where a callback requests a module (the LoKA Probe's
    sampled steps), run the module's compiled forward, not replayed, instead of its uncompiled
    one. The sampled sites report through opaque ops in the compiled code (``mods.probe_tap``:
    the same reports, no graph break), so a sampled step pays the Probe's measurements without
    the uncompiled forward and backward, and holds less memory. A module compiles one more
    variant, for the sampled steps, whichever of its sites sample. Not with
    ``cuda_graphs_requested``, which replays the uncompiled forward. ``null`` (default): on
    wherever ``compile_dense`` is on and ``cuda_graphs_requested`` off (:attr:`sampled_compiled`);
    ``false`` runs the sampled modules' uncompiled code."""

    cuda_graphs_share_outputs: bool = True
    """With ``cuda_graphs``: the bottom MLP's and the interaction's replays return their graphs'
    output buffers, which the next graphed module reads in place, instead of copies (DCN at
    batch 32768 on an H100: 13.91 -> 12.61 ms a step; ``DenseGraphs(shared_outputs=...)``).
    ``false`` copies every output, as before that change: to rule the sharing out when a graphed
    run differs from an eager one."""

    seed: int = 0
    """Seed of the dense initialisation, the embedding tables and the RNG state."""

    log_every: int = 20
    """Steps between metric logs (loss is accumulated on device in between)."""

    eval_every: int = 0
    """Steps between evaluations on the held-out split; 0 = only at the end."""

    eval_batches: int = 16
    """Batches (per rank) in one evaluation."""

    out_dir: str = "runs"
    """Directory of the runs: each run writes into its own ``<out_dir>/<YYYYmmdd-HHMMSS>/``
    (metrics.jsonl, TensorBoard events in tb/, checkpoints/, summary.json, train.log, the LoKA
    report) and ``<out_dir>/latest`` points at the newest (``loka_train.runtime.rundirs``)."""

    keep_runs: int = 10
    """Run directories kept under ``out_dir``: when a new run starts, the oldest beyond this
    number are deleted (never the run a checkpoint is resumed from). 0 keeps every run."""

    tensorboard: bool = True
    """Also write TensorBoard event files (needs the tensorboard package)."""

    progress_bar: bool = True
    """Show a progress bar on rank 0."""

    checkpoint_every: int = 0
    """Steps between checkpoints; 0 = only at the end of the run (if checkpoint_at_end)."""

    checkpoint_at_end: bool = True
    """Write a checkpoint after the last step."""

    keep_checkpoints: int = 2
    """Number of most recent checkpoints kept; older ones are deleted after a good save."""

    resume: str = "auto"
    """"auto": continue the latest run (``<out_dir>/latest``) in its directory when it holds a
    checkpoint, else start a new run; "never": a new run from step 0; "must": as auto, but fail
    when there is nothing to resume; any other value is the path of a checkpoint (a run
    directory, its checkpoints/ or one checkpoints/step_* directory), from which a new run
    starts."""

    resume_new_callbacks: bool = False
    """Resume a checkpoint that holds no state for some of this run's callbacks, such as a bf16
    run's checkpoint resumed with LoKA on: those callbacks keep the state they start with
    (LoKA: a fresh Probe and its preset's initial plans) and the rest is restored as usual.
    Off, such a checkpoint is refused, naming this option."""

    stop_after_step: int | None = None
    """Stop (as if killed) right after this step, after its checkpoint if one is due."""

    @property
    def sampled_compiled(self) -> bool:
        """Whether the requested modules run their compiled code (``compile_sampled`` resolved:
        ``null`` is on with ``compile_dense`` and without ``cuda_graphs_requested``)."""
        if self.compile_sampled is None:
            return self.compile_dense and not self.cuda_graphs_requested
        return self.compile_sampled

    def dense_lr_at(self, step: int) -> float:
        """The dense learning rate of `step` (0-based): linear warm-up, ``dense_lr``, then the decay.

        >>> TrainerConfig(dense_lr=0.01, dense_warmup_steps=4).dense_lr_at(1)
        0.005
        """
        warmup = self.dense_warmup_steps
        return self.dense_lr * (min(1.0, (step + 1) / warmup) if warmup else 1.0) * self.decay_at(step)

    def sparse_lr_at(self, step: int) -> float:
        """The embedding tables' learning rate of `step`: ``sparse_lr``, then the decay (no warm-up).

        >>> TrainerConfig(sparse_lr=0.04, lr_decay_start=10, lr_decay_steps=4, lr_decay_power=1).sparse_lr_at(12)
        0.02
        """
        return self.sparse_lr * self.decay_at(step)

    def decay_at(self, step: int) -> float:
        """The decay factor of `step`: 1 up to ``lr_decay_start``, then down to 0 over
        ``lr_decay_steps`` steps, then 0.

        >>> cfg = TrainerConfig(lr_decay_start=1, lr_decay_steps=2, lr_decay_power=1)
        >>> [cfg.decay_at(s) for s in range(5)]
        [1.0, 1.0, 0.5, 0.0, 0.0]
        """
        if not self.lr_decay_steps or step < self.lr_decay_start:
            return 1.0
        done = min(step - self.lr_decay_start, self.lr_decay_steps)
        return float((1.0 - done / self.lr_decay_steps) ** self.lr_decay_power)

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "log_every", "eval_batches", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be positive")
        non_negative = (
            "eval_every", "checkpoint_every", "prefetch", "dense_warmup_steps", "lr_decay_steps", "lr_decay_start",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be >= 0 (0 = off)")
        for name, allowed in (
            ("sharding", SHARDING_TYPES),
            ("sparse_optimizer", SPARSE_OPTIMIZERS),
            ("pipeline", PIPELINES),
            ("device", DEVICES),
            ("dense_dtype", DENSE_DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"trainer.{name}={getattr(self, name)!r}: choose one of {allowed}")
        if not isinstance(self.resume, str) or not self.resume.strip():
            raise ValueError(
                f"trainer.resume={self.resume!r}: choose one of {RESUME_MODES} or the path of a checkpoint"
            )
        if self.keep_runs < 0:
            raise ValueError(f"trainer.keep_runs={self.keep_runs} must be >= 0 (0 keeps every run)")
        if not isinstance(self.resume_new_callbacks, bool):
            raise ValueError(f"trainer.resume_new_callbacks must be a bool, got {self.resume_new_callbacks!r}")
        if not isinstance(self.compile_dense, bool):
            raise ValueError(f"trainer.compile_dense must be a bool, got {self.compile_dense!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"trainer.cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if self.compile_sampled is not None and not isinstance(self.compile_sampled, bool):
            raise ValueError(f"trainer.compile_sampled must be true, false or null (auto), got {self.compile_sampled!r}")
        if self.compile_sampled and not self.compile_dense:
            raise ValueError("trainer.compile_sampled=true runs the sampled steps' compiled code: "
                             "set trainer.compile_dense=true too, or compile_sampled=null (it then follows compile_dense)")
        if self.compile_sampled and self.cuda_graphs_requested:
            raise ValueError("trainer.compile_sampled=true and trainer.cuda_graphs_requested=true exclude each "
                             "other (the second replays the uncompiled forward): set one of them to false")
        if not isinstance(self.cuda_graphs_share_outputs, bool):
            raise ValueError(
                f"trainer.cuda_graphs_share_outputs must be a bool, got {self.cuda_graphs_share_outputs!r}"
            )
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ValueError(f"trainer.pin_memory must be true, false or null (auto), got {self.pin_memory!r}")
        if self.pin_memory and self.device == "cpu":
            raise ValueError(
                "trainer.pin_memory=true needs trainer.device=cuda (pinned memory serves copies to a "
                "GPU): set trainer.pin_memory=null or false"
            )
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(
                f"trainer.compile_backend must name a torch.compile backend (e.g. \"inductor\"), "
                f"got {self.compile_backend!r}"
            )
        if self.dense_lr <= 0 or self.sparse_lr <= 0:
            raise ValueError("trainer.dense_lr and trainer.sparse_lr must be positive")
        if not self.lr_decay_power > 0:
            raise ValueError(f"trainer.lr_decay_power={self.lr_decay_power} must be positive (MLPerf uses 2)")
        self._check_sparse2d()
        if not self.lr_decay_steps and (self.lr_decay_start or self.lr_decay_power != MLPERF_DECAY_POWER):
            raise ValueError(
                "trainer.lr_decay_start and trainer.lr_decay_power shape a decay that "
                "trainer.lr_decay_steps=0 turns off: set trainer.lr_decay_steps=N (steps to reach 0)"
            )

    def _check_sparse2d(self) -> None:
        """``sharding_group_size`` / ``sharding_sync_every``: what can be checked without the
        world size (`runtime.sparse2d.check_sparse2d` checks the rest when the run starts)."""
        group = self.sharding_group_size
        if self.sharding_sync_every < 1:
            raise ValueError(f"trainer.sharding_sync_every={self.sharding_sync_every} must be >= 1 (1: every step)")
        if group is None:
            if self.sharding_sync_every != 1:
                raise ValueError(
                    f"trainer.sharding_sync_every={self.sharding_sync_every} needs "
                    "trainer.sharding_group_size (2D sparse parallelism): set it, or drop sharding_sync_every"
                )
            return
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(
                f"trainer.sharding_group_size={group!r} must be an integer >= 1 that divides the world "
                "size, or null for plain DistributedModelParallel"
            )
        if self.device == "cpu":
            raise ValueError(
                "trainer.sharding_group_size (2D sparse parallelism) needs CUDA: TorchRec's DMPCollection "
                "runs only on CUDA with nccl. Run with trainer.device=cuda on GPUs, or set "
                "trainer.sharding_group_size=null to shard every table over all ranks"
            )
        if self.sharding == "data_parallel":
            raise ValueError(
                "trainer.sharding=data_parallel replicates every table on every rank already: "
                "trainer.sharding_group_size has nothing to shard; choose another trainer.sharding "
                "or set trainer.sharding_group_size=null"
            )
        every = self.sharding_sync_every
        if self.eval_every % every:
            raise ValueError(
                f"trainer.eval_every={self.eval_every} is not a multiple of trainer.sharding_sync_every="
                f"{every}: evaluations would run on replicas that have not synced. Set trainer.eval_every "
                f"to a multiple of it (e.g. {math.lcm(self.eval_every, every)}), or "
                "trainer.sharding_sync_every to a divisor of trainer.eval_every"
            )
        if self.checkpoint_every or self.checkpoint_at_end:
            raise ValueError(
                "trainer.sharding_group_size (2D sparse parallelism) writes no checkpoints (DCP on "
                "DMPCollection's replicated shards is not supported; it can resume from a checkpoint "
                "of a fully sharded run): set trainer.checkpoint_every=0 trainer.checkpoint_at_end=false, "
                "or trainer.sharding_group_size=null"
            )
