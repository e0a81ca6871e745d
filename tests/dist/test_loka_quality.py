"""Model quality with LoKA on the synthetic dataset (CPU, emulated FP8).

`safe` must reach an eval NE at most 0.5% (relative) worse than the same run without LoKA
after the same steps, and no more than 3% better (a far better NE would mean a broken run).
A better NE is no quality loss, and how much better is machine-dependent: the CPU's fp32
kernels change the rounding of the whole run (safe was 0.45% better on the machine of
2026-11-23 and 0.71% better on that of 2026-11-24). On CPU the speed objective keeps every
small GEMM in high precision (the H100 cost model says FP8 would be slower), which would make
the comparison vacuous, so the safe run here uses the coverage objective: every GEMM the Probe
calls safe under the safe budgets runs in FP8. `aggressive` reports its NE delta (printed;
asserted only finite).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from loka_train.data import DataConfig
from loka_train.models import ModelConfig
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import num_fp8, preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_trainer

STEPS = 300
SAFE_NE_RTOL = 0.005


def _train(rank: int, world_size: int, out: str, loka_preset: str | None) -> None:
    callbacks = []
    if loka_preset is not None:
        overrides = ["loka.probe.interval=25", "loka.comm_enabled=false"]
        if loka_preset == "safe":
            overrides.append("loka.dispatch.objective=coverage")
        callbacks.append(LokaCallback(preset(loka_preset, *overrides)))
    trainer = Trainer(
        model=ModelConfig(kind="dlrm", dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[128, 64, 1]),
        data=DataConfig(num_embeddings=2000),
        trainer=tiny_trainer(Path(out), steps=STEPS, batch_size=256, log_every=25, eval_batches=16),
        callbacks=callbacks,
    )
    summary = trainer.fit()
    if loka_preset is not None:
        summary["plan"] = callbacks[0].dispatcher.export()
    torch.save(summary, Path(out) / "summary.pt")


def test_safe_matches_high_precision_and_aggressive_reports_delta(tmp_path: Path) -> None:
    results = {}
    for name in (None, "safe", "aggressive"):
        out = tmp_path / str(name)
        run_multiprocess(_train, world_size=1, args=(str(out), name), timeout=400)
        results[name] = torch.load(out / "summary.pt", weights_only=False)
    base = results[None]["eval/ne"]
    assert base < 0.95
    safe = results["safe"]
    assert num_fp8(safe["plan"]) > 0, "safe ran no GEMM in FP8: the comparison would be vacuous"
    rel = (safe["eval/ne"] - base) / base  # > 0: safe is worse
    assert -0.03 < rel < SAFE_NE_RTOL, f"safe NE {safe['eval/ne']:.5f} vs {base:.5f} ({rel:+.3%})"
    aggr = results["aggressive"]
    delta = (aggr["eval/ne"] - base) / base
    assert math.isfinite(delta), delta  # reported below
    print(json.dumps({
        "baseline_ne": base, "safe_ne": safe["eval/ne"], "safe_ne_delta_rel": rel,
        "safe_fp8_coverage": safe["loka/fp8_coverage"],
        "aggressive_ne": aggr["eval/ne"], "aggressive_fp8_coverage": aggr["loka/fp8_coverage"],
        "aggressive_ne_delta_rel": delta,
    }))
