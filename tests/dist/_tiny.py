"""A tiny job (4 tables, small MLPs) shared by the distributed trainer tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.runtime import Callback, TrainerConfig


def tiny_model(kind: str = "dlrm") -> ModelConfig:
    return ModelConfig(
        kind=kind,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
        wukong_num_layers=1,
        wukong_num_fm_out=4,
        wukong_fm_rank=4,
        wukong_num_lcb_out=4,
        wukong_mlp_hidden=16,
    )


def tiny_data() -> DataConfig:
    return DataConfig(num_sparse=4, num_embeddings=200, chunk_size=16, max_pooling=3)


def tiny_trainer(out_dir: Path, **overrides: Any) -> TrainerConfig:
    fields: dict[str, Any] = dict(
        steps=6,
        batch_size=32,
        device="cpu",
        log_every=1,
        eval_batches=2,
        out_dir=str(out_dir),
        tensorboard=False,
        progress_bar=False,
        checkpoint_at_end=False,
        resume="never",
    )
    fields.update(overrides)
    return TrainerConfig(**fields)


class LossRecorder(Callback):
    """Records every step's global loss (mean over ranks) and the final dense parameters."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        loss = torch.tensor([metrics["train/loss"]], dtype=torch.float64)
        dist.all_reduce(loss)
        self.losses.append(loss.item() / trainer.world_size)


def dense_params(trainer: Any) -> dict[str, torch.Tensor]:
    """Dense (replicated) parameters by name, without the DDP / DMP prefixes."""
    out = {}
    for name, value in trainer.model.state_dict().items():
        if "embedding_bags" in name or not isinstance(value, torch.Tensor):
            continue
        out[name.replace("_dmp_wrapped_module.", "").replace("module.", "")] = value.clone()
    return out
