"""profiled(): a real profiler range while a profiler records, a shared no-op otherwise."""

import torch

from loka_train.utils.profiling import profiled


def test_range_recorded_only_while_profiling() -> None:
    assert profiled("loka/a") is profiled("loka/b")  # the no-op context: nothing recorded
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiled("loka/test/range"):
            torch.ones(4).add_(1)
    assert "loka/test/range" in {e.name for e in prof.events()}
