"""A converted DCN cross net (3 layers, 3456 wide, rank 512) at 2048 rows under bf16 autocast,
each W forward tensor-wise FP8 (its backward high): the output and every gradient with the tail
in the W GEMM's epilogue against the addcmul after it, eagerly and compiled, as SQNR (dB); exits
1 where the compiled pair is under 30 dB. Run from the repository root on a GPU:
``python diag_cross.py`` (calls 5 and 6 of this folder)."""
import copy

import torch
from torchrec.modules.crossnet import LowRankCrossNet

from loka_train.kernels.formats import Scaling, sqnr_db
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.mods.interaction import CrossNet

torch.manual_seed(0)
cn = LowRankCrossNet(in_features=3456, num_layers=3, low_rank=512).cuda()
plan = LinearPlan(forward=GemmPlan(precision=Precision.FP8, scaling=Scaling.TENSORWISE, backend="torch_scaled_mm"))
out_w = torch.randn(8, 3456, device="cuda") / 60
x = torch.randn(2048, 3456, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
def run(tail, comp, layers=3):
    net = CrossNet.from_crossnet(copy.deepcopy(cn), tail_in_gemm=tail)
    for i in range(3):
        net.layer_sites(i).W.set_plan(plan)
    xi = x.clone().requires_grad_()
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = (torch.compile(net, dynamic=False) if comp else net)(xi)
        logits = torch.nn.functional.linear(y, out_w)
    logits.float().square().mean().backward()
    return [y.float().detach(), xi.grad] + [p.grad for p in net.parameters()], [n for n,_ in net.named_parameters()]
res = {}
for tail in (True, False):
    for comp in (False, True):
        res[(tail, comp)], names = run(tail, comp)
def cmp(a, b, label):
    print(label, [f"{n}:{float(sqnr_db(y.float(), x.float())):.1f}" for n, x, y in zip(["y","x"]+names, res[a], res[b])])
cmp((True, False), (False, False), "eager fused vs unfused")
cmp((True, True), (False, True), "compiled fused vs unfused")
cmp((False, True), (False, False), "unfused compiled vs eager")
cmp((True, True), (True, False), "fused compiled vs eager")
bad = [n for n, a, b in zip(["y","x"]+names, res[(True, True)], res[(False, True)]) if float(sqnr_db(b.float(), a.float())) < 30]
print("BAD" if bad else "OK", bad)
raise SystemExit(1 if bad else 0)
