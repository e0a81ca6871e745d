"""Probe across 2 gloo ranks: the reduced window equals one process observing the rows of both
ranks concatenated, and every rank ends with the same verdicts even when the data differ.

Shape legend: M rows per rank, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loka_train.probe import Probe, ProbeConfig
from tests.dist._multiprocess import run_multiprocess

M, K, N = 16, 64, 32
STEPS = 8
CFG = dict(
    every_k_steps=1,
    sites_per_step=None,
    interval=4,
    window=4,
    min_samples=4,
    formats=("e4m3", "e5m2"),
    block_size=32,
)
# Scalings whose groups never span rows, so pooling ranks is exact (see probe/window.py "Exactness").
EXACT_SCALINGS = ("rowwise", "block")
COMPARED = (
    "valid", "step", "sqnr_db", "saturation_a", "saturation_b", "underflow_a", "underflow_b",
    "amax_a", "amax_b", "outlier_ratio_a", "outlier_ratio_b", "row_spread_a", "row_spread_b",
)


def _weight_NK() -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(5)) / 8


def _rank_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x_MK = torch.randn(M, K, generator=gen) * (1.0 + rank)  # ranks differ in scale
    if rank == 1:
        x_MK[:, 7] *= 50.0
    dy_MN = torch.randn(M, N, generator=gen)
    return x_MK, dy_MN


def _observe_steps(probe: Probe, data_at) -> None:
    w_NK = _weight_NK()
    for step in range(STEPS):
        probe.begin_step(step)
        x_MK, dy_MN = data_at(step)
        probe.observe("site", "forward", x_MK, w_NK)
        probe.observe("site", "grad_input", dy_MN, w_NK)
        if probe.should_reduce(step):
            probe.reduce()


def _reduced_stats_body(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    probe = Probe(ProbeConfig(**CFG, scalings=EXACT_SCALINGS))
    probe.register_site("site", weight_shape=(N, K))
    _observe_steps(probe, lambda step: _rank_data(rank, step))
    return {role: probe.window_stats("site", role) for role in ("forward", "grad_input")}


def test_reduced_statistics_equal_single_process_on_concatenated_rows() -> None:
    per_rank = run_multiprocess(_reduced_stats_body, 2, timeout=120)
    torch.set_num_threads(1)
    single = Probe(ProbeConfig(**CFG, scalings=EXACT_SCALINGS))
    single.register_site("site", weight_shape=(N, K))

    def concatenated(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [_rank_data(r, step) for r in range(2)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    _observe_steps(single, concatenated)
    for role in ("forward", "grad_input"):
        expected = single.window_stats("site", role)
        assert per_rank[0][role]["count"].tolist() == [2.0] * 4
        for name in COMPARED:
            for rank in range(2):
                got = per_rank[rank][role][name]
                if got.dtype == torch.bool or got.dtype == torch.int64:
                    assert torch.equal(got, expected[name]), (role, name)
                else:
                    # Same sums in another order: equal to float64 rounding of fp32 partials.
                    torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-4, msg=f"{role} {name}")
        # Both ranks hold bit-identical reduced statistics.
        for name in COMPARED:
            assert torch.equal(per_rank[0][role][name], per_rank[1][role][name]), (role, name)


def _verdicts_body(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    probe = Probe(ProbeConfig(**CFG, scalings=("tensorwise", "rowwise")))
    probe.register_site("site", weight_shape=(N, K))
    probe.register_site("other", weight_shape=(N, K))
    w_NK = _weight_NK()
    snapshots = []
    for step in range(3 * 4):
        probe.begin_step(step)
        gen = torch.Generator().manual_seed(10_000 * rank + step)
        x_MK = torch.randn(M, K, generator=gen)
        if rank == 1:
            x_MK[:, :2] *= 1e3  # only rank 1 sees outlier channels
            if step == 9:
                x_MK[3, 3] = float("nan")  # and one NaN, on one rank only
        probe.observe("site", "forward", x_MK, w_NK)
        probe.observe("other", "forward", torch.randn(M, K, generator=gen), w_NK)
        if probe.should_reduce(step):
            probe.reduce()
            snapshots.append({str(k): v.to_dict() for k, v in probe.verdicts().items()})
    return {
        "snapshots": snapshots,
        "nonfinite_events": probe.num_nonfinite_events,
        "world_size": dist.get_world_size(),
    }


def test_identical_verdicts_on_all_ranks_with_different_data() -> None:
    r0, r1 = run_multiprocess(_verdicts_body, 2, timeout=120)
    assert r0["world_size"] == 2
    assert r0["snapshots"] == r1["snapshots"]
    last = r0["snapshots"][-1]
    by_name = {
        (v["site"], v["scaling"], v["fmt"]): v for v in last.values() if v["role"] == "forward"
    }
    # Rank 0's clean data cannot hide rank 1's outliers and NaN: the global verdict is unsafe.
    site_e4m3_tw = by_name[("site", "tensorwise", "e4m3")]
    assert not site_e4m3_tw["safe"]
    assert "non-finite" in site_e4m3_tw["reason"] and "underflow" in site_e4m3_tw["reason"]
    assert by_name[("other", "rowwise", "e4m3")]["safe"]
    assert r0["nonfinite_events"] == r1["nonfinite_events"] == 1
    # The second snapshot (before the NaN) already saw the outliers of rank 1 on rank 0.
    second = {
        (v["site"], v["scaling"], v["fmt"]): v for v in r0["snapshots"][1].values() if v["role"] == "forward"
    }
    assert not second[("site", "tensorwise", "e4m3")]["safe"]
    assert "non-finite" not in second[("site", "tensorwise", "e4m3")]["reason"]


def _empty_batch_body(rank: int, world_size: int) -> list[tuple[int, bool, str]]:
    """Rank 1 gets an empty batch at steps 2-3 (nothing recorded in that interval)."""
    torch.set_num_threads(1)
    probe = Probe(ProbeConfig(every_k_steps=1, sites_per_step=None, interval=2, window=8, min_samples=1,
                              hysteresis_intervals=2, formats=("e4m3",), scalings=("rowwise",)))
    probe.register_site("s", weight_shape=(16, 32))
    gen = torch.Generator().manual_seed(0)
    w_NK = torch.randn(16, 32, generator=gen)
    out = []
    for step in range(6):
        probe.begin_step(step)
        x_MK = torch.randn(64, 32, generator=gen)
        if rank == 1 and step in (2, 3):
            x_MK = x_MK[:0]
        probe.observe("s", "forward", x_MK, w_NK)
        if probe.should_reduce(step):
            v = probe.reduce()[("s", "forward", probe.candidates[0].fmt, probe.candidates[0].scaling)]
            out.append((step, v.safe, v.reason.split(":")[0]))
    return out


def test_a_rank_without_data_in_an_interval_reaches_the_same_verdicts() -> None:
    """Whether an interval brought new data (hysteresis) is decided from the reduced counts:
    a rank that recorded nothing must not fall a streak behind the others."""
    per_rank = run_multiprocess(_empty_batch_body, world_size=2)
    assert per_rank[0] == per_rank[1], per_rank
    assert [safe for _, safe, _ in per_rank[0]] == [False, True, True]
