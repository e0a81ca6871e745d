"""The small trainer runs of the GPU graphs test, shared with ``bench/graph_drift.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

MODELS = {
    "dcn": dict(kind="dcn", embedding_dim=64, dense_arch_layer_sizes=[256, 64],
                over_arch_layer_sizes=[512, 256, 1], dcn_num_layers=2, dcn_low_rank_dim=64),
    "wukong": dict(kind="wukong", embedding_dim=64, dense_arch_layer_sizes=[256, 64],
                   over_arch_layer_sizes=[512, 256, 1], wukong_num_layers=2, wukong_num_fm_out=8,
                   wukong_fm_rank=8, wukong_num_lcb_out=8, wukong_mlp_hidden=512),
}


def train_losses(
    kind: str, graphs: bool, loka: bool, compiled: bool, out_dir: Path, *, share_outputs: bool = True
) -> tuple[dict, list[float]]:
    """One 24-step run of a small ``kind`` model on the GPU: the trainer's summary (with LoKA, its
    plan changes under ``"plan_changes"``, each a dict with its step) and the per-step train losses.
    ``bench/graph_drift.py`` repeats it to measure the run-to-run drift. Needs CUDA."""
    from loka_train.data import DataConfig
    from loka_train.models import ModelConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime import Callback, TrainerConfig
    from loka_train.runtime.trainer import Trainer
    from tests.dist._loka import preset

    class LossRecorder(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step_end(self, trainer, step, metrics):  # type: ignore[no-untyped-def]
            self.losses.append(metrics["train/loss"])

    recorder = LossRecorder()
    callbacks = [LokaCallback(preset("safe", "loka.probe.every_k_steps=4", "loka.probe.interval=8",
                                     "loka.probe.window=4"))] if loka else []
    trainer = Trainer(
        model=ModelConfig(**MODELS[kind]),
        data=DataConfig(num_embeddings=10_000),
        trainer=TrainerConfig(
            steps=24, batch_size=1024, device="cuda", dense_dtype="bf16", sharding="table_wise",
            log_every=1, eval_batches=2, out_dir=str(out_dir), tensorboard=False,
            progress_bar=False, checkpoint_at_end=False, resume="never", dense_lr=0.005,
            dense_warmup_steps=5, cuda_graphs=graphs, compile_dense=compiled,
            cuda_graphs_share_outputs=share_outputs,
        ),
        callbacks=[*callbacks, recorder],
    )
    try:
        summary = trainer.fit()
        if loka:
            summary["plan_changes"] = [dataclasses.asdict(c) for c in callbacks[0].dispatcher.history]
        return summary, recorder.losses
    finally:
        trainer.close()
