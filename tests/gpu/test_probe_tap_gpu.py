"""The Probe's taps under inductor on the GPU (``mods.probe_tap``): a sampled step of a loop of
FP8 sites compiles as one graph (``fullgraph=True``) under bf16 autocast, the Probe's window
takes the same samples as in an eager sampled step, and the taps change no gradient.

Runs on the GPU machine (skipped without CUDA): `pytest tests/gpu/test_probe_tap_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_train.kernels import LinearPlan, Scaling
from loka_train.kernels.capability import fp8_available
from loka_train.mods import Fp8Linear, mark_sampled
from loka_train.mods.site import Site
from loka_train.probe import Probe, ProbeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Cross(nn.Module):
    """DCN's loop over cross layers, then a fused LayerNorm -> Linear -> ReLU site."""

    def __init__(self, plan: LinearPlan) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Fp8Linear.from_linear(nn.Linear(256, 256), plan=plan) for _ in range(3))
        self.norm = nn.LayerNorm(256)
        self.top = Fp8Linear.from_linear(nn.Linear(256, 128), plan=plan)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return self.top.forward_layernorm(x, self.norm, activation="relu").float().square().mean()

    def sites(self) -> dict[str, Site]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Site)}


def _run(compiled: bool, sampling: bool) -> tuple[Probe, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = Cross(LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")).cuda()
    probe = Probe(ProbeConfig(every_k_steps=1 if sampling else 1000, sites_per_step=None, window=4,
                              interval=50, min_samples=1), device="cuda")
    for name, site in net.sites().items():
        site.site_name = name
        probe.register_site(name, **site.probe_spec())
        site.attach_observer(probe)
    torch._dynamo.reset()
    model = torch.compile(net, backend="inductor", fullgraph=True, dynamic=False) if compiled else net
    x = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for step in range(1, 3):
        probe.begin_step(step)
        mark_sampled(net.sites().values(), step)
        net.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
    probe.reduce()
    return probe, [p.grad.clone() for p in net.parameters() if p.grad is not None]


def test_a_compiled_sampled_step_is_one_graph_with_the_eager_samples_and_gradients() -> None:
    ok, why = fp8_available()
    if not ok:
        pytest.skip(why)
    eager, _ = _run(compiled=False, sampling=True)
    compiled, grads_sampled = _run(compiled=True, sampling=True)
    _, grads_plain = _run(compiled=True, sampling=False)
    assert compiled.state_dict()["num_obs"] == eager.state_dict()["num_obs"]
    for site in ("layers.0", "layers.2", "top"):
        for role in ("forward", "grad_input", "grad_weight"):
            got, want = compiled.window_stats(site, role), eager.window_stats(site, role)
            assert bool(want["valid"].any()), (site, role)
            # Inductor's code around the ops rounds apart from eager's: the samples' SQNR agrees
            # to a fraction of a dB.
            torch.testing.assert_close(got["sqnr_db"], want["sqnr_db"], rtol=0, atol=0.5)
    assert len(grads_sampled) == len(grads_plain)
    for g, p in zip(grads_sampled, grads_plain):
        torch.testing.assert_close(g, p, rtol=1e-3, atol=1e-5)  # the taps are copies of their inputs
