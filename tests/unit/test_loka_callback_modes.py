"""The LoKA callback on TorchRec's own DLRM in a plain loop (RunContext, one CPU process):
off does nothing at all, aggressive without DDP leaves the dense hook out as a counted
fallback, and the start-up log names the objective that runs and what it means on a CPU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from loka_train.data import DataConfig, make_dataset
from loka_train.mods import sites
from loka_train.plugin import LokaCallback, LokaConfig
from loka_train.runtime import RunContext
from loka_train.runtime.sparse2d import Sparse2DLayout

DATA = DataConfig(num_sparse=4, num_embeddings=100, chunk_size=16, max_pooling=3)
DENSE_PROBE = {"every_k_steps": 1, "sites_per_step": None, "interval": 4, "min_samples": 2}
"""Every site sampled every step, an interval every 4 steps: decisions within a few steps."""


def _dlrm() -> DLRMTrain:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"cat_{i}"])
        for i in range(DATA.num_sparse)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables),
            dense_in_features=DATA.num_dense,
            dense_arch_layer_sizes=[16, 8],
            over_arch_layer_sizes=[16, 1],
        )
    )


def _train(cb: LokaCallback, ctx: RunContext, steps: int) -> dict[str, Any]:
    """The five calls of a user's own loop around plain SGD steps; returns the summary."""
    data = make_dataset(DATA, split="train", rank=0, world_size=1, batch_size=32)
    cb.on_before_shard(ctx)
    cb.on_train_start(ctx)
    optimizer = torch.optim.SGD(ctx.model.parameters(), lr=0.05)
    for step, batch in enumerate(data.batches(0, steps)):
        cb.on_step_start(ctx, step)
        loss, _ = ctx.model(batch)
        loss.backward()
        cb.on_after_backward(ctx, step)
        optimizer.step()
        optimizer.zero_grad()
        cb.on_step_end(ctx, step, {})
    summary: dict[str, Any] = {}
    cb.on_train_end(ctx, summary)
    return summary


def _module_types(model: nn.Module) -> list[tuple[str, type, int]]:
    return [(name, type(m), id(m)) for name, m in model.named_modules()]


def _hooks(model: nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    count += sum(len(getattr(p, "_backward_hooks", None) or {}) for p in model.parameters())
    return count


def test_off_does_nothing_at_all(tmp_path: Path) -> None:
    model = _dlrm()
    before = _module_types(model)
    hooks = _hooks(model)
    # Everything else configured as aggressive: enabled=False alone turns it all off.
    cb = LokaCallback(LokaConfig.preset("aggressive", enabled=False, probe=DENSE_PROBE, report_every=2))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path)
    cb.on_before_shard(ctx)
    assert sites(ctx.model) == {}
    assert ctx.model is model and _module_types(model) == before
    assert ctx.qcomm_codecs_registry is None and ctx.data_parallel_wrapper is None
    summary = _train(cb, ctx, steps=6)
    assert summary == {}
    assert _module_types(model) == before and _hooks(model) == hooks
    assert cb.probe is None and cb.dispatcher is None and cb.comm_state is None
    assert cb.eager_modules(ctx, 5) == ()
    assert ctx.fallbacks == [] and ctx.progress_postfix == {}
    assert not (tmp_path / "loka").exists() and list(tmp_path.iterdir()) == []
    assert cb.state_dict() == {} and not cb.stateful
    cb.load_state_dict({"anything": 1})  # a checkpoint's state is ignored too
    with pytest.raises(RuntimeError, match="LoKA is off"):
        cb.report(ctx)


def test_on_converts_torchrecs_dlrm(tmp_path: Path) -> None:
    """The same model and loop with LoKA on: four sites (the bottom MLP's two Linears, the
    interaction, the top MLP's first Linear; its last stays high), a report. So the test above
    is not vacuous."""
    cb = LokaCallback(LokaConfig.preset("safe", probe=DENSE_PROBE))
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path)
    summary = _train(cb, ctx, steps=4)
    assert len(cb.sites) == 4
    assert "loka/fp8_coverage" in summary and (tmp_path / "loka" / "loka_report.json").exists()


def test_aggressive_without_ddp_leaves_the_dense_hook_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cb = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    # One of two processes (the loop runs no collective): on one, comm is not installed at all.
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path, world_size=2)
    with caplog.at_level(logging.INFO, logger="loka_train"):
        summary = _train(cb, ctx, steps=8)
    assert cb.compressors == [] and cb.comm_state is not None
    (fallback,) = [f for f in ctx.fallbacks if "dense-gradient hook left out" in f]
    assert "no DistributedDataParallel inside DLRMTrain" in fallback
    assert not any("replica_sync" in f for f in ctx.fallbacks)  # none requested: no fallback
    assert "wrap the model in DistributedModelParallel" in fallback
    assert any(r.levelno == logging.WARNING and r.getMessage() == fallback for r in caplog.records)
    assert fallback in cb.report(ctx)["fallbacks"]
    # The rest of LoKA runs: on a CPU the coverage objective takes FP8 where it is safe.
    assert summary["loka/fp8_coverage"] > 0


def test_one_process_installs_no_comm_and_carries_a_checkpoints_comm_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Aggressive turns comm on; alone there is nothing to send: no codecs, no dense-gradient
    hook, no fallback, one log line. A checkpoint's comm state (from a run on several
    processes) is saved again as it was, for the next run on several."""
    cb = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path / "alone")
    with caplog.at_level(logging.INFO, logger="loka_train"):
        _train(cb, ctx, steps=4)
    assert cb.comm_state is None and ctx.qcomm_codecs_registry is None and cb.compressors == []
    assert any("one process, nothing to communicate" in r.getMessage() for r in caplog.records)
    assert not any("dense-gradient hook" in f for f in ctx.fallbacks)
    state = cb.state_dict()
    assert state["comm"] is None and state["comm_policy"] is None

    several = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    several.on_before_shard(
        RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path / "two", world_size=2)
    )
    assert several.comm_state is not None
    saved = {"comm": several.comm_state.state_dict(), "comm_policy": several.comm_policy.state_dict()}
    resumed = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    ctx2 = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path / "resumed")
    resumed.on_before_shard(ctx2)
    resumed.load_state_dict({**state, **saved})
    resumed.on_train_start(ctx2)
    again = resumed.state_dict()
    assert again["comm"] is saved["comm"] and again["comm_policy"] is saved["comm_policy"]


@pytest.mark.parametrize(("group_size", "codecs"), [(1, False), (2, True)])
def test_sharding_groups_of_one_rank_get_no_all_to_all_codecs(
    group_size: int, codecs: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With trainer.sharding_group_size=1 the all-to-alls span one rank: no codecs (one log
    line), the comm state stays for the replica sync and the dense-gradient hook."""
    cb = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    layout = Sparse2DLayout(world_size=4, sharding_group_size=group_size)
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path, world_size=4, sparse2d=layout)
    with caplog.at_level(logging.INFO, logger="loka_train"):
        cb.on_before_shard(ctx)
    assert cb.comm_state is not None and cb.comm_policy is not None
    assert (ctx.qcomm_codecs_registry is not None) is codecs
    said = [r for r in caplog.records if "sharding_group_size=1" in r.getMessage()]
    assert len(said) == (0 if codecs else 1), said


@pytest.mark.parametrize("world_size", [1, 3])
def test_resuming_several_processes_state_drops_residuals_as_a_fallback_only_with_a_hook(
    world_size: int, tmp_path: Path
) -> None:
    """A 2-process checkpoint's dense-gradient residuals are dropped on another world size; a
    fallback only where a hook runs (several processes): one process has none to feed."""
    saved = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    _train(saved, RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path / "saved"), steps=4)
    states = [{**saved.state_dict(), "compressors": [{"residual": torch.zeros(3)}]} for _ in range(2)]
    resumed = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE))
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path / "resumed", world_size=world_size)
    resumed.on_before_shard(ctx)
    resumed.load_state_dict(resumed.merge_rank_states(states, rank=0, world_size=world_size))
    resumed.on_train_start(ctx)
    dropped = [f for f in ctx.fallbacks if "error-feedback residuals" in f]
    assert len(dropped) == (world_size > 1), ctx.fallbacks


@pytest.mark.parametrize(
    ("comm", "sparse2d", "says"),
    [
        ({"replica_sync": "fp8"}, False, "replica_sync=FP8 is ignored: trainer.sharding_group_size"),
        ({"adaptive_channels": ("replica_sync",)}, False, "replica_sync=FP32 (adaptive) is ignored"),
        ({"replica_sync": "fp8"}, True, "no replica_sync hook to replace (RunContext.replica_sync)"),
    ],
)
def test_a_replica_sync_request_without_replicas_is_a_fallback(
    comm: dict[str, Any], sparse2d: bool, says: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cb = LokaCallback(LokaConfig.preset("aggressive", probe=DENSE_PROBE, comm=comm))
    layout = Sparse2DLayout(world_size=2, sharding_group_size=1) if sparse2d else None
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path, world_size=2, sparse2d=layout)
    with caplog.at_level(logging.WARNING, logger="loka_train"):
        cb.on_before_shard(ctx)
        cb.on_train_start(ctx)
    (fallback,) = [f for f in ctx.fallbacks if "replica_sync" in f]
    assert says in fallback, fallback
    assert [r.getMessage() for r in caplog.records].count(fallback) == 1
    assert cb.replica_syncer is None and ctx.replica_sync is None


@pytest.mark.parametrize(
    ("preset", "says"),
    [
        ("aggressive", "dispatch objective coverage (CPU: FP8 is emulated; the coverage objective"),
        ("safe", "dispatch objective speed (CPU: FP8 is emulated; the speed objective weighs a GPU cost model"),
    ],
)
def test_the_start_up_log_names_the_objective_that_runs(
    preset: str, says: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cb = LokaCallback(LokaConfig.preset(preset))
    ctx = RunContext(model=_dlrm(), device=torch.device("cpu"), out_dir=tmp_path)
    cb.on_before_shard(ctx)
    with caplog.at_level(logging.INFO, logger="loka_train.plugin"):
        cb.on_train_start(ctx)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoKA on:")]
    assert says in line, line
