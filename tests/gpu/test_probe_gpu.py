"""The Probe's CUDA-graph replays give the same window statistics as eager measurement.

Runs on the GPU machine (skipped without CUDA): `pytest tests/gpu/test_probe_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from loka_train.probe import Probe, ProbeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _observe(cuda_graphs: bool, rows: int = 1024) -> Probe:
    probe = Probe(
        ProbeConfig(every_k_steps=1, interval=4, window=4, min_samples=1, cuda_graphs=cuda_graphs, max_rows=1024),
        device=torch.device("cuda"),
    )
    probe.register_site("s", weight_shape=(256, 512))
    gen = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    for step in range(4):  # the first graphed call captures, later ones replay
        probe.begin_step(step)
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        x[:, :4] *= 100.0 * (step + 1)  # outlier columns that change every step
        dy = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        if step == 2:  # a replayed step: the counts are graph inputs, not baked in
            x[5, 7], dy[9, 3] = float("inf"), float("nan")
        probe.observe_forward("s", x, w)
        probe.observe_backward("s", dy, x, w)
    probe.reduce()
    return probe


@pytest.mark.parametrize("rows", [1024, 4096], ids=["all_rows", "subsampled"])
def test_graph_replays_match_eager_statistics(rows: int) -> None:
    """Also with a row subsample (4096 > max_rows), where the graphs get the selected rows."""
    eager, graphed = _observe(False, rows), _observe(True, rows)
    cuda_graphs = graphed._measurement.graphs
    assert cuda_graphs is not None and cuda_graphs.disabled_reason is None
    assert cuda_graphs.num_captures > 0 and cuda_graphs.num_eager == 0
    assert torch.equal(graphed._window.global_nonfinite_total, eager._window.global_nonfinite_total)
    for role in ("forward", "grad_input", "grad_weight"):
        e, g = eager.window_stats("s", role), graphed.window_stats("s", role)
        assert torch.equal(e["nonfinite_a"], g["nonfinite_a"]) and torch.equal(e["nonfinite_b"], g["nonfinite_b"])
        assert float(e["nonfinite_a"].sum()) == 1.0, role  # the one value of x or dy
        assert float(e["nonfinite_b"].sum()) == (1.0 if role == "grad_weight" else 0.0), role
        assert torch.equal(e["valid"], g["valid"]) and bool(e["valid"].all()), role
        valid = e["valid"]
        for key in ("sqnr_db", "underflow_a", "saturation_a", "amax_a", "outlier_ratio_a", "amax_b"):
            torch.testing.assert_close(g[key][valid], e[key][valid], rtol=1e-5, atol=1e-6, msg=f"{role} {key}")


@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_bf16_shadow_gemms_give_the_fp32_statistics(role: str) -> None:
    """The shadow GEMMs as bf16 GEMMs returning fp32 (FP8 payloads and bf16 operands are bf16
    values) against fp32 GEMMs on dequantized operands: same statistics, and no fallback."""
    from loka_train.probe.candidates import candidates_of
    from loka_train.probe.measurement import Measurement, count_nonfinite
    from loka_train.probe.window import WindowLayout

    cfg = ProbeConfig(formats=("e4m3", "e5m2"), scalings=("tensorwise", "rowwise"), cuda_graphs=False)
    cands = candidates_of(cfg)
    gen = torch.Generator("cuda").manual_seed(0)
    m_, k, n = 1024, 2048, 1024
    shapes = {"forward": ((m_, k), (n, k)), "grad_input": ((m_, n), (n, k)), "grad_weight": ((m_, n), (m_, k))}
    sa, sb = shapes[role]
    a = torch.randn(*sa, device="cuda", dtype=torch.bfloat16, generator=gen)
    # A weight (forward, grad-input operand b) is fp32: its reference GEMM stays fp32.
    b_dtype = torch.bfloat16 if role == "grad_weight" else torch.float32
    b = torch.randn(*sb, device="cuda", generator=gen).to(b_dtype)
    out = []
    for fast in (True, False):
        meas = Measurement(cfg, cands, WindowLayout(len(cands)), device=torch.device("cuda"))
        meas.exact_bf16_gemms = fast
        out.append(meas.measure(role, a, b, count_nonfinite(a), count_nonfinite(b), None, graphable=False))
        assert meas.exact_gemm_fallback is None
    for f, s in zip(*out):
        torch.testing.assert_close(f, s, rtol=1e-4, atol=1e-6)


def test_row_stats_kernel_matches_its_reference_and_the_selection_on_cuda() -> None:
    from loka_train.kernels.triton_rowstats import row_stats, row_stats_reference
    from loka_train.probe.sampling import select

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32768, 1000, device="cuda", generator=g).bfloat16()
    x[123, 5], x[4000, 999], x[4000, 0] = float("inf"), float("nan"), -float("inf")
    x[31000] *= 50
    for t in (x, x.t().contiguous().t()):
        peak, bad = row_stats(t)
        ref_peak, ref_bad = row_stats_reference(t)
        assert torch.equal(peak, ref_peak) and torch.equal(bad, ref_bad)
    assert int(bad.sum()) == 3 and int(peak.argmax()) == 31000
    narrow = torch.randn(1 << 20, 27, device="cuda", generator=g).bfloat16()  # Wukong's X^T rows
    narrow[777, 26] = float("nan")
    for t in (narrow, narrow.t().contiguous().t()):
        peak, bad = row_stats(t)
        ref_peak, ref_bad = row_stats_reference(t)
        assert torch.equal(peak, ref_peak) and torch.equal(bad, ref_bad) and int(bad.sum()) == 1
    dy = torch.randn(32768, 512, device="cuda", generator=g).bfloat16()
    fast = select("grad_weight", dy, x, None, 1024, kernel=True)
    slow = select("grad_weight", dy, x, None, 1024, kernel=False)
    assert torch.equal(fast.a, slow.a) and torch.equal(fast.b.nan_to_num(), slow.b.nan_to_num())
    assert int(fast.nf_b) == int(slow.nf_b) == 3 and int(fast.nf_a) == 0


def _observe_sites(cuda_graphs: bool) -> Probe:
    """Three sites of growing, then mixed, sizes (every site sampled every step): the graphs'
    shared input buffers grow as larger operands come."""
    probe = Probe(ProbeConfig(every_k_steps=1, sites_per_step=None, interval=3, window=3, min_samples=1,
                              cuda_graphs=cuda_graphs, max_rows=512), device=torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(1)
    shapes = {"small": (64, 128), "mid": (256, 512), "large": (512, 1024)}
    weights = {s: torch.randn(*shape, device="cuda", generator=gen) for s, shape in shapes.items()}
    for s, w in weights.items():
        probe.register_site(s, weight_shape=tuple(w.shape))
    for step, order in enumerate((["small", "mid", "large"], ["large", "small", "mid"], ["mid", "large", "small"])):
        probe.begin_step(step)
        for s in order:
            w = weights[s]
            x = torch.randn(512, w.shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(512, w.shape[0], device="cuda", dtype=torch.bfloat16, generator=gen)
            probe.observe_forward(s, x, w)
            probe.observe_backward(s, dy, x, w)
    probe.reduce()
    return probe


def test_graphs_share_one_set_of_input_buffers() -> None:
    """The graphs read their inputs from shared buffers: they hold about one sample's operands
    (the largest, at most doubled), every (site, role) is captured once, and the statistics are
    the eager ones."""
    eager, graphed = _observe_sites(False), _observe_sites(True)
    graphs = graphed._measurement.graphs
    assert graphs is not None and graphs.disabled_reason is None and graphs.num_eager == 0
    assert graphs.num_captures == 9  # 3 sites x 3 roles, each captured once
    # The largest sample: 512 rows x 1024 bf16 and a 512 x 1024 fp32 weight, plus the counts.
    largest = 512 * 1024 * 2 + 512 * 1024 * 4
    assert graphs._staging.nbytes <= 2 * largest + 64
    for site in ("small", "mid", "large"):
        for role in ("forward", "grad_input", "grad_weight"):
            e, g = eager.window_stats(site, role), graphed.window_stats(site, role)
            assert torch.equal(e["valid"], g["valid"]) and bool(e["valid"].all()), (site, role)
            for key in ("sqnr_db", "underflow_a", "saturation_a", "amax_a", "amax_b"):
                torch.testing.assert_close(g[key], e[key], rtol=1e-5, atol=1e-6, msg=f"{site} {role} {key}")


def test_shared_full_reads_give_the_window_of_reading_every_operand() -> None:
    """On CUDA (the row-statistics kernel): a site's grad-weight takes over the full reads of X
    and dY (``probe.sampling.FullPasses``), and the window equals the one that reads them again,
    non-finite values and outlier rows included."""
    from loka_train.probe.sampling import FullPasses

    class ReadsAgain(FullPasses):
        TAKE = {role: (None, None) for role in FullPasses.TAKE}

    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[1234, 5], x[77, 9] = 3e3, float("inf")
    dy = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy[42, 1] = float("nan")
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    probes = []
    for passes in (FullPasses(), ReadsAgain()):
        probe = Probe(ProbeConfig(every_k_steps=1, interval=1, window=4, min_samples=1, max_rows=1024),
                      device=torch.device("cuda"))
        probe.register_site("s", weight_shape=(256, 512))
        probe._passes = passes
        probe.begin_step(0)
        probe.observe_forward("s", x, w)
        probe.observe_backward("s", dy, x, w)
        probe.reduce()
        probes.append(probe)
    once, again = probes
    assert (once._passes.reads, once._passes.reused) == (4, 2)
    for role in ("forward", "grad_input", "grad_weight"):
        got, want = once.window_stats("s", role), again.window_stats("s", role)
        for key in want:
            assert torch.equal(got[key], want[key]), (role, key)
