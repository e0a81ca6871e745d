"""CUDA-graphed dense steps (``trainer.cuda_graphs``) compute what the eager ones compute.

Runs on the GPU machine (skipped without CUDA): `pytest tests/gpu/test_graphs_gpu.py`.
Replays run the kernels that were captured, so a graphed tower's outputs and gradients are
bit-identical to the eager tower's, step after step (weights updated in place by the
optimizer in between), in high precision, in FP8 and across a plan change. Compiled
(``trainer.compile_dense`` too), the captures record inductor's kernels for a variant compiled
for the capture, which may round apart from the compiled eager calls: those tests compare
with tolerances.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from loka_train.kernels import LinearPlan, Scaling
from loka_train.kernels.capability import fp8_available
from loka_train.mods import Fp8Linear
from loka_train.runtime.graphs import DenseGraphs
from tests.gpu._graphs_runs import MODELS, train_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Tower(nn.Module):
    """LayerNorm -> FP8-capable Linear -> ReLU -> Linear, the shape of a dense tower."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.a = Fp8Linear.from_linear(nn.Linear(width, width))
        self.b = Fp8Linear.from_linear(nn.Linear(width, 64))

    def forward(self, x: Tensor, *, skip: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.relu(self.a(self.norm(x)))
        return self.b(h) + skip, h.detach().sum(-1)


def _fp8_plan() -> LinearPlan:
    ok, why = fp8_available()
    if not ok:
        pytest.skip(f"no FP8 here: {why}")
    return LinearPlan.fp8(backend="torch_scaled_mm", scaling=Scaling.TENSORWISE)


def _steps(tower: Tower, xs: list[Tensor], *, plan_at: int | None = None) -> list[tuple[Tensor, ...]]:
    opt = torch.optim.Adagrad(tower.parameters(), lr=0.01)
    seen = []
    for i, x in enumerate(xs):
        if plan_at is not None and i == plan_at:
            for site in (tower.a, tower.b):
                site.set_plan(_fp8_plan())
        skip = torch.ones(x.shape[0], 64, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, side = tower(x, skip=skip)
        y.float().square().mean().backward()
        seen.append((y.detach().clone(), side.clone(), skip.grad.clone(),
                     *(p.grad.clone() for p in tower.parameters())))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("plan_at", [None, 3], ids=["high", "fp8_from_step_3"])
def test_graphed_tower_is_bit_identical_to_eager(plan_at: int | None) -> None:
    torch.manual_seed(0)
    eager = Tower().cuda()
    graphed = copy.deepcopy(eager)
    graphs = DenseGraphs({"tower": graphed}, warmup_calls=1)
    gen = torch.Generator("cuda").manual_seed(1)
    xs = [torch.randn(512, 256, device="cuda", generator=gen) for _ in range(8)]
    want, got = _steps(eager, xs, plan_at=plan_at), _steps(graphed, xs, plan_at=plan_at)
    for step, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, g)):
            assert torch.equal(a, b), f"step {step}, tensor {i}"
    stats = graphs.stats()
    assert stats["captures"] == (1 if plan_at is None else 2)
    assert stats["replays"] == (7 if plan_at is None else 6)
    assert graphs.fallbacks == []


class Inter(nn.Module):
    """An interaction: the bottom MLP's output with an input from outside the dense part."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = Fp8Linear.from_linear(nn.Linear(width, width))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        return torch.relu(self.lin(dense * sparse))


class Chain(nn.Module):
    """The DLRM family's dense chain: bottom MLP (ending in a ReLU, whose backward reads its
    output) -> interaction -> flatten -> top MLP, each module fed the previous one's output."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(Fp8Linear.from_linear(nn.Linear(width, width)), nn.ReLU())
        self.inter_arch = Inter(width)
        self.over_arch = Fp8Linear.from_linear(nn.Linear(width, 1))

    def forward(self, x: Tensor, sparse: Tensor) -> Tensor:
        return self.over_arch(self.inter_arch(self.dense_arch(x), sparse).flatten(1))


def _chain_steps(model: Chain, table: nn.Parameter, xs: list[Tensor], plan_at: int | None) -> list[tuple[Tensor, ...]]:
    opt = torch.optim.Adagrad([*model.parameters(), table], lr=0.01)
    seen = []
    for i, x in enumerate(xs):
        if plan_at is not None and i == plan_at:
            model.dense_arch[0].set_plan(_fp8_plan())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x, table * 1.5)  # an inner input, like the embeddings' output
        y.float().square().mean().backward()
        seen.append((y.detach().clone(), table.grad.clone(), *(p.grad.clone() for p in model.parameters())))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("plan_at", [None, 3], ids=["high", "producer_fp8_from_step_3"])
def test_chained_graphs_sharing_outputs_are_bit_identical_to_eager(plan_at: int | None) -> None:
    """install() shares the bottom MLP's and the interaction's outputs: the next graph reads them
    in place, inner gradients are not copied; outputs and gradients stay bit-identical to eager,
    also when the producer is captured again (a plan change) and its consumers follow it."""
    torch.manual_seed(0)
    eager = Chain().cuda()
    graphed = copy.deepcopy(eager)
    graphs = DenseGraphs.install(graphed, warmup_calls=1)
    gen = torch.Generator("cuda").manual_seed(1)
    xs = [torch.randn(512, 256, device="cuda", generator=gen) for _ in range(8)]
    table = torch.randn(512, 256, device="cuda", generator=gen)
    want = _chain_steps(eager, nn.Parameter(table.clone()), xs, plan_at)
    got = _chain_steps(graphed, nn.Parameter(table.clone()), xs, plan_at)
    for step, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, g)):
            assert torch.equal(a, b), f"step {step}, tensor {i}"
    entries = {e.name: e for e in graphs._entries}
    latest = {n: list(entries[n].variants.values())[-1] for n in entries}
    assert [latest[n].chain != () for n in ("dense_arch", "inter_arch", "over_arch")] == [False, True, True]
    stats = graphs.stats()
    assert graphs.fallbacks == []
    if plan_at is None:
        # A consumer's signature includes the producer buffer it reads: it warms up on the
        # producer's eager output (step 0), then once more on its buffer. The top MLP is also
        # captured on the interaction's eager output (its second call with that signature).
        assert stats["captures"] == 4 and stats["replays"] == 19 and stats["eager"] == {"warmup": 5}, stats


def _inductor(fn):  # type: ignore[no-untyped-def]
    return torch.compile(fn, backend="inductor", options={"emulate_precision_casts": True})


def _counted_inductor(calls: list[int]):  # type: ignore[no-untyped-def]
    """`_inductor`, counting the calls of the compiled function."""
    def wrap(fn):  # type: ignore[no-untyped-def]
        compiled = _inductor(fn)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return compiled(*args, **kwargs)

        return counted

    return wrap


def test_compiled_graphed_tower_tracks_the_compiled_eager_tower() -> None:
    """compile_dense + cuda_graphs: the captures record inductor's kernels (outputs and
    gradients match the same compiled tower run eagerly, across a switch to FP8)."""
    torch.manual_seed(0)
    eager = Tower().cuda()
    graphed = copy.deepcopy(eager)
    eager.forward = _inductor(eager.forward)  # type: ignore[method-assign]
    calls: list[int] = []
    graphs = DenseGraphs({"tower": graphed}, warmup_calls=1, compile=_counted_inductor(calls))
    gen = torch.Generator("cuda").manual_seed(1)
    xs = [torch.randn(512, 256, device="cuda", generator=gen) for _ in range(8)]
    want, got = _steps(eager, xs, plan_at=3), _steps(graphed, xs, plan_at=3)
    for step, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, g)):
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3, msg=f"step {step}, tensor {i}")
    stats = graphs.stats()
    assert stats["captures"] == 2 and stats["replays"] == 6, stats
    assert graphs.fallbacks == []
    # Eager calls (2 warm-ups) and, per capture, its warm-up iterations and the capture itself
    # ran the compiled forward; replays run none.
    assert len(calls) == 2 + 2 * (graphs.capture_warmup_iters + 1), len(calls)


def test_a_module_that_syncs_with_the_host_stays_eager_with_a_fallback() -> None:
    class Syncs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: Tensor) -> Tensor:
            y = self.lin(x)
            return y * float(y.abs().max().item() > 0)  # a host sync: not capturable

    module = Syncs().cuda()
    graphs = DenseGraphs({"syncs": module}, warmup_calls=1)
    x = torch.randn(4, 16, device="cuda")
    for _ in range(3):
        out = module(x)
        out.sum().backward()
    torch.testing.assert_close(out, Syncs.forward(module, x), rtol=0, atol=0)
    stats = graphs.stats()
    assert stats["captures"] == 0 and stats["modules"]["syncs"]["disabled"]
    assert len(graphs.fallbacks) == 1
    # The device and its default generator are usable after the failed capture.
    assert torch.randn(4, device="cuda").isfinite().all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_trainer_with_graphs_trains_like_eager(kind: str, tmp_path: Path) -> None:
    def run(graphs: bool, loka: bool, compile_dense: bool = False) -> tuple[dict, list[float]]:
        return train_losses(kind, graphs, loka, compile_dense, tmp_path / f"g{graphs}_l{loka}_c{compile_dense}")

    # (LoKA, compiled). Graphed eager code replays the eager kernels: the losses track the eager
    # run's step by step. Compiled, the reference is the same compiled run without graphs:
    # inductor's kernels round differently from eager ones, and this short warm-up run
    # amplifies that (eager vs compiled losses 2.6% apart by step 6 on an H100); the graphed
    # capture compiles its own variant (parameters as plain leaves), so it may round apart
    # from the compiled eager run too (3.1% at one step of a 16-step H100 run), hence 5%.
    # bench/graph_drift.py measures that gap alone: 0.79-0.82% in three fresh H100 processes
    # (2026-11-25), against one failure of this test at 5.4% (step 23) whose cause is open
    # (bench/results/e2e_torchao_h100_2026-11-25e/NOTES.md). The messages are f-strings: pytest cuts long reprs, and
    # that failure lost its losses past step 4.
    for loka, compiled in ((False, False), (True, False), (True, True)):
        if compiled and kind != "wukong":
            continue
        (eager, eager_losses), (graphed, graphed_losses) = run(False, loka, compiled), run(True, loka, compiled)
        stats = graphed["cuda_graphs"]
        assert stats["replays"] > 0 and stats["captures"] >= 3, stats
        assert not any("cuda_graphs" in f for f in graphed["fallbacks"]), graphed["fallbacks"]
        # Equal up to rounding, step by step (a graphed step that computed something else would
        # drift from step 1 on).
        assert len(graphed_losses) == len(eager_losses) == 24
        rel = 5e-2 if compiled else 1e-2
        why = {k: (graphed.get(k), eager.get(k)) for k in ("plan_changes", "fallbacks", "compile_skipped_frames")}
        for step, (g, e) in enumerate(zip(graphed_losses, eager_losses)):
            assert g == pytest.approx(e, rel=rel), (
                f"loka={loka} compiled={compiled} step {step}: graphed {graphed_losses} eager {eager_losses} "
                f"(graphed, eager): {why}")
        # Compiled: the loss tolerance (2026-11-25, with the FP8 sites compiled whole instead of
        # the cross network's frame skipped: eval NE 0.976 against 1.009 after 24 steps).
        assert graphed["eval/ne"] == pytest.approx(eager["eval/ne"], rel=rel if compiled else 2e-2), (loka, compiled)
        if loka:  # the Probe's sampled steps run eagerly (trainer.cuda_graphs_requested=false)
            assert stats["eager"].get("requested", 0) > 0 and stats["requested_replays"] == 0, stats
        if compiled:
            assert sorted(graphed["compiled"]) == ["model.dense_arch", "model.inter_arch", "model.over_arch"], graphed


def test_dispatch_times_candidates_graphed_when_the_step_is_graphed() -> None:
    from loka_train.dispatch import DispatchConfig, Dispatcher

    plan = _fp8_plan().forward
    timed = {}
    for graphed in (False, True):
        d = Dispatcher(DispatchConfig(timing="measure", bench_iters=6), device="cuda",
                       out_dtype=torch.bfloat16, graphed=graphed)
        timed[graphed] = (d.timer.measure((4096, 1024, 1024), plan), d.timer.measure((4096, 1024, 1024), None))
        assert ("CUDA graph" in d.timing_source) == graphed
        assert not d.measure_failures
    for t in (*timed[False], *timed[True]):
        assert 0 < t < 1e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_sampled_steps_replayed_record_what_eager_sampled_steps_record(compiled: bool) -> None:
    """With a replayable request (the LoKA callback's), the Probe's sampled steps replay a
    capture of the uncompiled tower: each replay writes the same statistics into the window as
    an eager sampled step, at the replay's step, and the unsampled capture is kept."""
    from loka_train.mods import mark_sampled
    from loka_train.probe import Probe, ProbeConfig

    torch.manual_seed(0)
    base = Tower().cuda()
    xs = [torch.randn(512, 256, device="cuda") for _ in range(9)]

    def run(graphed: bool) -> tuple[Probe, DenseGraphs | None]:
        tower = copy.deepcopy(base)
        probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=None, interval=100, window=8,
                                  min_samples=1, max_rows=128), device="cuda")
        sites = [tower.a, tower.b]
        for name, site in zip(("a", "b"), sites):
            site.site_name = name
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)
        graphs = DenseGraphs({"tower": tower}, warmup_calls=1,
                             compile=torch.compile if compiled else None) if graphed else None
        for step, x in enumerate(xs):  # no optimizer: every step sees the same weights
            probe.begin_step(step)
            sampled = mark_sampled(sites, step)
            if graphs is not None:
                graphs.eager.begin_step(sampled, replayable=True)
            skip = torch.ones(x.shape[0], 64, device="cuda", requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, _ = tower(x, skip=skip)
            y.float().sum().backward()
        torch.cuda.synchronize()
        return probe, graphs

    eager, _ = run(False)
    replayed, graphs = run(True)
    assert graphs is not None
    stats = graphs.stats()
    # Sampled steps 0, 2, 4, 6, 8: captured at step 0, all five replay it.
    assert stats["requested_replays"] == 5 and stats["captures"] == 2, stats
    for site in ("a", "b"):
        for role in ("forward", "grad_input", "grad_weight"):
            assert replayed.report()["sites"][site]["num_observations"][role] == 5
    assert replayed._window.slot_steps == eager._window.slot_steps
    torch.testing.assert_close(replayed._window.local_sum, eager._window.local_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(replayed._window.local_max, eager._window.local_max, rtol=1e-5, atol=1e-6)


def test_alternating_plans_with_one_capture_kept_recapture_into_a_fresh_pool() -> None:
    """max_variants=1: every plan switch releases the module's only capture, so its pool is
    forgotten and the next capture takes a new one (a pool whose captures are all gone may not
    be captured into again); invalidate() does the same. Outputs stay bit-identical to eager."""
    torch.manual_seed(0)
    eager = Tower().cuda()
    graphed = copy.deepcopy(eager)
    graphs = DenseGraphs({"tower": graphed}, warmup_calls=1, max_variants=1)
    gen = torch.Generator("cuda").manual_seed(1)
    xs = [torch.randn(512, 256, device="cuda", generator=gen) for _ in range(12)]
    fp8, high = _fp8_plan(), LinearPlan()

    def steps(tower: Tower) -> list[Tensor]:
        out = []
        for i, x in enumerate(xs):
            for site in (tower.a, tower.b):
                site.set_plan(fp8 if (i // 3) % 2 else high)  # switch every 3 steps
            if tower is graphed and i == 9:
                graphs.invalidate()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, _ = tower(x, skip=torch.ones(x.shape[0], 64, device="cuda"))
            y.float().sum().backward()
            out.append(y.detach().clone())
        return out

    for step, (a, b) in enumerate(zip(steps(eager), steps(graphed))):
        assert torch.equal(a, b), f"step {step}"
    stats = graphs.stats()
    assert graphs.fallbacks == [] and stats["captures"] >= 4 and stats["replays"] >= 4, stats


def test_repeated_captures_keep_no_memory_allocated() -> None:
    """Captures of a module with cuBLAS GEMMs, dropped one after another, leave nothing
    allocated: they share one capture stream, so PyTorch keeps one cuBLAS workspace for them (a
    fresh stream per capture would keep one more at every capture)."""
    from loka_train.runtime.graph_capture import capture_cuda_graphs

    lin = nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    params = tuple(lin.parameters())

    def capture_and_drop() -> None:
        g = capture_cuda_graphs(lambda ps, inp: torch.nn.functional.linear(inp, *ps), (x,), params)
        g.release()

    torch.cuda.synchronize()
    # Workspaces earlier tests made: gone, so that a stream per capture would show here (PyTorch
    # hands out its 32 streams round-robin, and each would get a workspace again).
    torch._C._cuda_clearCublasWorkspaces()
    capture_and_drop()  # the first capture makes the shared stream's workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(8):
        capture_and_drop()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB still allocated after 8 captures"
