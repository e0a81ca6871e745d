"""``runtime.graphs.DenseGraphs``: which calls replay, which run eagerly, when it re-captures.

CUDA graphs themselves need a GPU (``tests/gpu/test_graphs_gpu.py`` checks replays against
eager numerics there). Here a stand-in capture function replays by running the module's
eager forward and counting, so the routing, the signatures and the fallbacks are checked on
the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from loka_train.kernels import LinearPlan
from loka_train.kernels.formats import Scaling
from loka_train.mods import Fp8Linear, mark_sampled
from loka_train.probe import Probe, ProbeConfig
from loka_train.runtime.config import TrainerConfig
from loka_train.runtime.eager import EagerSteps
from loka_train.runtime.graph_capture import flatten_output
from loka_train.runtime.graphs import DenseGraphs
from tests.cpu_graphs import CpuGraphs

FP8_PLAN = LinearPlan.fp8(backend="emulated")


def _state(params: tuple[nn.Parameter, ...], inputs: tuple[Tensor, ...]) -> tuple:
    """What a real capture bakes in and a replay cannot change."""
    return (
        torch.is_autocast_enabled("cpu"),
        tuple((id(p), p.requires_grad) for p in params),
        tuple((t.shape, t.dtype, t.requires_grad) for t in inputs),
    )


class FakeGraphed:
    """Replays by calling the eager forward (so gradients flow as they would), and checks that
    nothing a real capture bakes in (plans, autocast, parameters, input layout) changed since
    the capture: a router that replays a stale capture fails these tests."""

    def __init__(self, run: Any, inputs: tuple[Tensor, ...], params: tuple[nn.Parameter, ...], log: list,
                 module: nn.Module | None = None, *, shared_outputs: bool = False,
                 chained: tuple[bool, ...] = (), share: Any = None) -> None:
        self.run, self.log, self.params, self.module = run, log, params, module
        self.shared_buffers: tuple[Tensor, ...] = ()
        self.out_spec = flatten_output(run(params, *inputs))[1]
        self.released = False
        self.state = _state(self._params(), inputs)
        self.plans = self._plans()
        log.append(("capture", tuple(t.shape for t in inputs)))

    def _params(self) -> tuple[nn.Parameter, ...]:
        return tuple(self.module.parameters()) if self.module is not None else self.params

    def _plans(self) -> tuple:
        if self.module is None:
            return ()
        return tuple(m.plan for m in self.module.modules() if hasattr(m, "plan"))

    def forward(self, flat_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        assert not self.released
        assert _state(self._params(), flat_inputs) == self.state, "replayed a capture whose state changed"
        assert self._plans() == self.plans, "replayed a capture taken under another plan"
        self.log.append(("replay",))
        return flatten_output(self.run(self.params, *flat_inputs))[0]

    def release(self) -> None:
        self.released = True


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.site = Fp8Linear.from_linear(nn.Linear(8, 4))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor, *, extra: Tensor | None = None) -> Tensor:
        y = self.site(x) * self.scale
        return y if extra is None else y + extra


def _latest(graphs: DenseGraphs, index: int) -> Any:
    """The most recently replayed (or captured) capture of the `index`-th graphed module."""
    return list(graphs._entries[index].variants.values())[-1].graphed


def _graphs(module: nn.Module, log: list, **kwargs: Any) -> DenseGraphs:
    return DenseGraphs(
        {"tower": module},
        capture=lambda run, inputs, params, **kw: FakeGraphed(run, inputs, params, log, module, **kw),
        **kwargs,
    )


def test_warmup_then_capture_then_replays_with_the_eager_result() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=2)
    x = torch.randn(3, 8)
    expected = Tower.forward(tower, x)
    outs = [tower(x) for _ in range(5)]
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    stats = graphs.stats()
    assert stats["captures"] == 1 and stats["replays"] == 3
    assert stats["eager"] == {"warmup": 2}
    assert [e[0] for e in log] == ["capture", "replay", "replay", "replay"]
    outs[-1].sum().backward()
    assert tower.site.weight.grad is not None and tower.scale.grad is not None


def _observe_tower(tower: Tower) -> Probe:
    """A Probe that samples the tower's site on every other step (0, 2, ...)."""
    probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=None, interval=100, window=2, min_samples=1))
    tower.site.site_name = "tower.site"
    probe.register_site("tower.site", **tower.site.probe_spec())
    tower.site.attach_observer(probe)
    return probe


def test_eval_no_grad_and_sampled_steps_run_eagerly() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1)
    probe = _observe_tower(tower)
    x = torch.randn(3, 8)
    for step in range(6):
        probe.begin_step(step)
        graphs.eager.begin_step(mark_sampled([tower.site], step))
        tower(x).sum().backward()
    with torch.no_grad():
        tower(x)
    tower.eval()
    tower(x)
    eager = graphs.stats()["eager"]
    assert eager["requested"] == 3  # steps 0, 2, 4 sample
    assert eager == {"requested": 3, "warmup": 1, "no_grad": 1, "eval": 1}
    assert graphs.stats()["replays"] == 2
    assert probe.report()["sites"]["tower.site"]["num_observations"]["forward"] == 3


def test_with_compiled_requests_a_sampled_step_runs_the_compiled_forward_unreplayed() -> None:
    """``trainer.compile_sampled``: the steps that request the module run its compiled forward,
    not a replay and not its uncompiled forward; the site still reports (through its taps)."""
    tower, log = Tower(), []
    ran: list[str] = []

    def compile(fn: Any) -> Any:
        def compiled(*args: Any, **kwargs: Any) -> Any:
            ran.append("compiled")
            return fn(*args, **kwargs)

        return compiled

    eager = EagerSteps()
    eager.compiled_requests = True
    graphs = _graphs(tower, log, warmup_calls=1, compile=compile, eager=eager)
    probe = _observe_tower(tower)
    x = torch.randn(3, 8)
    for step in range(6):
        probe.begin_step(step)
        graphs.eager.begin_step(mark_sampled([tower.site], step))
        before = len(ran)
        tower(x).sum().backward()
        if step % 2 == 0:  # requested: the compiled forward ran for this call, unreplayed
            assert len(ran) > before, step
    stats = graphs.stats()
    assert stats["eager"]["requested"] == 3 and stats["replays"] == 2
    assert probe.report()["sites"]["tower.site"]["num_observations"]["forward"] == 3


def test_a_plan_change_or_a_new_shape_recaptures() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1, max_variants=1)
    x = torch.randn(3, 8)
    for _ in range(3):
        tower(x)
    assert graphs.num_captures == 1
    (first,) = [v.graphed for v in graphs._entries[0].variants.values()]
    tower.site.set_plan(FP8_PLAN)
    for _ in range(3):
        out = tower(x)
    assert graphs.num_captures == 2 and first is not None and first.released
    torch.testing.assert_close(out, Tower.forward(tower, x), rtol=0, atol=0)
    tower(torch.randn(5, 8))  # a new batch shape: warm-up again, then a capture
    tower(torch.randn(5, 8))
    assert graphs.num_captures == 3
    assert graphs.stats()["eager"] == {"warmup": 3}


def test_captures_of_earlier_signatures_are_kept_up_to_max_variants() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1, max_variants=2)
    x = torch.randn(3, 8)
    plans = [LinearPlan(), FP8_PLAN]
    for plan in plans * 3:  # alternating plans: each captured once, then replayed
        tower.site.set_plan(plan)
        tower(x)
        tower(x)
    assert graphs.num_captures == 2
    assert graphs.stats()["eager"] == {"warmup": 2} and graphs.stats()["replays"] == 10
    first, second = (v.graphed for v in graphs._entries[0].variants.values())
    tower.site.set_plan(LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="emulated"))
    tower(x)
    tower(x)  # a third signature: the least recently replayed capture (the high one) goes
    assert graphs.num_captures == 3 and first.released and not second.released
    with pytest.raises(ValueError, match="max_variants"):
        _graphs(Tower(), [], max_variants=0)


def test_keyword_inputs_are_passed_through() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1)
    x, extra = torch.randn(3, 8), torch.randn(3, 4)
    for _ in range(3):
        out = tower(x, extra=extra)
    torch.testing.assert_close(out, Tower.forward(tower, x, extra=extra), rtol=0, atol=0)
    assert graphs.stats()["replays"] == 2


def test_non_tensor_input_is_a_counted_logged_fallback(caplog: pytest.LogCaptureFixture) -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: Tensor, scale: float) -> Tensor:
            return self.lin(x) * scale

    odd, log = Odd(), []
    graphs = _graphs(odd, log, warmup_calls=1)
    with caplog.at_level(logging.WARNING, logger="loka_train.runtime.graphs"):
        for _ in range(3):
            odd(torch.randn(2, 2), 2.0)
    assert graphs.stats()["eager"] == {"unsupported_input": 3}
    assert len(graphs.fallbacks) == 1 and "non-tensor inputs (float)" in graphs.fallbacks[0]
    assert sum("non-tensor" in r.message for r in caplog.records) == 1
    assert log == []


def test_a_failed_capture_leaves_the_module_eager_and_is_reported() -> None:
    tower = Tower()

    def failing(run: Any, inputs: tuple[Tensor, ...], params: Any, **_: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DenseGraphs({"tower": tower}, warmup_calls=1, capture=failing)
    x = torch.randn(3, 8)
    outs = [tower(x) for _ in range(4)]
    torch.testing.assert_close(outs[-1], Tower.forward(tower, x), rtol=0, atol=0)
    stats = graphs.stats()
    assert stats["captures"] == 0 and stats["replays"] == 0
    assert stats["eager"] == {"warmup": 1, "capture_failed": 3}
    assert "not permitted" in stats["modules"]["tower"]["disabled"]
    assert len(graphs.fallbacks) == 1 and "runs eagerly" in graphs.fallbacks[0]


def test_remove_restores_the_module_forward() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1)
    x = torch.randn(3, 8)
    tower(x), tower(x)
    graphs.remove()
    assert "forward" not in vars(tower)
    before = len(log)
    tower(x)
    assert len(log) == before


def test_install_finds_the_dense_submodules_and_refuses_models_without_them() -> None:
    from loka_train.models import ModelConfig, build_model

    model = build_model(ModelConfig(kind="dlrm"), feature_names=["cat_0", "cat_1"],
                        num_embeddings_per_feature=[10, 10], num_dense=4, seed=0)
    graphs = DenseGraphs.install(model, capture=lambda *a, **kw: FakeGraphed(*a, [], **kw))
    assert set(graphs.stats()["modules"]) == {"model.dense_arch", "model.inter_arch", "model.over_arch"}
    graphs.remove()
    with pytest.raises(ValueError, match="no submodule named"):
        DenseGraphs.install(nn.Sequential(nn.Linear(2, 2)), capture=lambda *a, **kw: FakeGraphed(*a, [], **kw))


def test_cpu_without_a_capture_function_falls_back_to_eager_and_reports_it() -> None:
    """``trainer.cuda_graphs`` is refused on a CPU run by the Trainer (one check, against the
    resolved device); the graphs themselves, built on the CPU, fail each capture: a logged
    fallback, and the module runs eagerly."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only fallback")
    tower = Tower()
    graphs = DenseGraphs({"tower": tower}, warmup_calls=1)
    x = torch.randn(3, 8)
    torch.testing.assert_close([tower(x) for _ in range(3)][-1], Tower.forward(tower, x), rtol=0, atol=0)
    assert graphs.stats()["eager"] == {"warmup": 1, "capture_failed": 2}
    assert len(graphs.fallbacks) == 1 and "capture failed" in graphs.fallbacks[0]
    assert torch.is_autocast_cache_enabled()


def test_the_trainer_refuses_cuda_graphs_on_a_cpu_device() -> None:
    from loka_train.runtime.preflight import check_cuda_graphs

    with pytest.raises(ValueError, match="this run is on cpu: set trainer.cuda_graphs=false"):
        check_cuda_graphs(TrainerConfig(cuda_graphs=True, device="cpu"), torch.device("cpu"))
    check_cuda_graphs(TrainerConfig(cuda_graphs=True, device="auto"), torch.device("cuda", 0))
    check_cuda_graphs(TrainerConfig(cuda_graphs=False, device="cpu"), torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cuda_graphs": "yes"}, "must be a bool"),
        ({"cuda_graphs_share_outputs": "no"}, "trainer.cuda_graphs_share_outputs must be a bool"),
        ({"compile_sampled": "yes", "compile_dense": True}, r"trainer.compile_sampled must be true, false or null \(auto\)"),
        ({"compile_sampled": True}, "set trainer.compile_dense=true too"),
        ({"compile_sampled": True, "compile_dense": True, "cuda_graphs_requested": True}, "exclude each other"),
    ],
)
def test_trainer_config_refuses_impossible_graph_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


def test_autocast_frozen_and_replaced_parameters_recapture() -> None:
    tower, log = Tower(), []
    graphs = _graphs(tower, log, warmup_calls=1)
    x = torch.randn(3, 8)

    def calls(n: int = 2) -> Tensor:
        for _ in range(n):
            out = tower(x)
        return out

    calls()
    assert graphs.num_captures == 1
    tower.scale.requires_grad_(False)  # a frozen parameter: no gradient target any more
    calls()
    assert graphs.num_captures == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls()
    assert graphs.num_captures == 3
    tower.scale = nn.Parameter(torch.full((4,), 2.0))  # a replaced parameter object
    graphs.invalidate()
    out = calls()
    assert graphs.num_captures == 4
    torch.testing.assert_close(out, Tower.forward(tower, x), rtol=0, atol=0)


def test_a_module_with_hooks_is_not_captured() -> None:
    tower, log = Tower(), []
    tower.site.register_forward_hook(lambda m, i, o: None)
    graphs = _graphs(tower, log, warmup_calls=1)
    for _ in range(3):
        tower(torch.randn(3, 8))
    assert graphs.num_captures == 0 and log == []
    assert "module hooks (on site)" in graphs.fallbacks[0]


def test_remove_restores_an_instance_forward_set_before_install() -> None:
    tower, log = Tower(), []
    own = tower.forward
    tower.forward = own  # type: ignore[method-assign]
    graphs = _graphs(tower, log, warmup_calls=1)
    assert tower.forward is not own
    graphs.remove()
    assert tower.forward is own


def test_replayed_gradients_accumulate_like_eager_ones() -> None:
    from loka_train.runtime.graph_capture import _Replay

    w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    graphs = CpuGraphs(w)
    xs = [torch.tensor([1.0, 1.0, 1.0], requires_grad=True), torch.tensor([2.0, 0.0, -1.0], requires_grad=True)]
    for x in xs:  # two micro-batches, .grad kept in between (gradient accumulation)
        (y,) = _Replay.apply(graphs, x, w)
        y.sum().backward()
    torch.testing.assert_close(w.grad, xs[0].detach() + xs[1].detach())
    torch.testing.assert_close(xs[1].grad, w.detach())
    w.grad.zero_()  # zero_grad(set_to_none=False): .grad must not be a static buffer
    (y,) = _Replay.apply(graphs, xs[0], w)
    y.sum().backward()
    torch.testing.assert_close(w.grad, xs[0].detach())


def test_shared_outputs_and_inner_input_gradients_are_the_static_buffers() -> None:
    from loka_train.runtime.graph_capture import _Replay

    w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    dy = torch.tensor([1.0, -2.0, 0.5])
    for shared in (False, True):
        graphs = CpuGraphs(w, shared_outputs=shared)
        leaf = torch.tensor([1.0, -1.0, 2.0], requires_grad=True)
        inner = leaf * 2  # an inner node: its gradient goes on to the leaf's
        seen: list[Tensor] = []
        inner.register_hook(seen.append)
        (y,) = _Replay.apply(graphs, inner, w)
        torch.testing.assert_close(y, inner.detach() * w.detach())
        # Shared: the output is the static buffer itself; fresh: a copy.
        assert (y.data_ptr() == graphs.static_outputs[0].data_ptr()) is shared
        (y * dy).sum().backward()
        # The inner input's gradient is the static buffer (no copy); the leaf's and the
        # parameter's are their own tensors.
        assert seen[0].data_ptr() == graphs.static_grads[0].data_ptr()
        torch.testing.assert_close(leaf.grad, 2 * w.detach() * dy)
        torch.testing.assert_close(w.grad, inner.detach() * dy)
        assert w.grad.data_ptr() != graphs.static_grads[1].data_ptr()
        w.grad = None
    # A leaf reached through a view: its .grad must be its own memory, or the next replay
    # would overwrite it, and accumulation would add into the static buffer.
    graphs = CpuGraphs(w)
    leaf = torch.zeros(3, requires_grad=True)
    for x in ([1.0, 1.0, 1.0], [2.0, 0.0, -1.0]):
        (y,) = _Replay.apply(graphs, (leaf + torch.tensor(x).requires_grad_(False)).view(3), w)
        y.sum().backward()
    assert leaf.grad is not None
    assert leaf.grad.untyped_storage().data_ptr() != graphs.static_grads[0].untyped_storage().data_ptr()
    torch.testing.assert_close(leaf.grad, 2 * w.detach())


def test_a_shared_output_changed_in_place_is_refused_in_the_backward() -> None:
    from loka_train.runtime.graph_capture import _Replay

    w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    (y,) = _Replay.apply(CpuGraphs(w, shared_outputs=True), torch.ones(3, requires_grad=True), w)
    z = y * 2  # reads y: fine
    y.relu_()  # changes the buffer that the module's backward reads
    with pytest.raises(RuntimeError, match="changed in place"):
        (z + y).sum().backward()


class SharingFake:
    """A capture whose replays write the eager result into one buffer per output and return
    those buffers themselves when shared, and that reads a chained input in place (as the CUDA
    graphs do); it logs what each capture was told."""

    def __init__(self, run: Any, inputs: tuple[Tensor, ...], params: tuple[nn.Parameter, ...], log: list,
                 name: str, *, shared_outputs: bool = False, chained: tuple[bool, ...] = (), share: Any = None) -> None:
        self.run, self.params, self.shared = run, params, shared_outputs
        outs, self.out_spec = flatten_output(run(params, *inputs))
        self.buffers = [o.detach().clone() for o in outs]
        self.shared_buffers = tuple(self.buffers) if shared_outputs else ()
        self.static_inputs = [t.detach() if c else t.detach().clone() for t, c in zip(inputs, chained, strict=True)]
        log.append((name, shared_outputs, chained))

    def forward(self, flat_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        for static, given in zip(self.static_inputs, flat_inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        with torch.no_grad():
            for buffer, out in zip(self.buffers, flatten_output(self.run(self.params, *self.static_inputs))[0]):
                buffer.copy_(out)
        # Like a replay's outputs: tensors that require grad (aliases of the buffers if shared).
        return [(b.detach() if self.shared else b.clone()).requires_grad_() for b in self.buffers]

    def release(self) -> None:
        self.buffers = []


def _producer_consumer(shared_outputs: Any = ("producer",)) -> tuple[DenseGraphs, Tower, nn.Sequential, list]:
    """A producer sharing its output and a consumer reading it, graphed with `SharingFake`."""
    producer, consumer = Tower(), nn.Sequential(nn.Linear(4, 2))
    log: list = []
    consumer_params = set(consumer.parameters())
    graphs = DenseGraphs(
        {"producer": producer, "consumer": consumer}, warmup_calls=1, shared_outputs=shared_outputs,
        capture=lambda run, inputs, params, **kw: SharingFake(
            run, inputs, params, log, "consumer" if params[0] in consumer_params else "producer", **kw
        ),
    )
    return graphs, producer, consumer, log


def test_a_module_fed_by_a_shared_output_reads_it_in_place_and_follows_its_producer() -> None:
    graphs, producer, consumer, log = _producer_consumer()
    x = torch.randn(3, 8)

    def step() -> Tensor:
        out = consumer(producer(x))
        with torch.no_grad():
            torch.testing.assert_close(out, consumer[0](Tower.forward(producer, x)), rtol=0, atol=0)
        return out

    for _ in range(3):
        step()
    # The producer shares its output buffer; the consumer's capture reads it in place.
    assert log == [("producer", True, (False,)), ("consumer", False, (True,))]
    buffer = _latest(graphs, 0).shared_buffers[0]
    # The consumer warmed up twice: on the producer's eager output, then on its buffer.
    assert graphs.stats()["replays"] == 3
    # Fed another tensor (its producer did not replay): another signature for the consumer
    # (a warm-up call), which does not write into the producer's buffer, which the producer's
    # backward graph may read.
    kept = buffer.clone()
    other = torch.randn(3, 4, requires_grad=True)
    torch.testing.assert_close(consumer(other), consumer[0](other), rtol=0, atol=0)
    torch.testing.assert_close(buffer, kept, rtol=0, atol=0)
    assert graphs.stats()["eager"] == {"warmup": 3}
    # The producer's plan changes: one warm-up call (its eager output is the consumer's
    # unshared signature again: captured, copying its input), then the producer's new capture
    # shares a new buffer and the consumer captures again, chained to it. Both producer
    # captures and all three consumer captures are kept.
    producer.site.set_plan(FP8_PLAN)
    step()
    assert graphs.stats()["eager"] == {"warmup": 4}
    step()  # the producer captures; the consumer warms up on its new buffer
    step()
    assert graphs.stats()["eager"] == {"warmup": 5}
    assert log[2:] == [("consumer", False, (False,)), ("producer", True, (False,)), ("consumer", False, (True,))]
    assert _latest(graphs, 1).static_inputs[0].data_ptr() == _latest(graphs, 0).shared_buffers[0].data_ptr()
    # Back to the first plan: both modules replay their first captures, chained as before.
    producer.site.set_plan(LinearPlan())
    step()
    assert len(log) == 5 and graphs.stats()["eager"] == {"warmup": 5}
    assert _latest(graphs, 0).shared_buffers[0].data_ptr() == buffer.data_ptr()


def test_a_module_captured_before_its_producer_chains_once_it_is_fed_the_shared_buffer() -> None:
    _, producer, consumer, log = _producer_consumer(shared_outputs=(name for name in ["producer"]))  # any iterable
    x = torch.randn(3, 8)
    consumer(torch.randn(3, 4, requires_grad=True))  # the consumer warms up first ...
    consumer(producer(x))  # ... and captures on the producer's eager output (a copy)
    for _ in range(2):
        out = consumer(producer(x))
    torch.testing.assert_close(out, consumer[0](Tower.forward(producer, x)), rtol=0, atol=0)
    # The producer's capture shares its buffer; the consumer captures again, chained to it.
    assert log == [("consumer", False, (False,)), ("producer", True, (False,)), ("consumer", False, (True,))]


def test_install_shares_the_outputs_of_the_inner_dense_parts_only() -> None:
    model = nn.Module()
    model.dense_arch, model.inter_arch, model.over_arch = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1)
    graphs = DenseGraphs.install(model, capture=lambda *a, **kw: FakeGraphed(*a, [], **kw))
    assert {e.name: e.shares_outputs for e in graphs._entries} == {
        "dense_arch": True, "inter_arch": True, "over_arch": False,
    }
    with pytest.raises(ValueError, match="not graphed"):
        DenseGraphs({"a": nn.Linear(2, 2)}, shared_outputs=["b"], capture=lambda *a, **kw: None)


def test_a_second_forward_before_the_backward_raises() -> None:
    from loka_train.runtime.graph_capture import _Replay

    w = nn.Parameter(torch.ones(3))
    graphs = CpuGraphs(w)
    (first,) = _Replay.apply(graphs, torch.ones(3, requires_grad=True), w)
    (second,) = _Replay.apply(graphs, torch.ones(3, requires_grad=True), w)
    second.sum().backward()
    with pytest.raises(RuntimeError, match="one forward, then its backward"):
        first.sum().backward()


def test_compiled_forward_runs_under_the_router_for_eager_calls_and_captures() -> None:
    """``trainer.compile_dense`` with ``cuda_graphs``: the router stays outside the compiled
    code; eager calls and the capture run the compiled forward, and its results match."""
    tower, log, compiled_calls = Tower(), [], []

    def compile_fn(fn: Any) -> Any:
        compiled = torch.compile(fn, backend="aot_eager")

        def counted(*args: Any, **kwargs: Any) -> Any:
            compiled_calls.append(True)
            return compiled(*args, **kwargs)

        return counted

    graphs = DenseGraphs(
        {"tower": tower},
        warmup_calls=1,
        capture=lambda run, inputs, params, **kw: FakeGraphed(run, inputs, params, log, tower, **kw),
        compile=compile_fn,
    )
    x = torch.randn(3, 8)
    expected = Tower.forward(tower, x)
    outs = [tower(x) for _ in range(3)]  # warm-up (eager), capture + replay, replay
    for out in outs:
        torch.testing.assert_close(out, expected)
    assert graphs.stats()["captures"] == 1 and graphs.stats()["eager"] == {"warmup": 1}
    # warm-up, the capture's sample run, and each of the two replays (the stand-in re-runs)
    assert len(compiled_calls) == 4
    assert graphs.names == ["tower"]
    outs[-1].sum().backward()
    grad = tower.site.weight.grad
    assert grad is not None and torch.count_nonzero(grad) > 0
    graphs.remove()
    tower(x)
    assert len(compiled_calls) == 4  # removed: the module's own forward again


def test_with_compile_a_sampled_step_runs_the_uncompiled_forward() -> None:
    """The Probe's steps run the module's own forward (observed, never compiled: its sampling
    check would break the compiled graph); the other calls run the compiled one."""
    tower, log, compiled_calls = Tower(), [], []

    def compile_fn(fn: Any) -> Any:
        return lambda *args, **kwargs: (compiled_calls.append(True), fn(*args, **kwargs))[1]

    graphs = DenseGraphs({"tower": tower}, warmup_calls=1, compile=compile_fn,
                         capture=lambda run, inputs, params, **kw: FakeGraphed(run, inputs, params, log, tower, **kw))
    probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=None, interval=100, window=2, min_samples=1))
    tower.site.site_name = "tower.site"
    probe.register_site("tower.site", **tower.site.probe_spec())
    tower.site.attach_observer(probe)
    x = torch.randn(3, 8)
    calls = []
    for step in range(4):  # probe, warm-up, probe, capture (+ its replay)
        probe.begin_step(step)
        graphs.eager.begin_step(mark_sampled([tower.site], step))
        tower(x).sum().backward()
        calls.append(len(compiled_calls))
    assert calls == [0, 1, 1, 3]
    assert graphs.stats()["eager"] == {"requested": 2, "warmup": 1}
    assert probe.report()["sites"]["tower.site"]["num_observations"]["forward"] == 2


def test_trainer_compiles_under_the_graphs_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """With both settings the Trainer hands ``torch.compile`` (with its inductor options) to
    the graphs instead of compiling the modules in place (a compiled ``__call__`` would trace
    into the router), and still raises dynamo's recompile limit for the sites."""
    from loka_train.runtime import trainer as trainer_mod
    from loka_train.runtime.graphs import DENSE_SUBMODULES, INNER_SUBMODULES

    seen: dict[str, Any] = {}
    compiled: list[dict[str, Any]] = []

    class Recorder:
        names = ["dense_arch"]

        @classmethod
        def install(cls, model: nn.Module, **kwargs: Any) -> Recorder:
            seen.update(kwargs)
            return cls()

    monkeypatch.setattr(trainer_mod, "DenseGraphs", Recorder)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    fake = type("T", (), {})()
    fake.cfg = TrainerConfig(compile_dense=True, cuda_graphs=True, device="cuda", compile_backend="inductor")
    fake.model = nn.Sequential(Tower(), Tower())  # two FP8-capable sites
    fake.graphs = None
    fake.compiled_modules = []
    fake.eager = EagerSteps()
    fake._install_graphs = lambda **kwargs: trainer_mod.Trainer._install_graphs(fake, **kwargs)
    with torch._dynamo.config.patch(recompile_limit=1):
        trainer_mod.Trainer._compile_dense(fake)
        assert torch._dynamo.config.recompile_limit == 4 * 2
    assert isinstance(fake.graphs, Recorder) and fake.compiled_modules == ["dense_arch"]
    assert seen["names"] == DENSE_SUBMODULES and seen["inner"] == INNER_SUBMODULES and seen["eager"] is fake.eager
    assert seen["compile"](lambda x: x + 1)(torch.ones(1)).item() == 2.0
    # Static shapes: a symbolic batch dim broke dynamo's DDP optimizer on an H100.
    assert compiled == [{"backend": "inductor", "dynamic": False, "options": {"emulate_precision_casts": True}}]


@pytest.mark.parametrize("share", [True, False])
def test_trainer_graphs_share_outputs_unless_configured_off(share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainer.cuda_graphs_share_outputs=false`` graphs every dense module with copied outputs."""
    from loka_train.runtime import trainer as trainer_mod
    from loka_train.runtime.graphs import DENSE_SUBMODULES, INNER_SUBMODULES

    seen: dict[str, Any] = {}

    class Recorder:
        @classmethod
        def install(cls, model: nn.Module, **kwargs: Any) -> str:
            seen.update(kwargs, model=model)
            return "graphs"

    monkeypatch.setattr(trainer_mod, "DenseGraphs", Recorder)
    fake = type("T", (), {})()
    fake.cfg = TrainerConfig(cuda_graphs=True, device="cuda", cuda_graphs_share_outputs=share)
    fake.model, fake.eager = nn.Linear(2, 2), EagerSteps()
    assert trainer_mod.Trainer._install_graphs(fake) == "graphs"
    assert seen == {"names": DENSE_SUBMODULES, "inner": INNER_SUBMODULES if share else (), "model": fake.model,
                    "eager": fake.eager}


def test_trainer_compiles_modules_with_sites_behind_the_eager_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_dense`` without graphs: a module holding FP8 sites (keyed modules) gets
    ``eager_or_compiled`` (its instance forward), one without keeps the in-place
    ``nn.Module.compile``."""
    from loka_train.runtime import trainer as trainer_mod

    compiled: list[Any] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    model = nn.Module()
    model.dense_arch = Tower()
    model.over_arch = nn.Linear(4, 1)
    in_place: list[str] = []
    monkeypatch.setattr(nn.Linear, "compile", lambda self, **kwargs: in_place.append("over_arch"), raising=False)
    fake = type("T", (), {})()
    fake.cfg = TrainerConfig(compile_dense=True, device="cpu", compile_backend="eager")
    fake.model, fake.graphs, fake.compiled_modules, fake.eager = model, None, [], EagerSteps()
    trainer_mod.Trainer._compile_dense(fake)
    assert fake.eager.compiled_requests  # trainer.compile_sampled follows compile_dense by default
    assert fake.compiled_modules == ["dense_arch", "over_arch"] and in_place == ["over_arch"]
    assert "forward" in vars(model.dense_arch) and len(compiled) == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.dense_arch(x), Tower.forward(model.dense_arch, x))


@pytest.mark.parametrize(("kwargs", "compiled"), [
    ({"compile_sampled": True}, True),
    ({"compile_sampled": False}, False),
    ({}, True),  # null: on with compile_dense
    ({"cuda_graphs_requested": True}, False),  # null: off where the requested modules are replayed
])
def test_trainer_compile_sampled_reaches_the_eager_router(kwargs: dict, compiled: bool) -> None:
    from loka_train.runtime import trainer as trainer_mod

    fake = type("T", (), {})()
    fake.cfg = TrainerConfig(compile_dense=True, device="cpu", compile_backend="eager", **kwargs)
    assert fake.cfg.sampled_compiled is compiled
    model = nn.Module()
    model.dense_arch = Tower()
    fake.model, fake.graphs, fake.compiled_modules, fake.eager = model, None, [], EagerSteps()
    trainer_mod.Trainer._compile_dense(fake)
    assert fake.eager.compiled_requests is compiled


def test_compile_sampled_default_is_off_without_compile_dense() -> None:
    assert TrainerConfig(device="cpu").sampled_compiled is False
    assert TrainerConfig(device="cpu", compile_dense=True).sampled_compiled is True


def test_captures_run_with_sampling_off_so_compiled_captures_have_no_graph_break() -> None:
    """A sampled site reports to its Probe through the taps (``mods.probe_tap``), opaque ops in
    one graph; the graphs capture only on steps that do not request the module eagerly, on
    which no site inside it samples, so the compiled code they record holds no tap."""
    tower = Tower()
    probe = Probe(ProbeConfig(every_k_steps=1, sites_per_step=None, interval=100, window=2, min_samples=1))
    tower.site.site_name = "tower.site"
    probe.register_site("tower.site", **tower.site.probe_spec())
    tower.site.attach_observer(probe)
    probe.begin_step(0)
    assert mark_sampled([tower.site], 0) == [tower.site]
    x = torch.randn(3, 8)
    observed = torch._dynamo.explain(Tower.forward)(tower, x)
    probe.config.every_k_steps = 1000  # step 1 samples nothing
    probe.begin_step(1)
    assert mark_sampled([tower.site], 1) == []
    plain = torch._dynamo.explain(Tower.forward)(tower, x)
    assert observed.graph_break_count == plain.graph_break_count == 0, (observed, plain)
    assert observed.graph_count == plain.graph_count == 1
    assert "probe_tap" in str(observed.graphs[0].graph) and "probe_tap" not in str(plain.graphs[0].graph)

    # The router's warm-up call, its captures (and the stand-in's replays, which re-run them)
    # run with the site's sampling off: none of them is on a sampled step.
    seen: list[bool] = []
    site_forward = tower.site.forward
    tower.site.forward = lambda t: (seen.append(tower.site.sampling), site_forward(t))[1]  # type: ignore[method-assign]
    graphs = _graphs(tower, [], warmup_calls=1)  # steps 1-3 do not sample: warm-up, capture, replay
    for step in (1, 2, 3):
        probe.begin_step(step)
        graphs.eager.begin_step(mark_sampled([tower.site], step))
        tower(x)
    assert seen == [False, False, False, False]


def test_code_compiled_for_an_unsampled_step_is_not_reused_on_a_sampled_step() -> None:
    """dynamo guards on the site's sampling flag: code traced with sampling off recompiles, and
    observes, on a step where the Probe samples the site."""
    tower = Tower()
    probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=None, interval=100, window=2, min_samples=1))
    tower.site.site_name = "tower.site"
    probe.register_site("tower.site", **tower.site.probe_spec())
    tower.site.attach_observer(probe)
    forward = torch.compile(tower.forward, backend="eager")
    x = torch.randn(3, 8)

    def observations() -> int:
        return probe.report()["sites"]["tower.site"]["num_observations"]["forward"]

    probe.begin_step(1)
    assert mark_sampled([tower.site], 1) == []
    forward(x)
    assert observations() == 0
    probe.begin_step(2)
    assert mark_sampled([tower.site], 2) == [tower.site]
    forward(x)
    assert observations() == 1


class Stack(nn.Module):
    """Sites called in a loop over layers, as DCN's cross layers and ``nn.Sequential`` do."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Fp8Linear.from_linear(nn.Linear(8, 8)) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _observed_stack(every_k_steps: int) -> tuple[Stack, Probe]:
    stack = Stack()
    probe = Probe(ProbeConfig(every_k_steps=every_k_steps, sites_per_step=None, interval=100, window=2,
                              min_samples=1))
    for i, layer in enumerate(stack.layers):
        layer.site_name = f"stack.{i}"
        probe.register_site(layer.site_name, **layer.probe_spec())
        layer.attach_observer(probe)
    return stack, probe


def _linears(graphs: list[torch.fx.GraphModule]) -> list[int]:
    return [sum("linear" in str(n.target) for n in gm.graph.nodes if n.op == "call_function") for gm in graphs]


def test_an_observing_site_in_a_layer_loop_no_longer_leaves_the_module_uncompiled() -> None:
    """A sampled site's report inside the loop was a graph break, which made dynamo skip the
    whole forward: the layers ran eagerly, unfused (DCN on an H100 ran 23 ms per step instead of
    14). Its reports are now opaque ops (``mods.probe_tap``): compiled as is, the sampled
    forward is one graph with every layer. ``eager_or_compiled`` compiles it for the unsampled
    steps and runs the Probe's own steps uncompiled, observed; with ``compiled_requests``
    (``trainer.compile_sampled``) those run compiled too, observed."""
    from loka_train.runtime.compile import eager_or_compiled

    x = torch.randn(4, 8)
    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    stack, probe = _observed_stack(every_k_steps=1)  # step 0 samples every layer
    probe.begin_step(0)
    mark_sampled(stack.layers, 0)
    torch.compile(stack.forward, backend=backend)(x).sum().backward()
    assert _linears(seen) == [3]  # as is: one graph holds the layers and their taps
    assert str(seen[0].graph).count("probe_tap") == 3
    observations = probe.report()["sites"]["stack.0"]["num_observations"]
    assert observations["forward"] == 1 and observations["grad_weight"] == 1

    torch._dynamo.reset()
    seen.clear()
    stack, probe = _observed_stack(every_k_steps=2)  # step 0 samples, step 1 does not
    eager = EagerSteps()
    eager.watch(stack)
    forward = eager_or_compiled(stack, torch.compile(stack.forward, backend=backend), stack.forward, eager)

    def begin(step: int) -> None:
        probe.begin_step(step)
        eager.begin_step(mark_sampled(stack.layers, step))

    begin(1)
    expected = Stack.forward(stack, x)
    torch.testing.assert_close(forward(x), expected)
    assert _linears(seen) == [3]
    begin(0)
    forward(x).sum().backward()
    assert _linears(seen) == [3]  # the sampled step ran the uncompiled forward...
    observations = probe.report()["sites"]["stack.0"]["num_observations"]
    assert observations["forward"] == 1 and observations["grad_input"] == 1  # ... observed
    begin(1)
    forward(x)  # the next step samples nothing: the same compiled graph again
    assert len(seen) == 1
    eager.compiled_requests = True
    begin(2)  # samples: the compiled forward with the taps, a graph of its own, observed
    forward(x).sum().backward()
    assert _linears(seen) == [3, 3] and "probe_tap" in str(seen[1].graph)
    observations = probe.report()["sites"]["stack.0"]["num_observations"]
    assert observations["forward"] == 2 and observations["grad_input"] == 2


def test_the_run_summary_table_shows_compiled_modules_and_graph_counts() -> None:
    from loka_train.runtime.summary import format_summary

    summary = {
        "steps": 10, "world_size": 1, "global_batch": 8, "train/steps_per_s": 2.0, "train/loss": 0.5,
        "fallbacks": [], "compiled": ["model.dense_arch", "model.over_arch"],
        "cuda_graphs": {"captures": 2, "replays": 14, "requested_replays": 0, "eager": {"eval": 4, "warmup": 2},
                        "modules": {}},
    }
    table = format_summary(summary)
    assert "compiled" in table and "model.dense_arch, model.over_arch" in table
    assert "14 replays, 2 captures; eager calls: eval 4, warmup 2" in table
    summary["cuda_graphs"]["requested_replays"] = 3
    assert "14 replays (+3 of requested steps), 2 captures" in format_summary(summary)
    plain = {k: v for k, v in summary.items() if k != "cuda_graphs"} | {"compiled": []}
    assert "CUDA graphs" not in format_summary(plain) and "compiled" not in format_summary(plain)


def test_dynamo_frame_skips_names_a_frame_given_up_in_a_loop() -> None:
    """A graph break inside a loop makes dynamo run the whole frame eagerly for good; the
    trainer reports such frames as fallbacks from these readings."""
    from loka_train.runtime.compile import dynamo_frame_skips

    @torch.compiler.disable
    def host_check() -> bool:
        return False

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: Tensor) -> Tensor:
            for layer in self.layers:
                x = layer(x)
                if host_check():
                    x = x + 1
            return x

    before = dynamo_frame_skips()
    torch.compile(Loop().forward, backend="eager")(torch.randn(2, 4))
    after = dynamo_frame_skips()
    new = {frame for frame, times in after.items() if times > before.get(frame, 0)}
    (frame,) = new
    assert frame.startswith("forward (") and __file__ in frame, frame


def test_dynamo_frame_skips_counts_a_frame_past_the_recompile_limit() -> None:
    """Past dynamo's recompile limit a frame runs only the graphs it has, else eagerly (a plan
    change per call would get there): a fallback the trainer must list like a skipped frame."""
    from loka_train.runtime.compile import dynamo_frame_skips

    def double(x: Tensor) -> Tensor:
        return x * 2

    compiled = torch.compile(double, backend="eager", dynamic=False)
    before = dynamo_frame_skips()
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (2, 3, 4):  # a new static shape each call: a recompile each
            compiled(torch.ones(n))
    after = dynamo_frame_skips()
    new = {frame: times - before.get(frame, 0) for frame, times in after.items() if times > before.get(frame, 0)}
    assert new == {"a frame past dynamo's recompile_limit=1": 1}, new


def test_releasing_a_producer_capture_releases_the_captures_that_read_its_buffer() -> None:
    graphs, producer, consumer, log = _producer_consumer()
    x = torch.randn(3, 8)
    for _ in range(4):
        consumer(producer(x))
    prod, cons = graphs._entries
    chained = [k for k, v in cons.variants.items() if v.chain]
    assert len(chained) == 1 and len(prod.variants) == 1
    graphs._drop(prod)  # e.g. evicted, or dropped by invalidate()
    assert not prod.variants and all(not v.chain for v in cons.variants.values())
    assert chained[0] not in cons.variants
