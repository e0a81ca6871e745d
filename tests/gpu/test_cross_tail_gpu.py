"""GPU tests of a DCN cross layer's tail in its ``W`` GEMM's epilogue (``kernels.triton_cross``,
``mods.dcn_tail_in_gemm``): the kernel's ``z`` against ``torch._scaled_mm``'s, its ``x_{l+1}``
the ``addcmul`` of its own ``z`` and its copy that value in bf16, bit for bit; a converted cross
net, compiled, with and without the tail on the same FP8 plans."""

import copy

import pytest
import torch

from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import Fp8Format, Scaling, quantize, sqnr_db
from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.triton_cross import cross_epilogue

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not fp8_available()[0], reason="needs an FP8 GPU"),
]


def test_the_epilogue_computes_the_sites_tail_of_its_own_z() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    m, r, n = 4096, 512, 3456
    u = quantize(torch.randn(m, r, device=dev, generator=g), Fp8Format.E4M3, Scaling.TENSORWISE)
    w = quantize(torch.randn(n, r, device=dev, generator=g) / r**0.5, Fp8Format.E4M3, Scaling.TENSORWISE)
    b = (torch.randn(n, device=dev, generator=g) / 10).to(torch.bfloat16)
    x0 = torch.randn(m, n, device=dev, generator=g)
    xl = torch.randn(m, n, device=dev, generator=g)
    z, out, cp = cross_epilogue(u.data, u.scale, w.data, w.scale, b, x0, xl)
    ref = torch._scaled_mm(u.data, w.data.t(), scale_a=u.scale.reshape(()).float(),
                           scale_b=w.scale.reshape(()).float(), bias=b, out_dtype=torch.bfloat16)
    assert sqnr_db(ref.float(), z.float()) > 45  # the accumulation order apart, then one bf16 rounding
    assert torch.equal(out, torch.addcmul(xl, x0, z.float()))
    assert torch.equal(cp, out.to(torch.bfloat16))


def test_a_compiled_cross_net_with_the_tail_matches_the_addcmul() -> None:
    from torchrec.modules.crossnet import LowRankCrossNet

    from loka_train.kernels.plan import GemmPlan, Precision
    from loka_train.mods.interaction import CrossNet

    torch.manual_seed(0)
    cn = LowRankCrossNet(in_features=3456, num_layers=3, low_rank=512).cuda()
    # W's forward in tensor-wise FP8, its backward high: the two nets then differ only by the
    # GEMMs' accumulation order (the Triton epilogue's against cuBLAS's) and the tail's rounding.
    plan = LinearPlan(forward=GemmPlan(precision=Precision.FP8, scaling=Scaling.TENSORWISE, backend="torch_scaled_mm"))
    out_w = torch.randn(8, 3456, device="cuda") / 60
    results = []
    for tail in (True, False):
        net = CrossNet.from_crossnet(copy.deepcopy(cn), tail_in_gemm=tail)
        for i in range(3):
            net.layer_sites(i).W.set_plan(plan)
        xi = torch.randn(2048, 3456, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        xi.requires_grad_()
        torch._dynamo.reset()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.compile(net, dynamic=False)(xi)
            logits = torch.nn.functional.linear(y, out_w)  # an over-arch reads y in bf16 either way
        logits.float().square().mean().backward()
        results.append([y.float().detach(), xi.grad, *(p.grad for p in net.parameters())])
        assert (y.dtype == torch.bfloat16) is tail  # with the tail the net returns the bf16 copy
    for a, b in zip(*results, strict=True):
        assert sqnr_db(b.float(), a.float()) > 35
