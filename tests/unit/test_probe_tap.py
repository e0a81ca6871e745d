"""The Probe's taps (``mods.probe_tap``): a sampled site's reports inside compiled code.

A compiled sampled step must report to the observer exactly what an eager one reports (the same
operands, for every role of every kind of site), without a graph break (a break inside a loop
over layers makes dynamo give up the whole module), and the compiled code of unsampled steps
must hold no tap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from loka_train.kernels.plan import LinearPlan
from loka_train.mods import BmmSite, Fp8Linear, probe_tap
from loka_train.mods.site import Site
from loka_train.runtime.eager import EagerSteps

FP8 = LinearPlan.fp8(backend="emulated")


class Recorder:
    """An observer that keeps a copy of every report, by (site, role)."""

    def __init__(self) -> None:
        self.reports: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, name: str, role: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self.reports.setdefault((name, role), []).append((a.detach().clone(), b.detach().clone()))


class LayerLoop(nn.Module):
    """Every observed path of a site (fused LayerNorm-Linear with a ReLU, plain Linear with a
    folded input ReLU, bmm), in a Python loop over layers."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(layers))
        self.ins = nn.ModuleList(Fp8Linear.from_linear(nn.Linear(16, 32), plan=FP8) for _ in range(layers))
        self.outs = nn.ModuleList(Fp8Linear.from_linear(nn.Linear(32, 16)) for _ in range(layers))
        for out in self.outs:
            out.input_relu = True
        self.inter = BmmSite(plan=FP8)

    def forward(self, x_BMK: torch.Tensor) -> torch.Tensor:
        for norm, lin_in, lin_out in zip(self.norms, self.ins, self.outs):
            x_BMK = x_BMK + lin_out(lin_in.forward_layernorm(x_BMK, norm, activation="none"))
        return self.inter(x_BMK, x_BMK.transpose(1, 2))

    def sites(self) -> dict[str, Site]:
        return {name: m for name, m in self.named_modules() if isinstance(m, Site)}


def _net(recorder: Recorder | None, sampling: bool = True) -> LayerLoop:
    torch.manual_seed(0)
    net = LayerLoop()
    for name, site in net.sites().items():
        site.site_name = name
        if recorder is not None:
            site.attach_observer(recorder)  # type: ignore[arg-type]
            site.set_sampling(sampling)
    return net


def _recording_backend() -> tuple[Any, list[str]]:
    """A ``torch.compile`` backend that runs each graph as traced and keeps its code."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(str(gm.graph))
        return gm.forward

    return backend, graphs


def _step(net: nn.Module) -> None:
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    net(x).square().sum().backward()


def test_a_compiled_sampled_step_reports_what_an_eager_one_does_without_a_graph_break() -> None:
    eager = Recorder()
    _step(_net(eager))
    compiled = Recorder()
    net = _net(compiled)
    torch._dynamo.reset()
    _step(torch.compile(net, backend="aot_eager", fullgraph=True))  # a graph break raises
    sites = set(_net(None).sites())
    assert set(eager.reports) == {(s, r) for s in sites for r in ("forward", "grad_input", "grad_weight")}
    assert set(compiled.reports) == set(eager.reports)
    for key, want in eager.reports.items():
        got = compiled.reports[key]
        assert len(got) == len(want) == 1, key
        for g, w in zip(got[0], want[0]):
            assert g.shape == w.shape, key
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_the_compiled_taps_record_the_gemm_shapes_that_eager_calls_record() -> None:
    want = _net(Recorder())
    _step(want)
    got = _net(Recorder())
    torch._dynamo.reset()
    _step(torch.compile(got, backend="aot_eager", fullgraph=True))
    shapes = {name: site.gemm_shapes() for name, site in want.sites().items()}
    assert all(s["forward"][0] > 0 for s in shapes.values())
    assert {name: site.gemm_shapes() for name, site in got.sites().items()} == shapes


def test_only_the_sampled_steps_compiled_code_holds_the_taps() -> None:
    backend, graphs = _recording_backend()
    recorder = Recorder()
    net = _net(recorder, sampling=False)
    torch._dynamo.reset()
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    _step(compiled)
    assert graphs and not any("probe_tap" in g for g in graphs)
    assert recorder.reports == {}
    for site in net.sites().values():
        site.set_sampling(True)
    _step(compiled)
    assert len(graphs) == 2 and graphs[1].count("loka.probe_tap") == len(net.sites())
    assert len(recorder.reports) == 3 * len(net.sites())


def test_the_compiled_probe_window_matches_the_eager_one() -> None:
    """With the real Probe: the same statistics in its window, compiled (fullgraph) or eager."""
    from loka_train.mods import mark_sampled
    from loka_train.probe import Probe, ProbeConfig

    def run(compiled: bool) -> Probe:
        net = _net(None)
        probe = Probe(ProbeConfig(every_k_steps=1, sites_per_step=None, window=4, interval=50, min_samples=1))
        for name, site in net.sites().items():
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)
        torch._dynamo.reset()
        model = torch.compile(net, backend="aot_eager", fullgraph=True) if compiled else net
        for step in range(2):
            probe.begin_step(step)
            assert len(mark_sampled(net.sites().values(), step)) == len(net.sites())
            _step(model)
        probe.reduce()
        return probe

    eager, compiled = run(False), run(True)
    assert compiled.state_dict()["num_obs"] == eager.state_dict()["num_obs"]
    # The grad-weight takes over X's and dY's full reads in compiled code too (the saved X is
    # another tensor object on the forward's storage).
    n = len(_net(None).sites())
    assert eager._passes.reused == compiled._passes.reused == 2 * 2 * n, (eager._passes.reused, compiled._passes.reused)
    for site in _net(None).sites():
        for role in ("forward", "grad_input", "grad_weight"):
            got, want = compiled.window_stats(site, role), eager.window_stats(site, role)
            assert bool(want["valid"].any()), (site, role)
            torch.testing.assert_close(got["sqnr_db"], want["sqnr_db"], rtol=1e-4, atol=1e-3)


def test_a_tap_whose_site_is_gone_says_so() -> None:
    from loka_train.mods import probe_tap

    class Gone:
        site_name, observer = "x", Recorder()

        def _set_mkn(self, mkn: tuple[int, int, int]) -> None: ...

    tap_id = probe_tap.register(Gone())  # the only reference: collected at once
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.loka.probe_tap(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), None, tap_id, "linear",
                                 "none", [2, 2, 2])


@pytest.mark.parametrize("shape", [(0, 5, 6), (3, 0, 6)])
@pytest.mark.parametrize("compiled", [False, True])
def test_an_empty_batch_of_a_sampled_batched_site_reports_empty_operands(shape: tuple[int, ...], compiled: bool) -> None:
    recorder = Recorder()
    site = BmmSite()
    site.site_name = "inter"
    site.attach_observer(recorder)  # type: ignore[arg-type]
    site.set_sampling(True)
    a = torch.randn(*shape, requires_grad=True)
    torch._dynamo.reset()
    fn = torch.compile(site, backend="aot_eager", fullgraph=True) if compiled else site
    fn(a, a.transpose(1, 2).detach()).sum().backward()
    assert set(recorder.reports) == {("inter", r) for r in ("forward", "grad_input", "grad_weight")}
    (dy, _), = recorder.reports[("inter", "grad_input")]
    assert dy.numel() == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_site_reports_as_itself_when_compiled(how: str) -> None:
    import copy
    import io

    original = Fp8Linear.from_linear(nn.Linear(8, 4))
    original.site_name = "orig"
    original.attach_observer(Recorder())  # type: ignore[arg-type]
    original.set_sampling(True)
    if how == "deepcopy":
        clone = copy.deepcopy(original)
    else:
        buf = io.BytesIO()
        torch.save(original, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    clone.site_name = "copy"
    clone.observer = Recorder()
    assert clone._tap_id != original._tap_id
    torch._dynamo.reset()
    torch.compile(clone, backend="aot_eager", fullgraph=True)(torch.randn(3, 8)).sum().backward()
    assert original.observer.reports == {}  # type: ignore[union-attr]
    assert set(clone.observer.reports) == {("copy", r) for r in ("forward", "grad_input", "grad_weight")}


def test_rotating_sampled_sites_share_one_compiled_variant_and_sample_as_eager() -> None:
    """``probe.sites_per_step``: each sampled step samples other sites. Compiled code guards on
    whether its module is requested (the runtime tells), not on each site's flag: two variants
    (unsampled, sampled) however the sites rotate, and every site's window as in the eager run."""
    from loka_train.mods import mark_sampled
    from loka_train.probe import Probe, ProbeConfig

    def run(compiled: bool) -> tuple[Probe, int]:
        backend, graphs = _recording_backend()
        net = _net(None)
        probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=1, prime_all_sites=False, window=8,
                                  interval=100, min_samples=1))
        for name, site in net.sites().items():
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)
        eager = EagerSteps()  # what the runtime's loops do: tells each site whether its module is requested
        eager.watch(net)
        torch._dynamo.reset()
        model = torch.compile(net, backend=backend, fullgraph=True) if compiled else net
        sampled = []
        for step in range(2 * len(net.sites())):
            probe.begin_step(step)
            sites = mark_sampled(net.sites().values(), step)
            eager.begin_step(sites)
            sampled.append(tuple(s.site_name for s in sites))
            _step(model)
        assert all(len(s) == (1 if i % 2 == 0 else 0) for i, s in enumerate(sampled)), sampled
        assert len(set(sampled)) > 2  # the sites rotate
        return probe, len(graphs)

    eager, _ = run(False)
    compiled, graphs = run(True)
    assert graphs == 2, graphs
    assert compiled.state_dict()["num_obs"] == eager.state_dict()["num_obs"]


def test_in_a_requested_module_every_site_has_a_tap_and_only_the_sampled_ones_report() -> None:
    backend, graphs = _recording_backend()
    recorder = Recorder()
    net = _net(None)
    for name, site in net.sites().items():
        site.attach_observer(recorder)  # type: ignore[arg-type]
        site.set_sampling(name == "outs.1")
    eager = EagerSteps()
    eager.watch(net)
    eager.begin_step([net.outs[1]])
    assert all(site._module_requested for site in net.sites().values())
    torch._dynamo.reset()
    _step(torch.compile(net, backend=backend, fullgraph=True))
    assert graphs[0].count("loka.probe_tap") == len(net.sites())
    assert set(recorder.reports) == {("outs.1", r) for r in ("forward", "grad_input", "grad_weight")}


def test_a_module_that_is_not_requested_compiles_without_taps() -> None:
    """On a step that samples a site elsewhere, a watched module holding no sampled site is told
    so: its compiled code holds no tap (no variant, copy or capture for it)."""
    backend, graphs = _recording_backend()
    net, other = _net(Recorder(), sampling=False), nn.Linear(2, 2)
    eager = EagerSteps()
    eager.watch(net)
    eager.watch(other)
    eager.begin_step([other])  # another module is requested, not this one
    assert not any(site._module_requested for site in net.sites().values())
    torch._dynamo.reset()
    _step(torch.compile(net, backend=backend, fullgraph=True))
    assert graphs and not any("probe_tap" in g for g in graphs)


def test_eager_steps_tell_each_site_whether_its_module_is_requested_as_that_changes() -> None:
    first, second = _net(None), _net(None)
    eager = EagerSteps()
    eager.watch(first)
    eager.begin_step([first.outs[0]])
    assert all(site._module_requested is True for site in first.sites().values())
    eager.watch(second)  # watched later: told at the next step, though the request is the same
    eager.begin_step([first.outs[0]])
    assert all(site._module_requested is False for site in second.sites().values())
    eager.begin_step([])
    assert not any(site._module_requested for net in (first, second) for site in net.sites().values())


def test_inductor_compiled_taps_report_the_operands_of_a_transposed_input() -> None:
    """Under inductor (not only aot_eager), a tap on a transposed input (as Wukong's projections
    take) reports the GEMM's operands, ``dY`` for both gradient roles, and changes neither the
    output nor the gradients."""

    class Site:
        site_name, sampling = "proj", True

        def __init__(self) -> None:
            self.observer = Recorder()

        def _set_mkn(self, mkn: tuple[int, int, int]) -> None:
            self.mkn = mkn

    def fn(x: torch.Tensor, w: torch.Tensor, tap: int) -> torch.Tensor:
        a = torch.relu(x).transpose(0, 1)
        y = a @ w.t()
        return torch.ops.loka.probe_tap(y, a, w, None, tap, "linear", "none", [a.shape[0], a.shape[1], w.shape[0]])

    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    site = Site()
    tap = probe_tap.register(site)
    torch._dynamo.reset()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.compile(fn, backend="inductor", fullgraph=True)(xr, wr, tap)
    out.square().sum().backward()
    a = torch.relu(x).t()
    y = a @ w.t()
    dy = 2 * y
    torch.testing.assert_close(out.detach(), y)
    torch.testing.assert_close(xr.grad, (dy @ w).t() * (x > 0))
    torch.testing.assert_close(wr.grad, dy.t() @ a)
    assert site.mkn == (24, 16, 8)
    want = {"forward": (a, w), "grad_input": (dy, w), "grad_weight": (dy, a)}
    assert set(site.observer.reports) == {("proj", role) for role in want}
    for role, (wa, wb) in want.items():
        ((ga, gb),) = site.observer.reports[("proj", role)]
        torch.testing.assert_close(ga, wa, msg=lambda m, r=role: f"{r}: {m}")
        torch.testing.assert_close(gb, wb, msg=lambda m, r=role: f"{r}: {m}")
