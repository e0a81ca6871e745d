"""GPU kernel time per step by the aten operator (and the annotations) that launched it.

Reads a gzipped Chrome trace written by ``python -m bench.e2e --trace DIR`` (torch.profiler with CUDA
activity) and attributes each kernel and memcpy to the CPU operators on the launching thread
at its launch (a runtime or driver API call: cuBLAS and Triton launch through the driver; a
graph's kernels correlate to their ``cudaGraphLaunch``): the outermost and innermost
``aten::`` operator, and the innermost three annotations (TorchRec's ``## forward ##``,
autograd's ``evaluate_function``, ``loka/...``). A kernel whose launch is not in the trace
shows as ``?`` with its name.

Usage:
    python -m bench.trace_ops bench/results/e2e_compile_graphs_h100_2026-11-23e/traces/wukong_b8192_bf16.json.gz --steps 5
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from typing import Any


def attribute(events: list[dict[str, Any]]) -> tuple[float, collections.Counter, collections.Counter]:
    """Total kernel microseconds, and microseconds by (outer aten op, inner aten op) and by
    annotation path."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X":
            ops[e["tid"]].append(e)
    starts = {}
    for tid, lst in ops.items():
        lst.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in lst]
    by_op: collections.Counter = collections.Counter()
    by_note: collections.Counter = collections.Counter()
    total = 0.0
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        total += k["dur"]
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            by_op[("?", k["name"][:60])] += k["dur"]
            by_note["?"] += k["dur"]
            continue
        lst = ops[launch["tid"]]
        ts = launch["ts"]
        # Enclosing operators: started before the launch and not yet ended.
        enclosing = [o for o in lst[: bisect.bisect_right(starts[launch["tid"]], ts)] if ts <= o["ts"] + o["dur"]]
        aten = [o["name"] for o in enclosing if o["name"].startswith("aten::")]
        notes = [o["name"] for o in enclosing if not o["name"].startswith("aten::")]
        by_op[(aten[0] if aten else "-", aten[-1] if aten else "-")] += k["dur"]
        by_note[" > ".join(n[:40] for n in notes[-3:])] += k["dur"]
    return total, by_op, by_note


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.trace_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="gzipped Chrome trace (python -m bench.e2e --trace)")
    p.add_argument("--steps", type=float, default=5, help="steps in the trace (e2e's --profile-steps)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    with gzip.open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    total, by_op, by_note = attribute(events)
    per_step = 1000.0 * args.steps
    print(f"kernel time {total / per_step:.2f} ms/step")
    print("ms/step  outer aten op -> inner aten op (or ?: kernel name)")
    for (outer, inner), us in by_op.most_common(args.top):
        print(f"{us / per_step:7.3f}  {outer:40s} {inner}")
    print("ms/step  innermost annotations")
    for note, us in by_note.most_common(args.top):
        print(f"{us / per_step:7.3f}  {note}")


if __name__ == "__main__":
    main()
