"""2D sparse parallelism on CPU: the layout (held to the installed TorchRec's own
``DMPCollection`` group construction), when replicas sync, and the config's refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec.distributed import model_parallel as torchrec_model_parallel

from loka_train.models import build as models_build
from loka_train.runtime.config import TrainerConfig
from loka_train.runtime.sparse2d import Sparse2DLayout, check_sparse2d, sync_due
from tests.unit.test_config import _compose

NO_CHECKPOINTS = {"checkpoint_every": 0, "checkpoint_at_end": False, "resume": "never"}


def _torchrec_mesh(monkeypatch: pytest.MonkeyPatch, world_size: int, group_size: int) -> list[list[int]]:
    """The rank matrix DMPCollection builds its DeviceMesh from (rows: sharding groups,
    columns: replica groups), read from the installed TorchRec's own code."""
    seen: dict[str, Any] = {}

    class FakeMesh:
        def __init__(self, *, device_type: str, mesh: list[list[int]], mesh_dim_names: tuple[str, str]) -> None:
            assert mesh_dim_names == ("replicate", "shard")
            seen["mesh"] = mesh

        def get_group(self, mesh_dim: str) -> None:
            return None

        def __getitem__(self, key: str) -> str:
            return key

    monkeypatch.setattr(torchrec_model_parallel, "DeviceMesh", FakeMesh)

    class Stub:
        _device = torch.device("cuda")

    torchrec_model_parallel.DMPCollection._create_process_groups(
        Stub(), global_rank=0, world_size=world_size, local_size=group_size  # type: ignore[arg-type]
    )
    return seen["mesh"]


@pytest.mark.parametrize(("world_size", "group_size"), [(8, 4), (8, 2), (4, 1), (6, 3), (2, 1)])
def test_layout_is_dmpcollections(monkeypatch: pytest.MonkeyPatch, world_size: int, group_size: int) -> None:
    mesh = _torchrec_mesh(monkeypatch, world_size, group_size)
    layout = Sparse2DLayout(world_size=world_size, sharding_group_size=group_size)
    assert layout.sharding_groups() == [tuple(row) for row in mesh]
    assert layout.replica_groups() == [tuple(col) for col in zip(*mesh)]
    for rank in range(world_size):
        assert rank in layout.sharding_group(rank) and rank in layout.replica_group(rank)
        # DMPCollection._remap_sharding_plan moves a one-group plan's shard i to i * R + rank % R.
        r = layout.num_replicas
        assert layout.sharding_group(rank) == tuple(i * r + rank % r for i in range(group_size))


def test_layout_of_dmpcollections_docstring() -> None:
    layout = Sparse2DLayout(world_size=8, sharding_group_size=4)
    assert layout.sharding_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout.replica_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.replica_group(5) == (4, 5) and layout.sharding_group(5) == (1, 3, 5, 7)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        layout.replica_group(8)


def test_layout_refuses_a_group_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match=r"must divide the world size 4: choose one of \[1, 2, 4\]"):
        Sparse2DLayout(world_size=4, sharding_group_size=3)


def test_init_embedding_tables_copies_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place copies into the live parameter shards run under no_grad."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])]
    )
    grad_modes: list[bool] = []

    def full_table(seed: int, table: str, rows: int, dim: int) -> torch.Tensor:
        grad_modes.append(torch.is_grad_enabled())
        return torch.ones(rows, dim)

    monkeypatch.setattr(models_build, "full_table", full_table)
    assert models_build.init_embedding_tables(ebc, seed=0, tables={"t": (8, 4)}) == 1
    assert grad_modes == [False] and torch.is_grad_enabled()
    assert torch.equal(ebc.embedding_bags["t"].weight, torch.ones(8, 4))


def test_sync_due_every_n_steps_and_after_the_last() -> None:
    assert [s for s in range(5) if sync_due(s, every=1, last_step=4)] == [0, 1, 2, 3, 4]
    assert [s for s in range(8) if sync_due(s, every=3, last_step=7)] == [2, 5, 7]
    assert [s for s in range(6) if sync_due(s, every=3, last_step=5)] == [2, 5]


def test_config_takes_evaluations_after_syncs() -> None:
    """Evaluations on synced replicas: at the end only (eval_every=0) or every k-th sync."""
    for eval_every in (0, 8):
        TrainerConfig(sharding_group_size=1, device="cuda", sharding_sync_every=4, eval_every=eval_every,
                      **NO_CHECKPOINTS)


def test_config_defaults_leave_plain_dmp() -> None:
    cfg = TrainerConfig()
    assert cfg.sharding_group_size is None and cfg.sharding_sync_every == 1
    assert check_sparse2d(cfg, world_size=2, device=torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_group_size": 0, "device": "cuda"}, "must be an integer >= 1"),
        ({"sharding_group_size": 1, "device": "cpu"}, "needs CUDA.*trainer.sharding_group_size=null"),
        ({"sharding_group_size": 1, "device": "cuda", "sharding": "data_parallel"}, "data_parallel replicates"),
        ({"sharding_sync_every": 2}, "needs trainer.sharding_group_size"),
        ({"sharding_group_size": 1, "device": "cuda", "sharding_sync_every": 0}, "sharding_sync_every=0"),
        (
            {"sharding_group_size": 1, "device": "cuda", "sharding_sync_every": 4, "eval_every": 10},
            r"eval_every=10 is not a multiple of trainer.sharding_sync_every=4.*\(e.g. 20\)",
        ),
    ],
)
def test_config_refuses_with_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**{**NO_CHECKPOINTS, **kwargs})


@pytest.mark.parametrize("checkpointing", [{"checkpoint_every": 10}, {"checkpoint_at_end": True}])
def test_config_refuses_checkpoints(checkpointing: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="writes no checkpoints.*trainer.checkpoint_at_end=false"):
        TrainerConfig(sharding_group_size=1, device="cuda", **{**NO_CHECKPOINTS, **checkpointing})


@pytest.mark.parametrize("resume", ["auto", "must", "/runs/dmp/checkpoints/step_00000200"])
def test_config_takes_a_resume(resume: str) -> None:
    """A 2D run may start from a checkpoint (of a fully sharded run): it only writes none."""
    cfg = TrainerConfig(sharding_group_size=1, device="cuda", **{**NO_CHECKPOINTS, "resume": resume})
    assert cfg.resume == resume


def test_check_sparse2d_on_the_job() -> None:
    cfg = TrainerConfig(sharding_group_size=2, device="cuda", **NO_CHECKPOINTS)
    layout = check_sparse2d(cfg, world_size=4, device=torch.device("cuda", 0))
    assert layout == Sparse2DLayout(world_size=4, sharding_group_size=2)
    # device=auto resolved to CPU: the job's device is checked again.
    auto = TrainerConfig(sharding_group_size=1, device="auto", **NO_CHECKPOINTS)
    with pytest.raises(ValueError, match="needs CUDA, this run is on cpu"):
        check_sparse2d(auto, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="choose one of"):
        check_sparse2d(TrainerConfig(sharding_group_size=3, device="cuda", **NO_CHECKPOINTS),
                       world_size=4, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="is the whole world"):
        check_sparse2d(cfg, world_size=2, device=torch.device("cuda", 0))


def test_hydra_composes_the_new_keys() -> None:
    assert _compose("trainer=gpu").trainer.sharding_group_size is None
    job = _compose("trainer=gpu", "trainer.sharding_group_size=1", "trainer.sharding_sync_every=4",
                   "trainer.checkpoint_at_end=false", "trainer.resume=never")
    assert (job.trainer.sharding_group_size, job.trainer.sharding_sync_every) == (1, 4)
    with pytest.raises(ValueError, match="needs CUDA"):
        _compose("trainer.sharding_group_size=1", "trainer.checkpoint_at_end=false")


def test_comm_state_gives_a_shorter_sqnr_buffer_zero_rows_for_the_missing_channels() -> None:
    from loka_train.comm import CommChannel, CommConfig, CommState

    state = CommState(CommConfig(), backend="gloo")
    saved = state.state_dict()
    older = saved["sqnr_sums"][: len(CommChannel) - 1] + 1.0  # five channels, with measurements
    state.load_state_dict({**saved, "sqnr_sums": older})
    assert torch.equal(state.sqnr_sums[:-1], older) and not state.sqnr_sums[-1].any()


class _Tables(torch.nn.Module):
    """A model whose state_dict lists embedding weights as TorchRec's do, live or as copies (made
    at every listing, or once and kept), with an optimizer state."""

    def __init__(self, copies: str) -> None:
        super().__init__()
        self.copies = copies
        self.weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
        self.register_buffer("momentum", torch.linspace(0.1, 1.0, 3))
        self.kept = self.weight.detach().clone()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        w = self.weight.detach()
        w = {"none": w, "each_listing": w.clone(), "once": self.kept}[self.copies]
        return {"ebc.embedding_bags.t0.weight": w}


class _Optimizer:
    def __init__(self, state: torch.Tensor, copies: bool) -> None:
        self.state, self.copies = state, copies

    def state_dict(self) -> dict[str, Any]:
        return {"state": {0: {"momentum1": self.state.clone() if self.copies else self.state}}}


@pytest.mark.parametrize("copy_weights", ["none", "each_listing", "once"])
@pytest.mark.parametrize("copy_states", [False, True])
def test_shards_not_live_names_copies(copy_weights: str, copy_states: bool) -> None:
    from loka_train.runtime.sparse2d import shards_not_live

    model = _Tables(copy_weights)
    weights_before, state_before = model.weight.detach().clone(), model.momentum.clone()
    copies = shards_not_live(model, _Optimizer(model.momentum, copy_states))
    want = (["ebc.embedding_bags.t0.weight@0,0"] if copy_weights != "none" else [])
    want += ["optimizer state 0"] if copy_states else []
    assert copies == want
    # The state's probe is undone bit for bit.
    assert torch.equal(model.weight.detach(), weights_before) and torch.equal(model.momentum, state_before)


def test_require_live_shards_raises_naming_the_fix() -> None:
    from loka_train.runtime.sparse2d import require_live_shards

    live = _Tables("none")
    require_live_shards(live, _Optimizer(live.momentum, False), device=torch.device("cpu"))  # nothing raised
    copied = _Tables("once")
    with pytest.raises(RuntimeError, match="copies.*loka.comm.replica_sync=fp32"):
        require_live_shards(copied, _Optimizer(copied.momentum, False), device=torch.device("cpu"))
