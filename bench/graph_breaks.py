"""Where torch.compile breaks the graph of LoKA's compiled dense modules (CPU, a tiny DCN).

Run with dynamo's graph-break log on:

    TORCH_LOGS=graph_breaks .venv/bin/python -m bench.graph_breaks [--model dcn] [--plan high]

It trains a tiny model for 4 steps on one gloo process with ``trainer.compile_dense=true`` and
LoKA's sites converted (aggressive preset; Probe, Dispatch, guard and comm off, so the plan
stays the one given; the sites still hold their observer). A counting AOTAutograd backend
(eager kernels) records the compiled graphs. It prints, per compiled graph, how many of its
ops are linears and cross-layer combines. A graph break inside a loop over layers makes dynamo
skip that whole forward (the log says "frame skipped"), and those ops then appear in no graph:
``bench/results/e2e_rotated_batches_h100_2026-11-24b/NOTES.md`` ("Found: compiled FP8 sites in a
layer loop") has the H100 case.
With the FP8 Functions as opaque custom ops, and compiled code running only on steps the
Probe does not sample, the log shows no graph break and no skipped frame for any of the three models.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

BACKEND = "loka_graph_breaks_count"


def _train(rank: int, world_size: int, out: str, model: str, plan: str) -> list[dict[str, int]]:
    import torch
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.common import aot_autograd

    from loka_train.plugin.callback import LokaCallback
    from loka_train.runtime.trainer import Trainer
    from tests.dist._loka import preset
    from tests.dist._tiny import tiny_data, tiny_model, tiny_trainer

    graphs: list[dict[str, int]] = []

    def count(role: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            graphs.append({"role": role == "forward", "ops": len(targets),
                           "linear_or_mm": sum("mm" in t or "linear" in t for t in targets),
                           "combine": sum("addcmul" in t or "mul.Tensor" in t for t in targets)})
            return gm.forward

        return compiler

    if BACKEND not in list_backends(exclude_tags=()):
        register_backend(aot_autograd(fw_compiler=count("forward"), bw_compiler=count("backward")), name=BACKEND)
    loka = preset("aggressive", "loka.probe.enabled=false", "loka.dispatch.enabled=false",
                  "loka.guard.enabled=false", "loka.comm_enabled=false", f"loka.mods.initial_plan={plan}",
                  "loka.mods.backend=emulated")
    trainer = Trainer(model=tiny_model(model), data=tiny_data(),
                      trainer=tiny_trainer(Path(out), compile_dense=True, compile_backend=BACKEND,
                                           dense_dtype="bf16", steps=4),
                      callbacks=[LokaCallback(loka)])
    trainer.fit()
    return graphs


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.graph_breaks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dcn", choices=("dlrm", "dcn", "wukong"))
    p.add_argument("--plan", default="fp8_rowwise", choices=("high", "fp8_rowwise", "fp8_tensorwise"))
    args = p.parse_args()
    from tests.dist._multiprocess import run_multiprocess

    with tempfile.TemporaryDirectory() as out:
        graphs = run_multiprocess(_train, 1, out, args.model, args.plan)[0]
    print(f"{len(graphs)} compiled graphs ({args.model}, plan {args.plan}):")
    for i, g in enumerate(graphs):
        kind = "forward" if g["role"] else "backward"
        print(f"  {i:2d} {kind:8s} ops {g['ops']:3d}  linear/mm {g['linear_or_mm']:2d}  mul/addcmul {g['combine']:2d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
