"""Host work deferred to CUDA graph replays (``utils.capture.after_replay``), the Probe's use
of it, and ``DenseGraphs`` replaying the sampled steps of a replayable callback.

A real capture needs a GPU (``tests/gpu/test_graphs_gpu.py``). Here ``HookFake`` stands in
for it with what matters to the host: at capture it runs the module (forward and backward)
once inside ``replay_hooks()``, keeping what the code deferred; a replay recomputes the outputs
with deferred work dropped (as kernels that ran without their host code) and then runs the kept
hooks, as ``graph_capture._Replay`` does after ``fwd.replay()`` / ``bwd.replay()``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from loka_train.mods import Fp8Linear, mark_sampled
from loka_train.probe import Probe, ProbeConfig
from loka_train.runtime.graph_capture import flatten_output
from loka_train.runtime.graphs import DenseGraphs
from loka_train.utils.capture import after_replay, deferring, replay_hooks


def test_after_replay_runs_now_outside_a_capture_and_is_collected_or_dropped_inside() -> None:
    calls: list[str] = []
    after_replay(lambda: calls.append("now"))
    assert calls == ["now"] and not deferring()
    with replay_hooks() as kept:
        assert deferring()
        after_replay(lambda: calls.append("kept"))
        with replay_hooks(keep=False):
            after_replay(lambda: calls.append("dropped"))
        # A backward runs on autograd's threads: the collector is the process's.
        worker = threading.Thread(target=after_replay, args=(lambda: calls.append("thread"),))
        worker.start()
        worker.join()
    assert calls == ["now"] and len(kept) == 2 and not deferring()
    for hook in kept:
        hook()
    assert calls == ["now", "kept", "thread"]


def _probe(**kwargs: Any) -> Probe:
    cfg = dict(every_k_steps=1, sites_per_step=None, interval=100, window=4, min_samples=1, max_rows=None)
    cfg.update(kwargs)
    probe = Probe(ProbeConfig(**cfg))
    probe.register_site("s", weight_shape=(4, 8))
    return probe


def test_a_deferred_probe_sample_lands_in_the_window_at_each_replay_with_its_step() -> None:
    x, w = torch.randn(16, 8), torch.randn(4, 8)
    direct, deferred = _probe(), _probe()
    direct.begin_step(3)
    direct.observe("s", "forward", x, w)
    deferred.begin_step(3)
    with replay_hooks() as hooks:
        deferred.observe("s", "forward", x, w)
    assert len(hooks) == 1
    assert deferred.report()["sites"]["s"]["num_observations"]["forward"] == 0
    for step in (3, 7):  # two replays
        deferred.begin_step(step)
        hooks[0]()
    assert deferred.report()["sites"]["s"]["num_observations"]["forward"] == 2
    assert deferred._window.slot_steps[0][0][:2] == [3, 7]
    torch.testing.assert_close(deferred._window.local_sum[0, 0, 0], direct._window.local_sum[0, 0, 0])
    torch.testing.assert_close(deferred._window.local_max[0, 0, 1], direct._window.local_max[0, 0, 0])
    with replay_hooks(keep=False) as dropped:  # a capture's warm-up run: not a step
        deferred.observe("s", "forward", x, w)
    assert dropped == [] and deferred.report()["sites"]["s"]["num_observations"]["forward"] == 2


class HookFake:
    """A capture that keeps the host work deferred inside it and runs it after each replay."""

    def __init__(self, run: Any, inputs: tuple[Tensor, ...], params: tuple[nn.Parameter, ...], log: list,
                 *, shared_outputs: bool = False, chained: tuple[bool, ...] = (), share: Any = None) -> None:
        self.run, self.params, self.log = run, params, log
        self.shared_buffers: tuple[Tensor, ...] = ()
        with replay_hooks() as self.hooks:
            outs, self.out_spec = flatten_output(run(params, *inputs))
            torch.autograd.grad([o.sum() for o in outs], [p for p in params], allow_unused=True)
        self.share = share
        log.append("capture")

    def forward(self, flat_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        with replay_hooks(keep=False):  # the kernels run; their host code does not
            outs = flatten_output(self.run(self.params, *flat_inputs))[0]
        for hook in self.hooks:  # the forward's and, in this stand-in, the backward's
            hook()
        self.log.append("replay")
        return outs

    def release(self) -> None:
        self.log.append("release")


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.site = Fp8Linear.from_linear(nn.Linear(8, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.site(x).relu()


def _train(tower: Tower, capture: Any, *, steps: int, replayable: bool) -> tuple[DenseGraphs, Probe]:
    """`steps` training steps of `tower` graphed with `capture`, its site sampled every 3rd step."""
    graphs = DenseGraphs({"tower": tower}, warmup_calls=1, capture=capture)
    probe = _probe(every_k_steps=3)
    tower.site.site_name = "s"
    tower.site.attach_observer(probe)
    x = torch.randn(16, 8)
    for step in range(steps):
        probe.begin_step(step)
        graphs.eager.begin_step(mark_sampled([tower.site], step), replayable=replayable)
        tower(x).sum().backward()
    return graphs, probe


@pytest.mark.parametrize("replayable", [True, False])
def test_sampled_steps_of_a_replayable_callback_replay_their_own_capture(replayable: bool) -> None:
    tower, log = Tower(), []
    shares: list = []

    def capture(run: Any, inputs: tuple[Tensor, ...], params: Any, **kw: Any) -> HookFake:
        shares.append(kw["share"])
        return HookFake(run, inputs, params, log, **kw)

    graphs, probe = _train(tower, capture, steps=10, replayable=replayable)  # sampled: 0, 3, 6, 9
    stats = graphs.stats()
    # Every sampled step lands in the window once, replayed or eager.
    assert probe.report()["sites"]["s"]["num_observations"]["forward"] == 4
    steps = [s for s in probe._window.slot_steps[0][0] if s >= 0]
    assert sorted(steps) == [0, 3, 6, 9][-len(steps):]
    if replayable:
        # Step 0 captures the sampled signature at once (no eager warm-up); steps 0, 3, 6, 9
        # replay it. The unsampled capture (step 2, after step 1's warm-up) is kept: nothing
        # is captured again on the steps between.
        assert stats["captures"] == 2 and stats["requested_replays"] == 4 and stats["replays"] == 5
        assert stats["eager"] == {"warmup": 1}
        assert "release" not in log and shares[0] is shares[1]
    else:
        assert stats["captures"] == 1 and stats["requested_replays"] == 0
        assert stats["eager"] == {"requested": 4, "warmup": 1}


def test_a_failed_capture_of_a_requested_step_leaves_the_other_captures() -> None:
    tower, log = Tower(), []

    def capture(run: Any, inputs: tuple[Tensor, ...], params: Any, **kw: Any) -> HookFake:
        if tower.site.sampling:
            raise RuntimeError("operation not permitted when stream is capturing")
        return HookFake(run, inputs, params, log, **kw)

    graphs, probe = _train(tower, capture, steps=7, replayable=True)  # sampled: 0, 3, 6
    stats = graphs.stats()
    # Step 0's capture fails: steps 0, 3, 6 run eagerly; the unsampled steps keep replaying.
    assert stats["eager"] == {"capture_failed": 1, "requested": 2, "warmup": 1}, stats
    assert stats["replays"] == 3 and not graphs._entries[0].disabled
    assert probe.report()["sites"]["s"]["num_observations"]["forward"] == 3
    assert any("requested steps run eagerly" in line for line in graphs.fallbacks)


def test_releasing_every_capture_forgets_the_pool() -> None:
    tower, log = Tower(), []
    graphs = DenseGraphs({"tower": tower}, warmup_calls=1,
                         capture=lambda run, inputs, params, **kw: HookFake(run, inputs, params, log, **kw))
    x = torch.randn(16, 8)
    for _ in range(2):
        tower(x)
    entry = graphs._entries[0]
    assert entry.variants
    entry.share._handle = "pool"  # as a CUDA capture would have made it
    graphs.invalidate()
    assert not entry.variants and entry.share._handle is None
