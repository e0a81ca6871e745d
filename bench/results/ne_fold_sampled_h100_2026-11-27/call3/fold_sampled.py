"""Diagnostic: per-step losses of a small Wukong on the GPU, aggressive preset with fixed
tensor-wise FP8 plans, the Probe sampling every 3rd step: fold x compiled sampled steps."""
import json
import os
import sys
import time
from pathlib import Path

import torch

PLANS = json.loads(open(os.path.join(os.path.dirname(__file__), "plans.json")).read())
DEVICE = os.environ.get("DIAG_DEVICE", "cuda")


def run(fold: bool, compile_sampled: bool, graphs: bool, out: Path, every: int = 3, steps: int = 16, interval: int = 1000, batch: int = 2048):
    from loka_train.data import DataConfig
    from loka_train.models import ModelConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime import Callback, TrainerConfig
    from loka_train.runtime.trainer import Trainer
    from tests.dist._loka import preset
    from tests.gpu._graphs_runs import MODELS

    class Rec(Callback):
        def __init__(self): self.losses = []
        def on_step_end(self, trainer, step, metrics): self.losses.append(metrics["train/loss"])

    rec = Rec()
    plans = PLANS

    class SetPlans(Callback):
        def on_train_start(self, trainer):
            from loka_train.kernels.plan import GemmPlan, LinearPlan
            def gp(t):
                if t == "high":
                    return GemmPlan()
                prec, rest = t.split(":")
                fmts, rest = rest.split("/")
                scaling, backend = rest.split("@")
                fa, _, fb = fmts.partition("x")
                return GemmPlan(precision="fp8", fmt=fa, fmt_b=fb or None, scaling=scaling, backend=backend if DEVICE == "cuda" else "emulated")
            for n, site in cb.sites.items():
                if n in plans:
                    site.set_plan(LinearPlan(**{r: gp(v) for r, v in plans[n].items()}))
                    if site.static_slots is None and hasattr(site, "enable_static_scales"):
                        site.enable_static_scales(margin=2.0, spread=16.0, device=trainer.device)
            print("plans set", sorted(n for n in cb.sites if n in plans), flush=True)
    cb = LokaCallback(preset("aggressive", "loka.dispatch.enabled=false", "loka.guard.enabled=false",
                             "loka.mods.initial_plan=fp8_tensorwise", f"loka.mods.fold_relu={str(fold).lower()}",
                             f"loka.probe.every_k_steps={every}", "loka.probe.window=4", f"loka.probe.interval={interval}"))
    tr = Trainer(model=ModelConfig(**MODELS["wukong"]), data=DataConfig(num_embeddings=10_000),
                 trainer=TrainerConfig(steps=steps, batch_size=batch, device=DEVICE, dense_dtype="bf16",
                                       sharding="table_wise", log_every=1, eval_batches=2, out_dir=str(out),
                                       tensorboard=False, progress_bar=False, checkpoint_at_end=False,
                                       resume="never", dense_lr=0.005, dense_warmup_steps=2,
                                       cuda_graphs=graphs, compile_dense=True, compile_sampled=compile_sampled),
                 callbacks=[cb, SetPlans(), rec])
    try:
        summary = tr.fit()
    finally:
        tr.close()
    from loka_train.mods import sites
    folded = [n for n, s in sites(tr.model).items() if getattr(s, "input_relu", False)]
    amax = {}
    for n in cb.sites:
        for role in ("forward", "grad_input"):
            try:
                st = cb.probe.window_stats(n, role)
            except ValueError:
                continue
            v = st["amax_a"][st["valid"].bool()]
            amax[f"{n}/{role}"] = [float(x) for x in v.tolist()]
    scales = {n: s.static_slots[:, 0].tolist() for n, s in cb.sites.items() if s.static_slots is not None}
    return rec.losses, folded, summary.get("fallbacks"), amax, scales


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    for graphs in (True,):
        for fold in (True, False):
            for cs in (True, False):
                t = time.time()
                torch._dynamo.reset()
                losses, folded, fb, amax, scales = run(fold, cs, graphs, out / f"r_{graphs}_{fold}_{cs}", every=3, steps=24, interval=4, batch=int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
                key = f"graphs={graphs} fold={fold} compile_sampled={cs}"
                res[key] = {"losses": losses, "amax": amax, "scales": scales}
                print(key, f"{time.time()-t:.0f}s folded={folded} fallbacks={fb}", flush=True)
                print("   ", " ".join(f"{x:.6f}" for x in losses), flush=True)
                (out / "losses.json").write_text(json.dumps(res, indent=1))
