"""Probe API: sampling, hooks, no host sync on the hot path, checkpoint round-trip, report,
plot and metrics, input validation.

Shape legend: M rows (batch), K input features, N output features.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.plugin.plots import margin_grid, plot_sqnr_margin
from loka_train.probe import Probe, ProbeConfig

M, K, N = 32, 64, 32


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny GEMMs on a shared 2-core machine: 2 OpenMP threads make them 1000x slower.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _cfg(**overrides) -> ProbeConfig:
    base = dict(
        every_k_steps=1,
        sites_per_step=None,
        interval=2,
        window=4,
        min_samples=4,
        formats=("e4m3",),
        scalings=("tensorwise", "rowwise"),
    )
    base.update(overrides)
    return ProbeConfig(**base)


def test_first_sampled_step_of_a_process_samples_every_site() -> None:
    names = [f"s{i}" for i in range(5)]

    def picks(probe: Probe, steps: range) -> dict[int, list[str]]:
        out = {}
        for step in steps:
            probe.begin_step(step)
            out[step] = [n for n in names if probe.should_sample(step, n)]
        return out

    primed = Probe(_cfg(every_k_steps=3, sites_per_step=2))
    plain = Probe(_cfg(every_k_steps=3, sites_per_step=2, prime_all_sites=False))
    for probe in (primed, plain):
        for name in names:
            probe.register_site(name)
    got, rotation = picks(primed, range(0, 10)), picks(plain, range(0, 10))
    assert got[0] == names and rotation[0] == names[:2]  # every site once, then the rotation
    assert all(got[s] == rotation[s] for s in range(1, 10)) and got[3] == ["s2", "s3"]
    # A resumed process primes on its own first sampled step (7 and 8 are not sampled).
    resumed = Probe(_cfg(every_k_steps=3, sites_per_step=2))
    for name in names:
        resumed.register_site(name)
    late = picks(resumed, range(7, 13))
    assert late[7] == late[8] == [] and late[9] == names and late[12] == rotation_at(12, names)


def rotation_at(step: int, names: list[str]) -> list[str]:
    plain = Probe(_cfg(every_k_steps=3, sites_per_step=2, prime_all_sites=False))
    for name in names:
        plain.register_site(name)
    return [n for n in names if plain.should_sample(step, n)]


def test_sampling_every_k_and_rotating_subset() -> None:
    probe = Probe(_cfg(every_k_steps=3, sites_per_step=2))
    names = [f"s{i}" for i in range(5)]
    for name in names:
        probe.register_site(name)
    assert not any(probe.should_sample(step, n) for step in (1, 2, 4, 5) for n in names)
    sampled_steps = [3 * j for j in range(5)]
    picks = [[n for n in names if probe.should_sample(step, n)] for step in sampled_steps]
    assert all(len(p) == 2 for p in picks)
    # 5 sampled steps x 2 sites cover each of the 5 sites exactly twice.
    counts = {n: sum(n in p for p in picks) for n in names}
    assert counts == dict.fromkeys(names, 2)
    assert picks[0] != picks[1]
    disabled = Probe(_cfg(enabled=False))
    disabled.register_site("s")
    assert not disabled.should_sample(0, "s")


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_observe_never_reads_a_value_back_to_the_host() -> None:
    """.item(), bool(t), float(t), .tolist() all go through aten._local_scalar_dense."""
    probe = Probe(_cfg(scalings=("tensorwise", "rowwise", "block", "mx"), block_size=32))
    probe.register_site("s", weight_shape=(N, K))
    x_MK, w_NK, dy_MN = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    x_MK[0, 0] = float("nan")
    with _RecordOps() as rec:
        probe.observe_forward("s", x_MK, w_NK)
        probe.observe_backward("s", dy_MN, x_MK, w_NK)
    assert len(rec.ops) > 100  # the mode did see the work
    assert not [op for op in rec.ops if "_local_scalar_dense" in op or "item" in op]
    with _RecordOps() as rec:
        probe.reduce()
    assert any("_local_scalar_dense" in op for op in rec.ops)  # the check can fire


def test_attach_records_all_three_gemms_on_sampled_steps_only() -> None:
    probe = Probe(_cfg(every_k_steps=2, interval=1, min_samples=1))
    lin = torch.nn.Linear(K, N)
    ref_lin = torch.nn.Linear(K, N)
    ref_lin.load_state_dict(lin.state_dict())
    handle = probe.attach(lin, "lin")
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(M, K, generator=gen) for _ in range(3)]
    captured = {}
    for step, x_MK in enumerate(xs):
        probe.begin_step(step)
        y = lin(x_MK)
        if step == 0:
            y.register_hook(lambda g: captured.setdefault("dy", g.detach().clone()))
        (y.square().sum()).backward()
        ref_lin(x_MK).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref_lin.weight.grad, rtol=0, atol=0)
    report = probe.report()
    assert report["sites"]["lin"]["num_observations"] == {
        "forward": 2,
        "grad_input": 2,
        "grad_weight": 2,
    }
    # The hook's grad_weight sample of step 0 equals observing the same tensors directly.
    direct = Probe(_cfg(every_k_steps=2, interval=1, min_samples=1))
    direct.register_site("lin")
    direct.begin_step(0)
    direct.observe_backward("lin", captured["dy"], xs[0], lin.weight.detach())
    probe.reduce()
    direct.reduce()
    hooked = probe.window_stats("lin", "grad_weight")
    slot = int((hooked["step"] == 0).nonzero()[0, 0])
    torch.testing.assert_close(
        hooked["sqnr_db"][slot], direct.window_stats("lin", "grad_weight")["sqnr_db"][0]
    )
    handle.remove()
    probe.begin_step(4)
    lin(xs[0]).sum().backward()
    assert probe.report()["sites"]["lin"]["num_observations"]["forward"] == 2


@pytest.mark.parametrize("mode", ["eval_no_grad", "eval", "no_grad"])
def test_attach_ignores_evaluation_forwards(mode: str) -> None:
    """Evaluation runs after a sampled step s with the Probe's step still s: its forwards
    (eval mode, no autograd, or both as in Trainer.evaluate) take no window slot."""
    probe = Probe(_cfg(window=16))
    lin = torch.nn.Linear(K, N)
    probe.attach(lin, "lin")
    x_MK = torch.randn(M, K, generator=torch.Generator().manual_seed(0))
    probe.begin_step(9)
    lin(x_MK).sum().backward()
    before = probe.state_dict()
    assert before["num_obs"] == [[1, 1, 1]]
    if mode != "no_grad":
        lin.eval()
    with torch.set_grad_enabled(mode == "eval"):
        for _ in range(4):
            lin(x_MK)
    after = probe.state_dict()
    assert after["num_obs"] == before["num_obs"]
    assert after["slot_steps"] == before["slot_steps"]


def _run(probe: Probe, steps: range, seed: int = 0) -> list[dict]:
    """Feed identical data per step whatever the probe; return verdict snapshots."""
    w_NK = torch.randn(N, K, generator=torch.Generator().manual_seed(99)) / 8
    snapshots = []
    for step in steps:
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        x_MK = torch.randn(M, K, generator=gen)
        if 6 <= step < 8:
            x_MK[:, :2] *= 1e3
        probe.begin_step(step)
        for site in ("a", "b"):
            probe.observe_forward(site, x_MK, w_NK)
        if probe.should_reduce(step):
            probe.reduce()
            snapshots.append(_as_dicts(probe))
    return snapshots


def _as_dicts(probe: Probe) -> dict[str, dict]:
    return {str(k): v.to_dict() for k, v in probe.verdicts().items()}  # NaN-safe equality


def test_state_dict_round_trip_gives_identical_verdicts() -> None:
    cfg = _cfg()
    original = Probe(cfg)
    for site in ("a", "b"):
        original.register_site(site, weight_shape=(N, K))
    _run(original, range(0, 12))
    # At step 11 the outlier phase (6, 7) is still in the window: tensorwise is unsafe and
    # must climb back through the hysteresis after the resume.
    key = ("a", "forward", Fp8Format.E4M3, Scaling.TENSORWISE)
    assert not original.verdicts()[key].safe
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    buf.seek(0)
    resumed = Probe(cfg)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert resumed.sites == ("a", "b")
    assert _as_dicts(resumed) == _as_dicts(original)
    cont_original = _run(original, range(12, 24))
    cont_resumed = _run(resumed, range(12, 24))
    assert cont_resumed == cont_original
    assert resumed.history == original.history
    assert resumed.report() == original.report()
    # The state matters: a probe that starts empty at step 12 decides differently.
    fresh = Probe(cfg)
    for site in ("a", "b"):
        fresh.register_site(site, weight_shape=(N, K))
    assert _run(fresh, range(12, 24)) != cont_original


def test_load_state_dict_rejects_mismatches() -> None:
    probe = Probe(_cfg())
    probe.register_site("a")
    state = probe.state_dict()
    fix = r"resume with the same loka config, or set trainer\.resume=never"
    with pytest.raises(ValueError, match=f"window.*{fix}"):
        Probe(_cfg(window=8)).load_state_dict(state)
    with pytest.raises(ValueError, match=f"candidates.*{fix}"):
        Probe(_cfg(scalings=("rowwise",))).load_state_dict(state)
    other = Probe(_cfg())
    other.register_site("b")
    with pytest.raises(ValueError, match=f"sites.*{fix}"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=f"version.*{fix}"):
        Probe(_cfg()).load_state_dict({**state, "version": 0})


def test_report_is_json_and_plot_writes_png(tmp_path: Path) -> None:
    probe = Probe(_cfg())
    for site in ("a", "b"):
        probe.register_site(site, weight_shape=(N, K))
    _run(probe, range(14))
    report = probe.report()
    text = json.dumps(report, allow_nan=False)
    assert json.loads(text)["num_reduces"] == 7
    changes = [h for h in report["history"] if h["site"] == "a" and h["scaling"] == "tensorwise"]
    assert [(h["step"], h["safe"]) for h in changes] == [(5, True), (7, False), (13, True)]
    assert "underflow" in changes[1]["reason"]
    metrics = probe.metrics()
    assert "probe/a/forward/sqnr_db/e4m3_rowwise" in metrics
    assert metrics["probe/a/forward/safe/e4m3_rowwise"] == 1.0
    assert metrics["probe/a/grad_input/safe/e4m3_rowwise"] == 0.0  # never observed
    assert metrics["probe/verdict_changes"] == 2 * 2 * 3  # 2 sites x 2 scalings x 3 changes
    png = plot_sqnr_margin(margin_grid(json.loads(text), []), tmp_path / "plots" / "sqnr_margin.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_unjudged_sites_are_unsafe_with_a_reason() -> None:
    probe = Probe(_cfg())
    probe.register_site("a")
    verdicts = probe.verdicts()
    assert len(verdicts) == 3 * 2
    assert all(not v.safe and "not measured" in v.reason for v in verdicts.values())


def test_input_validation() -> None:
    probe = Probe(_cfg())
    probe.register_site("a", weight_shape=(N, K))
    x_MK, w_NK = torch.randn(M, K), torch.randn(N, K)
    with pytest.raises(ValueError, match="already registered"):
        probe.register_site("a")
    with pytest.raises(ValueError, match="unknown site"):
        probe.observe("nope", "forward", x_MK, w_NK)
    with pytest.raises(ValueError, match="role"):
        probe.observe("a", "backward", x_MK, w_NK)
    with pytest.raises(ValueError, match="registered"):
        probe.observe("a", "forward", torch.randn(M, 2 * K), torch.randn(N, 2 * K))
    with pytest.raises(ValueError, match="contraction"):
        probe.observe("a", "grad_input", torch.randn(M, K), w_NK)
    with pytest.raises(ValueError, match="rows"):
        probe.observe("a", "grad_weight", torch.randn(M, N), torch.randn(M + 1, K))
    with pytest.raises(ValueError, match="roles"):
        probe.register_site("c", sqnr_budget_db={"fwd": 1.0})
    with pytest.raises(ValueError, match="candidate"):
        probe.verdict("a", "forward", "e5m2", "rowwise")
    # 3-D activations are flattened into rows.
    probe.observe("a", "forward", torch.randn(4, 8, K), w_NK)
    assert probe.report()["sites"]["a"]["num_observations"]["forward"] == 1


def test_masked_quantile_matches_torch_quantile() -> None:
    from loka_train.probe.verdicts import masked_quantile

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 2, 7, 4, generator=gen, dtype=torch.float64)
    valid = torch.rand(3, 2, 7, generator=gen) > 0.4
    valid[0, 0] = False  # no valid slot -> NaN
    for q, higher in ((0.1, False), (0.5, False), (0.9, True)):
        got = masked_quantile(values, valid, q, higher=higher)
        for s in range(3):
            for r in range(2):
                for c in range(4):
                    sel = values[s, r, valid[s, r], c]
                    if sel.numel() == 0:
                        assert torch.isnan(got[s, r, c])
                        continue
                    mode = "higher" if higher else "lower"
                    assert got[s, r, c] == torch.quantile(sel, q, interpolation=mode)


def test_selection_skips_a_peak_row_with_a_nonfinite_value_and_keeps_operands_paired() -> None:
    from loka_train.probe.sampling import select

    x_MK = torch.randn(256, K, generator=torch.Generator().manual_seed(2))
    x_MK[201, 5] = 1e4  # the peak row ...
    x_MK[201, 6] = float("inf")  # ... holds a non-finite value: not picked
    x_MK[90, 1] = 500.0  # the largest among the finite rows

    def rows_of(sel: torch.Tensor, full: torch.Tensor) -> list[int]:
        return [next(i for i in range(full.shape[0]) if torch.equal(full[i], r)) for r in sel]

    # select: the counts on the full operands, the rows cut (the finite peak last).
    w_NK = torch.randn(N, K)
    a, b, nf_a, nf_b, _ = select("forward", x_MK, w_NK, None, 8)
    assert a.shape == (8, K) and b is w_NK and int(nf_a) == 1 and int(nf_b) == 0
    assert rows_of(a, x_MK)[-1] == 90 and not any(torch.equal(r, x_MK[201]) for r in a)
    # Both grad-weight operands are cut to the same rows (dY's and X's rows share M), and each
    # operand's peak row is kept.
    dy_MN = torch.randn(256, N, generator=torch.Generator().manual_seed(3))
    dy_MN[33, 0] = -700.0
    a, b, nf_a, nf_b, _ = select("grad_weight", dy_MN, x_MK, None, 8)
    rows = rows_of(a, dy_MN)
    assert {33, 90} <= set(rows) and torch.equal(b, x_MK[rows])
    assert int(nf_a) == 0 and int(nf_b) == 1
    # Through the Probe: the non-finite value of X counts in grad-weight's operand b (the
    # measurement graphs get these counts as inputs; here their eager fallback).
    probe = Probe(_cfg(max_rows=8, interval=1, min_samples=1))
    probe.register_site("s", weight_shape=(N, K))
    probe.observe_backward("s", dy_MN, x_MK, w_NK)
    probe.reduce()
    assert float(probe.window_stats("s", "grad_weight")["nonfinite_b"][0]) == 1.0
    assert float(probe.window_stats("s", "grad_input")["nonfinite_b"][0]) == 0.0
    from loka_train.probe.measurement import CudaGraphs

    fallback = CudaGraphs(probe._measurement.measure_selected, max_graphs=0)
    selection = select("grad_weight", dy_MN, x_MK, None, 8)
    got = fallback.run("grad_weight", *selection[:4])
    eager = probe._measurement.measure("grad_weight", *selection, graphable=False)
    for want, g in zip(eager, got):
        assert torch.equal(want, g)
    assert fallback.num_eager == 1


def test_the_row_cut_keeps_the_peak_row_and_counts_every_nonfinite() -> None:
    probe = Probe(_cfg(max_rows=8, interval=1, min_samples=1))
    probe.register_site("s", weight_shape=(N, K))
    x_MK = torch.randn(256, K, generator=torch.Generator().manual_seed(1))
    x_MK[201, 5] = 1e4  # a single outlier row, not on the stride
    x_MK[77, 3] = float("nan")
    w_NK = torch.randn(N, K)
    probe.observe_forward("s", x_MK, w_NK)
    probe.observe_backward("s", torch.randn(256, N), x_MK, w_NK)
    probe.reduce()
    fwd = probe.window_stats("s", "forward")
    assert float(fwd["amax_a"][0]) == 1e4  # the tensor-wise scale is the full tensor's
    assert float(fwd["nonfinite_a"][0]) == 1.0
    assert float(probe.window_stats("s", "grad_weight")["amax_b"][0]) == 1e4
    # Subsampled: 8 of 256 rows were quantized.
    window = probe._window
    assert window.global_sum is not None
    assert float(window.global_sum[0, 0, 0, window.layout.numel["a"]]) == 8 * K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_count_nonfinite_counts_exactly_the_inf_and_nan_values(dtype: torch.dtype) -> None:
    from loka_train.probe.measurement import count_nonfinite

    info = torch.finfo(dtype)
    x = torch.tensor([0.0, -0.0, 1.0, info.max, -info.max, info.tiny, info.tiny / 4,
                      float("inf"), float("-inf"), float("nan"), 3.0], dtype=dtype)
    count = count_nonfinite(x.reshape(1, -1).expand(2, -1))
    assert count.dtype == torch.int64 and int(count) == 6  # 3 per row, both rows
    assert int(count_nonfinite(x[:7])) == 0  # the largest, the smallest and subnormal values are finite
    assert int(count_nonfinite(torch.full((4, 3), float("nan"), dtype=dtype))) == 12
    g = torch.randn(64, 32, dtype=dtype)
    g[3, 5], g[10, 1] = float("inf"), float("nan")
    assert int(count_nonfinite(g)) == int(g.numel() - torch.isfinite(g).sum()) == 2


def test_count_nonfinite_counts_under_torch_compile() -> None:
    """Inductor folds a multiplication by an integer 0 to zeros: the count must survive it."""
    import torch._dynamo

    from loka_train.probe.measurement import count_nonfinite

    torch._dynamo.reset()
    x = torch.tensor([1.0, float("inf"), float("nan"), -0.0, float("-inf")])
    try:
        assert int(torch.compile(count_nonfinite, backend="inductor")(x)) == 3
    finally:
        torch._dynamo.reset()


def _site_step(probe: Probe, x_MK: torch.Tensor, w_NK: torch.Tensor, dy_MN: torch.Tensor,
               between: Callable[[], None] = lambda: None) -> None:
    """One sampled step of one site, in the order a training step reports it."""
    probe.begin_step(0)
    probe.observe_forward("s", x_MK, w_NK)
    between()
    probe.observe_backward("s", dy_MN, x_MK, w_NK)


def test_an_operand_two_roles_share_is_read_once_a_step_with_the_same_statistics() -> None:
    """X (forward, grad-weight) and dY (grad-input, grad-weight) are each read in full once a
    step: the grad-weight takes over the earlier roles' counts and peak rows, and the window
    holds what reading them again gives."""
    from loka_train.probe.sampling import FullPasses

    x_MK = torch.randn(256, K, generator=torch.Generator().manual_seed(4))
    x_MK[201, 5], x_MK[77, 3] = 1e4, float("nan")
    dy_MN = torch.randn(256, N, generator=torch.Generator().manual_seed(5))
    dy_MN[12, 7] = float("inf")
    w_NK = torch.randn(N, K, generator=torch.Generator().manual_seed(6))
    probes = []
    for passes in (FullPasses(), FullPasses(share=False)):
        probe = Probe(_cfg(max_rows=8, interval=1, min_samples=1))
        probe.register_site("s", weight_shape=(N, K))
        probe._passes = passes
        _site_step(probe, x_MK.clone(), w_NK, dy_MN.clone())
        probe.reduce()
        probes.append(probe)
    once, again = probes
    assert (once._passes.reads, once._passes.reused) == (4, 2)  # X, W, dY, W read; X, dY taken over
    assert (again._passes.reads, again._passes.reused) == (6, 0)
    assert len(once._passes) == 0  # the grad-weight dropped what it took
    for role in ("forward", "grad_input", "grad_weight"):
        got, want = once.window_stats("s", role), again.window_stats("s", role)
        for key in want:
            assert torch.equal(got[key], want[key]), (role, key)
    gw = once.window_stats("s", "grad_weight")
    assert float(gw["nonfinite_a"][0]) == 1.0 and float(gw["nonfinite_b"][0]) == 1.0
    assert float(gw["amax_b"][0]) == 1e4


def test_a_shared_operand_is_read_again_when_it_changed_or_its_owner_is_gone() -> None:
    x_MK = torch.randn(256, K, generator=torch.Generator().manual_seed(4))
    dy_MN = torch.randn(256, N, generator=torch.Generator().manual_seed(5))
    w_NK = torch.randn(N, K)
    probe = Probe(_cfg(max_rows=8, interval=1, min_samples=1))
    probe.register_site("s", weight_shape=(N, K))

    def poison() -> None:
        x_MK[3, 3] = float("inf")  # in place: the version counter moves

    _site_step(probe, x_MK, w_NK, dy_MN, between=poison)
    probe.reduce()
    assert (probe._passes.reads, probe._passes.reused) == (5, 1)  # X read again; dY taken over
    assert float(probe.window_stats("s", "grad_weight")["nonfinite_b"][0]) == 1.0
    assert float(probe.window_stats("s", "forward")["nonfinite_a"][0]) == 0.0
    # A kept read whose storage no longer exists is not taken: its address may be another's now.
    passes = probe._passes
    passes.clear()
    x = torch.randn(16, K)
    passes(x, site="s", peaks=True, kernel=False, keep="x", take=None)
    (key,) = passes._kept
    passes._kept[key] = (lambda: None, *passes._kept[key][1:])  # as if x's storage had been freed
    passes(x, site="s", peaks=True, kernel=False, keep=None, take="x")
    assert passes.reused == 1 and passes.reads == 7
    # Nor is a read kept for another site, or for another name of the same site.
    passes(x, site="s", peaks=True, kernel=False, keep="x", take=None)
    passes(x, site="t", peaks=True, kernel=False, keep=None, take="x")
    passes(x, site="s", peaks=True, kernel=False, keep=None, take="dy")
    assert passes.reused == 1 and passes.reads == 10
    # Nor by another tensor at the same address: a view into the same storage elsewhere.
    base = torch.randn(32, K)
    passes(base[:16], site="s", peaks=True, kernel=False, keep="x", take=None)
    passes(base[16:], site="s", peaks=True, kernel=False, keep=None, take="x")
    assert passes.reused == 1 and passes.reads == 12
    # A step start drops what a site whose backward never came left.
    passes(x, site="s", peaks=False, kernel=False, keep="x", take=None)
    probe.begin_step(1)
    assert len(passes) == 0


def test_inference_tensors_are_observed_and_read_every_time() -> None:
    """Tensors made under ``torch.inference_mode`` have no version counter: the Probe still
    observes them (it never raises on its inputs), reading each operand in full."""
    with torch.inference_mode():
        x_MK, dy_MN, w_NK = torch.randn(256, K), torch.randn(256, N), torch.randn(N, K)
    probe = Probe(_cfg(max_rows=8, interval=1, min_samples=1))
    probe.register_site("s", weight_shape=(N, K))
    _site_step(probe, x_MK, w_NK, dy_MN)
    assert (probe._passes.reads, probe._passes.reused) == (6, 0) and len(probe._passes) == 0
    probe.reduce()
    assert float(probe.window_stats("s", "grad_weight")["count"][0]) == 1.0


def test_a_probe_with_kept_passes_pickles_and_copies_without_them() -> None:
    import copy
    import pickle

    probe = Probe(_cfg(max_rows=8))
    probe.register_site("s", weight_shape=(N, K))
    x_MK = torch.randn(64, K)
    probe.begin_step(0)
    probe.observe_forward("s", x_MK, torch.randn(N, K))
    assert len(probe._passes) == 1
    for clone in (pickle.loads(pickle.dumps(probe)), copy.deepcopy(probe)):
        assert len(clone._passes) == 0 and clone._passes.reads == probe._passes.reads


def test_select_refuses_shared_reads_without_a_site() -> None:
    from loka_train.probe.sampling import FullPasses, select

    a, b = torch.randn(8, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match="without the site"):
        select("forward", a, b, None, 4, passes=FullPasses())
    assert select("forward", a, b, None, 4, passes=FullPasses(), site="s").a.shape[1] == 4
