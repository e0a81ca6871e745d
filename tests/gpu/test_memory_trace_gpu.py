"""``bench.e2e --memory-trace`` on the real CUDA allocator: the step-end markers appear in the
recorded trace with the marker's frame innermost, so the steady-step peak is computed over the
right steps, and a block allocated in a step is owned there."""

from __future__ import annotations

import pytest
import torch

from bench.e2e import measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _allocate_in_step(mib: int) -> torch.Tensor:
    return torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")


def test_step_markers_split_the_recorded_trace_into_steps() -> None:
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    try:
        kept = []
        for mib in (64, 8, 32):  # steps 0, 1, 2: 64 MiB, 8 MiB, 32 MiB live at their peaks
            block = _allocate_in_step(mib)
            kept.append(block[:8].clone())  # a small result outlives the step (a sum would widen to int64)
            del block
            measure._memory_trace_step_marker()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    m = measure.memory_peak_owners(snapshot, device=torch.cuda.current_device(), baseline_bytes=baseline,
                                   steady_steps=[1, 2], steps_total=3)
    steady = m["steady"]
    assert steady is not None and steady["step"] == 2, steady
    # Step 2's 32 MiB block (step 0's 64 MiB is the run's peak, outside the steady steps).
    assert 32 / 1024 <= steady["peak_gb"] - baseline / 2**30 < 33 / 1024, steady
    assert any("_allocate_in_step" in o["owner"] or "test_memory_trace_gpu" in o["owner"] for o in steady["owners"])
    assert m["peak_gb"] - baseline / 2**30 >= 64 / 1024


def _leave_allocated() -> torch.Tensor:
    return torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")


def test_a_recording_begun_before_the_run_names_what_it_left_allocated() -> None:
    """As ``bench.e2e --memory-trace`` runs a LoKA variant: the recording starts before the
    decision run, so a block that run leaves allocated is listed by the stack that allocated
    it when the timed run's training starts, and what it allocated and freed is not in the
    timed run's peak."""
    measure.start_memory_trace()
    try:
        torch.cuda.synchronize()
        big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # the decision run's peak
        del big
        left = _leave_allocated()
        torch.cuda.synchronize()
        clock = measure.StepClock(warmup=0, timed=1, profile_steps=0, device=torch.device("cuda"),
                                  timing="events", memory_trace=True, memory_trace_running=True)

        class _Trainer:
            step = 0

        clock.on_train_start(_Trainer())
        step_block = _allocate_in_step(8)
        del step_block
        clock.sampled = [False]
        measure._memory_trace_step_marker()
        torch.cuda.synchronize()
        clock.close()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    owners = {o["owner"]: o for o in clock._memory_before}
    mine = [o for name, o in owners.items() if "_leave_allocated" in name]
    assert mine and mine[0]["gb"] >= 16 / 1024, clock._memory_before
    m = clock.memory_peak
    assert m is not None and m["start_marker"], m
    # The run's peak: its baseline (the leftover with it) and the step's 8 MiB, not the 256 MiB.
    assert m["peak_gb"] - m["baseline_gb"] < 9 / 1024, m
    del left
