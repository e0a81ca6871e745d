# ruff: noqa  (a diagnostic kept as it ran; run from the repository root on the GPU machine)
"""Scratch: what inductor generates on the GPU for DCN's cross net backward (bf16 and LoKA's plan)."""
import os
import re
import sys
import time

import torch
from torch._inductor.utils import run_and_get_code
from torchrec.modules.crossnet import LowRankCrossNet

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.mods.interaction import CrossNet

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "dcn_code.txt"), "w")
def p(*a):
    print(*a); print(*a, file=out); out.flush()
B, N, R, L = 32768, 3456, 512, 3
def fp8(s, fmt=Fp8Format.E4M3, fb=Fp8Format.E4M3):
    return GemmPlan(precision=Precision.FP8, backend="torch_scaled_mm", scaling=s, fmt=fmt, fmt_b=fb)
planW = LinearPlan(forward=fp8(Scaling.ROWWISE), grad_input=GemmPlan(), grad_weight=GemmPlan())
planV = LinearPlan(forward=GemmPlan(), grad_input=fp8(Scaling.TENSORWISE, Fp8Format.E5M2), grad_weight=GemmPlan())
def build(kind):
    torch.manual_seed(0)
    base = LowRankCrossNet(in_features=N, num_layers=L, low_rank=R).cuda()
    if kind == "bf16":
        return base
    cn = CrossNet.from_crossnet(base, plan=planW).cuda()
    for i in range(L):
        cn.layer_sites(i).V.set_plan(planV)
    return cn
def run(kind, cfg):
    torch._dynamo.reset()
    m = build(kind)
    x = torch.randn(B, N, device="cuda", requires_grad=True)
    with torch._inductor.config.patch(force_disable_caches=True, **cfg):
        f = torch.compile(m, dynamic=False)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = f(x)
            y.float().sum().backward()
        _, codes = run_and_get_code(step)
        for _ in range(3): step()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): step()
        torch.cuda.synchronize(); ms = (time.perf_counter() - t) / 20 * 1e3
    bwd = codes[-1]
    p(f"==== {kind} {cfg}: fwd+bwd {ms:.2f} ms")
    for ln in bwd.splitlines():
        s = ln.strip()
        if (s.startswith("triton_") and ".run(" in s) or "fn_backward.default(" in s or "extern_kernels" in s:
            p("   ", s[:200])
    # reduction kernels' sizes
    for m_ in re.finditer(r"def (triton_(?:red|per)_\w+)\(.*?\n(.*?)def ", bwd, re.S):
        body = m_.group(2)
        xn = re.search(r"xnumel = (\d+)", body); rn = re.search(r"r0_numel = (\d+)|rnumel = (\d+)", body)
        p("    red", m_.group(1), "xnumel", xn and xn.group(1), "rnumel", rn and (rn.group(1) or rn.group(2)))
    return bwd
for kind in sys.argv[1].split(","):
    for cfg in ({}, {"split_reductions": False}):
        code = run(kind, cfg)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"bwd_{kind}_{len(cfg)}.py"), "w") as fh:
            fh.write(code)
