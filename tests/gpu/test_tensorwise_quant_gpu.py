"""The tensor-wise Triton quantizer on the GPU: bit-identical to the reference quantizer at the
training shapes (many blocks), codes included for non-finite tensors, and inside a CUDA graph;
its two-layout pass writes the same payload and its exact transpose."""

import pytest
import torch

from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.triton_tensorwise import (
    tensorwise_quant,
    tensorwise_quant_both,
    tensorwise_quant_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("shape", [(8192, 4096), (32768, 27), (1000, 1000)])
def test_bit_identical_to_the_reference(fmt, shape):
    x = (7 * torch.randn(*shape, device="cuda")).to(torch.bfloat16)
    q, scale = tensorwise_quant(x, fmt=fmt)
    rq, rs = tensorwise_quant_reference(x, fmt=fmt)
    assert torch.equal(scale, rs)
    assert _same(q, rq)


def test_non_finite_codes_and_a_graph_replay():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    tensorwise_quant(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = tensorwise_quant(x)
    x.mul_(3.0)
    graph.replay()
    rq, rs = tensorwise_quant_reference(x)
    assert torch.equal(scale, rs) and _same(q, rq)
    x[17, 3] = float("nan")
    graph.replay()
    assert torch.isnan(scale) and torch.isnan(q.float()).all()


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("shape", [(8192, 4096), (4096, 2048), (1000, 27)])
def test_both_layouts_are_the_reference_payload_and_its_transpose(fmt, shape):
    x = (7 * torch.randn(*shape, device="cuda")).to(torch.bfloat16)
    q, scale, q_t = tensorwise_quant_both(x, fmt=fmt)
    rq, rs = tensorwise_quant_reference(x, fmt=fmt)
    assert torch.equal(scale, rs)
    assert _same(q, rq)
    assert q_t.is_contiguous() and _same(q_t, rq.t().contiguous())
