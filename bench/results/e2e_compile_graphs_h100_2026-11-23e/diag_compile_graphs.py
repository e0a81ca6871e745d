"""Per-step training losses of a small Wukong on one GPU: eager / compiled, with and without
CUDA graphs, with and without LoKA safe (what diag_compile_graphs_losses.txt holds).
Run from the repo root:
    python bench/results/e2e_compile_graphs_h100_2026-11-23e/diag_compile_graphs.py
"""
import sys
import tempfile

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.plugin import LokaCallback
from loka_train.runtime import Callback, TrainerConfig
from loka_train.runtime.trainer import Trainer

sys.path.insert(0, ".")
from tests.dist._loka import preset

M = dict(kind="wukong", embedding_dim=64, dense_arch_layer_sizes=[256, 64],
         over_arch_layer_sizes=[512, 256, 1], wukong_num_layers=2, wukong_num_fm_out=8,
         wukong_fm_rank=8, wukong_num_lcb_out=8, wukong_mlp_hidden=512)
class Rec(Callback):
    def __init__(self): self.losses = []
    def on_step_end(self, trainer, step, metrics): self.losses.append(round(metrics["train/loss"], 5))
out = {}
for loka in (False, True):
    for graphs, comp in ((False, False), (False, True), (True, False), (True, True)):
        rec = Rec()
        cbs = [LokaCallback(preset("safe", "loka.probe.every_k_steps=4", "loka.probe.interval=8", "loka.probe.window=4"))] if loka else []
        t = Trainer(model=ModelConfig(**M), data=DataConfig(num_embeddings=10_000),
            trainer=TrainerConfig(steps=16, batch_size=1024, device="cuda", dense_dtype="bf16", sharding="table_wise",
                log_every=1, eval_batches=2, out_dir=tempfile.mkdtemp(), tensorboard=False, progress_bar=False,
                checkpoint_at_end=False, resume="never", dense_lr=0.005, dense_warmup_steps=5,
                cuda_graphs=graphs, compile_dense=comp), callbacks=[*cbs, rec])
        try:
            s = t.fit()
        finally:
            t.close()
        key = f"loka={loka} graphs={graphs} compile={comp}"
        out[key] = rec.losses
        print(key, rec.losses, s.get("cuda_graphs", {}).get("eager"), flush=True)
