"""Static tensor-wise scales: the Triton quantizer (under TRITON_INTERPRET=1) against the PyTorch
reference through seeding, fits, drifts and non-finite tensors; the rule that decides a fit at
its edges; the slot helpers; the path sites, Dispatch's timer and the plugin take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from loka_train.kernels import static_scales as ss
from loka_train.kernels import triton_tensorwise as tt
from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.kernels.linear import quantize_operand, quantize_with_transpose
from loka_train.kernels.plan import GemmPlan, LinearPlan

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]
E4M3 = Fp8Format.E4M3


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _slot(margin: float = 2.0, spread: float = 16.0) -> torch.Tensor:
    return ss.new_slots(1, margin=margin, spread=spread, device=torch.device("cpu"))[0]


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("both", [False, True], ids=["one_layout", "both_layouts"])
def test_kernel_matches_the_reference_through_seed_fit_and_drift(fmt, both, monkeypatch):
    monkeypatch.setattr(tt, "_BLOCK", 256)  # 7 blocks, a ragged last one
    monkeypatch.setattr(tt, "_TILE_R", 16)  # 18 tiles
    monkeypatch.setattr(tt, "_TILE_C", 8)
    monkeypatch.setattr(tt, "_PROGRAMS_PER_SM", 5)  # 5 programs, looping over their blocks (tiles),
    monkeypatch.setattr(tt, "multiprocessors", lambda device: 1)  # the recast's too
    monkeypatch.setattr(tt, "_FINAL_BLOCK", 4)  # the check's loop over the 5 amaxes runs twice
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 45, generator=g)).to(torch.bfloat16)
    x[30, 40] = 25.0  # the amax sits in a later block (tile) of its program
    slot, ref_slot = _slot(), _slot()
    scales = []
    # Drifts beyond the format's headroom: e5m2 (gradients) takes 128x more both ways.
    up, down = (40, 100) if fmt is E4M3 else (1000, 10**5)
    for t in (x, 1.5 * x, up * x, up * x, x / down, 0 * x):
        q, scale, q_t = tt.tensorwise_quant_static(t, slot, fmt=fmt, both=both)
        rq, rs = ss.quantize_static_reference(t, ref_slot, fmt)
        assert torch.equal(scale, rs) and _same(q, rq) and torch.equal(slot, ref_slot)
        assert (q_t is not None) == both
        if q_t is not None:
            assert _same(q_t, q.t().contiguous())
        scales.append(float(scale))
    # Seeded by the first call (dynamic, not counted); then static, a recast at each drift.
    assert ss.fallbacks(slot) == [2]

    def power_of_two(v: float) -> bool:
        return v > 0 and float(torch.tensor(v).log2()) % 1 == 0

    # 1.5x, the second 40x and the zeros took the slot's power-of-two scale; the first call
    # and the two drifts took their dynamic scale (amax / max).
    assert [power_of_two(v) for v in scales] == [False, True, False, True, False, True]


@pytest.mark.parametrize("both", [False, True], ids=["one_layout", "both_layouts"])
def test_every_tile_a_cast_program_loops_over_counts_in_the_fit_check(both, monkeypatch):
    # A persistent grid: 3 programs, each casting every third block (tile) and storing one amax
    # of them all. A value the static scale cannot take, in any one tile, must make it recast.
    monkeypatch.setattr(tt, "_BLOCK", 256)
    monkeypatch.setattr(tt, "_TILE_R", 16)
    monkeypatch.setattr(tt, "_TILE_C", 8)
    monkeypatch.setattr(tt, "_FINAL_BLOCK", 2)  # the check's loop over the 3 amaxes runs twice
    monkeypatch.setattr(tt, "_PROGRAMS_PER_SM", 3)
    monkeypatch.setattr(tt, "multiprocessors", lambda device: 1)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(37, 45, generator=g).to(torch.bfloat16)
    if both:
        origins = [(r, c) for r in range(0, 37, 16) for c in range(0, 45, 8)]  # 18 tiles
    else:
        origins = [divmod(i, 45) for i in range(0, base.numel(), 256)]  # 7 blocks
    assert len(origins) > 2 * 3  # programs cast several tiles each
    # Each program's first two tiles (the last tile of programs 1 and 2 for the 7 blocks of one
    # layout): an amax taken from one tile a program misses the value in program 0's first.
    for r, c in origins[: 2 * 3]:
        slot, ref_slot = _slot(), _slot()
        tt.tensorwise_quant_static(base, slot, both=both)  # seeds
        ss.quantize_static_reference(base, ref_slot, E4M3)
        x = base.clone()
        x[r, c] = 1000.0  # far over what the seeded scale takes
        q, scale, q_t = tt.tensorwise_quant_static(x, slot, both=both)
        rq, rs = ss.quantize_static_reference(x, ref_slot, E4M3)
        assert torch.equal(scale, rs) and _same(q, rq) and torch.equal(slot, ref_slot), (r, c)
        assert ss.fallbacks(slot) == [1], (r, c)
        if both:
            assert _same(q_t, rq.t().contiguous())


def test_where_the_static_scale_fits_the_codes_are_x_over_the_scale():
    x = torch.randn(64, 32)
    slot = _slot()
    tt.tensorwise_quant_static(x, slot)  # seeds
    q, scale, _ = tt.tensorwise_quant_static(x, slot)
    assert float(scale) == float(slot[ss.SCALE]) and ss.fallbacks(slot) == [0]
    assert _same(q, (x / scale).to(E4M3.dtype))
    # The seed: the power of two at or above amax * margin / max.
    want = 2.0 ** torch.ceil(torch.log2(x.abs().amax() * 2.0 / E4M3.max))
    assert float(scale) == float(want)


@pytest.mark.parametrize(
    ("amax_over_top", "fits"),
    [(1.0, True), (1.01, False), (1 / 16, True), (1 / 16.5, False), (0.0, True)],
    ids=["at_the_top", "just_above", "spread_below", "just_below_spread", "all_zero"],
)
def test_the_fit_rule_at_its_edges(amax_over_top, fits):
    """Fits: ``amax / scale`` in ``[max / spread, max]`` (all zeros fit); else recast and counted."""
    scale = 2.0**-4
    x = torch.zeros(8, 16)
    x[3, 5] = amax_over_top * E4M3.max * scale
    slot, ref_slot = _slot(), _slot()
    slot[ss.SCALE] = ref_slot[ss.SCALE] = scale
    q, got, _ = tt.tensorwise_quant_static(x, slot)
    rq, want = ss.quantize_static_reference(x, ref_slot, E4M3)
    assert _same(q, rq) and torch.equal(got, want) and torch.equal(slot, ref_slot)
    assert (float(got) == scale) == fits
    assert ss.fallbacks(slot) == [0 if fits else 1]
    if not fits:
        dynamic = quantize(x, E4M3, Scaling.TENSORWISE)
        assert _same(q, dynamic.data) and torch.equal(got, dynamic.scale)  # the dynamic payload


def test_a_non_finite_tensor_recasts_with_a_nan_scale_and_keeps_the_slot_scale():
    x = torch.randn(16, 16)
    slot = _slot()
    tt.tensorwise_quant_static(x, slot)
    seeded = float(slot[ss.SCALE])
    x[2, 3] = float("nan")
    q, scale, _ = tt.tensorwise_quant_static(x, slot)
    assert torch.isnan(scale) and torch.isnan(q.float() * scale).all()
    assert float(slot[ss.SCALE]) == seeded and ss.fallbacks(slot) == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("row", [5, 20, 36], ids=["first_tile", "second_tile", "last_tile"])
def test_a_non_finite_value_in_any_tile_recasts_the_two_layouts(bad, row, monkeypatch):
    """The two-layout cast reduces its amax tile by tile: a NaN or an infinity in any tile
    makes the tensor's amax infinite (NaN scale, a counted recast, the slot kept), as the
    reference's."""
    monkeypatch.setattr(tt, "_TILE_R", 8)
    monkeypatch.setattr(tt, "_TILE_C", 16)
    x = torch.randn(37, 40).to(torch.bfloat16)
    slot, ref_slot = _slot(), _slot()
    tt.tensorwise_quant_static(x, slot, both=True)
    ss.quantize_static_reference(x, ref_slot, E4M3)
    x[row, 17] = bad
    q, scale, q_t = tt.tensorwise_quant_static(x, slot, both=True)
    _, rs = ss.quantize_static_reference(x, ref_slot, E4M3)
    assert torch.isnan(scale) and torch.isnan(rs) and torch.equal(slot, ref_slot) and ss.fallbacks(slot) == [1]
    # Every value dequantizes to NaN (the interpreter converts NaN to another code than the CPU).
    assert torch.isnan(q.float() * scale).all() and torch.isnan(q_t.float() * scale).all()


def test_an_unset_slot_is_seeded_without_a_count_and_an_empty_tensor_leaves_it():
    slot = _slot()
    q, scale, _ = tt.tensorwise_quant_static(torch.zeros(0, 8), slot)
    assert q.shape == (0, 8) and float(scale) == 1.0 and float(slot[ss.SCALE]) == 0.0
    tt.tensorwise_quant_static(torch.zeros(4, 8), slot)  # all zeros: nothing to seed from
    assert float(slot[ss.SCALE]) == 0.0 and ss.fallbacks(slot) == [0]
    tt.tensorwise_quant_static(torch.randn(4, 8), slot)
    assert float(slot[ss.SCALE]) > 0 and ss.fallbacks(slot) == [0]


def test_set_from_amax_takes_a_power_of_two_with_margin_and_ignores_bad_amaxes():
    slot = _slot(margin=4.0)
    ss.set_from_amax(slot, 100.0, E4M3)
    assert float(slot[ss.SCALE]) == 1.0  # 100 * 4 / 448 = 0.89 -> 1
    ss.set_from_amax(slot, 448.0 / 4, E4M3)  # exactly 1: stays 1
    assert float(slot[ss.SCALE]) == 1.0
    for bad in (0.0, float("inf"), float("nan")):
        ss.set_from_amax(slot, bad, E4M3)
        assert float(slot[ss.SCALE]) == 1.0
    ss.set_from_amax(slot, 100.0, Fp8Format.E5M2)
    assert float(slot[ss.SCALE]) == 1.0  # 100 * 4 * 128 (e5m2's headroom) / 57344 = 0.89 -> 1
    assert ss.headroom(E4M3) == 1.0 and ss.headroom(Fp8Format.E5M2) == 128.0


def test_slot_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="margin"):
        ss.new_slots(1, margin=0.5, spread=16.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="spread"):
        ss.new_slots(1, margin=2.0, spread=1.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="static-scale slot"):
        tt.tensorwise_quant_static(torch.randn(4, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="static-scale slot"):
        tt.tensorwise_quant_static(torch.randn(4, 4), torch.zeros(4, dtype=torch.float64))


def test_opcheck_static():
    torch.library.opcheck(
        torch.ops.loka.tensorwise_quant_static.default, (torch.randn(5, 7), _slot(), "e4m3", True),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_quantize_operand_and_quantize_with_transpose_take_the_slot():
    plan = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="triton")
    x = torch.randn(32, 24)
    slot = _slot()
    quantize_operand(x, plan.fmt, plan, is_weight=False, static=slot)  # seeds
    q = quantize_operand(x, plan.fmt, plan, is_weight=False, static=slot)
    assert float(q.scale) == float(slot[ss.SCALE])
    dynamic = quantize_operand(x, plan.fmt, plan, is_weight=False)
    assert float(dynamic.scale) != float(q.scale)  # the slot is what changed the scale
    q2, q2_t = quantize_with_transpose(x, plan.fmt, plan, plan, plan.fmt, is_weight=False, static=slot)
    assert q2_t is not None and q2_t.data.is_contiguous() and _same(q2_t.data, q2.data.t().contiguous())
    assert float(q2.scale) == float(slot[ss.SCALE]) and ss.fallbacks(slot) == [0]
    rowwise = GemmPlan(precision="fp8", scaling=Scaling.ROWWISE, backend="triton")
    assert quantize_operand(x, rowwise.fmt, rowwise, is_weight=False, static=slot).scale.shape == (32, 1)


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()).detach())


@pytest.mark.parametrize("backend", ["triton", "emulated"])
def test_a_site_with_static_scales_trains_like_dynamic_and_seeds_x_and_dy(backend):
    """On the Triton quantizer and on the emulated oracle (its PyTorch reference) alike."""
    from loka_train.mods.site import Fp8Linear

    torch.manual_seed(0)
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend=backend)
    ref = nn.Linear(64, 48)
    sites = []
    for static in (False, True):
        lin = nn.Linear(64, 48)
        lin.load_state_dict(ref.state_dict())
        site = Fp8Linear.from_linear(lin, plan=plan)
        if static:
            site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
        sites.append(site)
    dyn, stat = sites
    assert dyn.static_slots is None and stat.static_slots is not None
    for _ in range(3):
        x = torch.randn(128, 64)
        g = torch.randn(128, 48)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        outs = [m(xi) for m, xi in zip((ref, dyn, stat), xs)]
        for y in outs:
            y.backward(g)
        # Static scales cost at most a fraction of a dB of SQNR against dynamic ones.
        assert _sqnr(outs[0], outs[2]) > _sqnr(outs[0], outs[1]) - 1.0
        assert _sqnr(xs[0].grad, xs[2].grad) > _sqnr(xs[0].grad, xs[1].grad) - 1.0
    slots = stat.static_slots
    assert (slots[:, ss.SCALE] > 0).all() and ss.fallbacks(slots) == [0, 0]
    assert all(float(v).is_integer() for v in torch.log2(slots[:, ss.SCALE]))  # powers of two


def test_dispatch_times_the_static_path_only_where_sites_take_it():
    from loka_train.dispatch.timing import GemmTimer

    tw = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="triton")
    rw = GemmPlan(precision="fp8", scaling=Scaling.ROWWISE, backend="triton")
    off = GemmTimer(timing="cost_model", device="cpu", out_dtype=torch.float32)
    on = GemmTimer(timing="cost_model", device="cpu", out_dtype=torch.float32, static_scales=True)
    assert off.static_slot("forward", tw) is None
    assert on.static_slot("forward", tw) is not None and on.static_slot("grad_input", tw) is not None
    assert on.static_slot("grad_weight", tw) is None  # dY^T and X^T take the transposing quantizer
    assert on.static_slot("forward", rw) is None and on.static_slot("forward", None) is None


def _plugin_run(tmp_path: Path, **loka):  # type: ignore[no-untyped-def]
    from loka_train.mods.config import ModsConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.plugin.config import LokaConfig
    from loka_train.probe.config import ProbeConfig
    from loka_train.runtime.context import RunContext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    ctx = RunContext(model=model, device=torch.device("cpu"), out_dir=tmp_path)
    config = LokaConfig(
        enabled=True, probe=ProbeConfig(every_k_steps=1, interval=2, window=4),
        mods=ModsConfig(enabled=True, static_scales=True, static_scale_margin=4.0), **loka,
    )
    cb = LokaCallback(config)
    cb.on_before_shard(ctx)
    return cb, ctx


def _window_seed(cb, name: str, role: str, fmt: Fp8Format) -> float:  # type: ignore[no-untyped-def]
    stats = cb.probe.window_stats(name, role)
    amax = float(stats["amax_a"][stats["valid"].bool()].max())
    return float(2.0 ** torch.ceil(torch.log2(torch.tensor(amax * 4.0 * ss.headroom(fmt) / fmt.max))))


def test_the_plugin_enables_slots_refreshes_them_from_the_probe_and_reports_fallbacks(tmp_path: Path) -> None:
    cb, ctx = _plugin_run(tmp_path)
    cb.on_train_start(ctx)
    assert cb.sites and all(s.static_slots is not None for s in cb.sites.values())
    x = torch.randn(8, 16)
    for step in range(2):
        cb.on_step_start(ctx, step)
        ctx.model(x).sum().backward()
        cb.on_step_end(ctx, step, {})
    assert cb.probe is not None
    # (The plans stay high precision here: only the plugin's refresh writes the slots.)
    for name, site in cb.sites.items():
        assert site.static_slots is not None
        assert float(site.static_slots[0, ss.SCALE]) == _window_seed(cb, name, "forward", E4M3), name
    # With an FP8 plan, x's slot takes the forward's format and dY's the grad-input's (e5m2).
    name = sorted(cb.sites)[0]
    site = cb.sites[name]
    slots = site.static_slots
    assert slots is not None
    site.set_plan(LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="emulated"))
    cb._refresh_static_scales()
    assert float(slots[0, ss.SCALE]) == _window_seed(cb, name, "forward", E4M3)
    assert float(slots[1, ss.SCALE]) == _window_seed(cb, name, "grad_input", Fp8Format.E5M2)
    # (Seeds from x and from dY differ here, so a row refreshed from the other role shows. An
    # e5m2 seed equals an e4m3 one: 128 / 57344 == 1 / 448, the top codes sit where e4m3's do.)
    assert _window_seed(cb, name, "grad_input", Fp8Format.E5M2) != _window_seed(cb, name, "forward", E4M3)
    slots[1, ss.FALLBACKS] = 3
    report = cb.report(ctx)
    rows = [r for r in report["static_scales"] if r["site"] == name]
    # The plugin's dispatcher still holds the high-precision plan: the slots are not in use.
    assert rows == [
        {"site": name, "operand": "x", "scale": float(slots[0, ss.SCALE]), "recasts": 0, "tensorwise": False},
        {"site": name, "operand": "dY", "scale": float(slots[1, ss.SCALE]), "recasts": 3, "tensorwise": False},
    ]
    from loka_train.plugin.report import markdown

    md = markdown(report, history=[])
    assert "## Static scales" in md and f"| {name} | dY | no | {float(slots[1, ss.SCALE]):.6g} | 3 |" in md
    lines = [f for f in cb.report(ctx)["fallbacks"] if "static scale" in f]
    assert lines == [f"kernels: {name} dY: the static scale did not fit 3 tensor(s), which were recast with "
                     "their dynamic scale (the scale re-seeded from each finite one)"]
    # A resumed run starts from the restored window's scales, before any step.
    state = cb.state_dict()
    resumed, ctx2 = _plugin_run(tmp_path / "resumed")
    resumed.load_state_dict(state)
    resumed.on_train_start(ctx2)
    for name, site in resumed.sites.items():
        assert site.static_slots is not None
        assert float(site.static_slots[0, ss.SCALE]) == _window_seed(cb, name, "forward", E4M3), name


def test_enabling_static_scales_again_keeps_the_slots():
    """A captured step reads the slots' addresses: a second enable keeps them, new knobs in place."""
    from loka_train.mods.site import Fp8Linear

    site = Fp8Linear.from_linear(nn.Linear(8, 4))
    site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
    slots = site.static_slots
    assert slots is not None
    slots[0, ss.SCALE] = 0.25
    slots[1, ss.FALLBACKS] = 5  # the earlier run's
    site.enable_static_scales(margin=8.0, spread=32.0, device=torch.device("cpu"))
    assert site.static_slots is slots
    assert slots[:, ss.MARGIN].tolist() == [8.0, 8.0] and slots[:, ss.SPREAD].tolist() == [32.0, 32.0]
    assert float(slots[0, ss.SCALE]) == 0.25 and ss.fallbacks(slots) == [0, 0]


def test_static_slots_through_the_compiled_opaque_op_match_eager():
    """fp8_linear with static slots under torch.compile (the opaque planned_linear op): outputs,
    gradients and the slots' updates (x in the forward op, dY in the backward op) as in eager code."""
    from loka_train.kernels.linear import fp8_linear

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
    torch.manual_seed(0)
    w0 = torch.randn(24, 32)
    b0 = torch.randn(24)
    xs = [torch.randn(64, 32) * s for s in (1.0, 1.5, 50.0)]  # seed, fit, recast
    g = torch.randn(64, 24)

    def run(fn):  # type: ignore[no-untyped-def]
        slots = ss.new_slots(2, margin=2.0, spread=16.0, device=torch.device("cpu"))
        outs = []
        for x in xs:
            xr, w, b = x.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
            y = fn(xr, w, b, slots)
            y.backward(g)
            outs.append((y.detach(), xr.grad, w.grad, b.grad))
        return outs, slots

    def eager(x, w, b, slots):  # type: ignore[no-untyped-def]
        return fp8_linear(x, w, b, plan, static_slots=slots)

    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
    want, want_slots = run(eager)
    got, got_slots = run(compiled)
    assert torch.equal(got_slots, want_slots)
    assert ss.fallbacks(got_slots)[0] == 1 and (got_slots[:, ss.SCALE] > 0).all()  # the 50x drift recast
    for a, b in zip(got, want):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_the_timer_names_static_scales_in_its_source(monkeypatch):
    from loka_train.dispatch.timing import GemmTimer

    monkeypatch.setattr(GemmTimer, "mode", property(lambda self: "measure"))
    on = GemmTimer(timing="measure", device="cpu", out_dtype=torch.bfloat16, static_scales=True)
    off = GemmTimer(timing="measure", device="cpu", out_dtype=torch.bfloat16)
    assert on.source.endswith(", static tensor-wise scales and transposed writes") and "static" not in off.source


def test_mods_config_validates_the_static_scale_knobs():
    from loka_train.mods.config import ModsConfig

    with pytest.raises(ValueError, match="static_scale_margin"):
        ModsConfig(static_scale_margin=0.5)
    with pytest.raises(ValueError, match="static_scale_spread"):
        ModsConfig(static_scale_spread=1)
    with pytest.raises(ValueError, match="static_scales"):
        ModsConfig(static_scales="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_two_layout_casts_read_rows_that_lie_apart(static, monkeypatch):
    """A slice of a wider tensor's columns (a concatenation's gradient) gives what its
    contiguous copy gives: payloads, scale and the slot's update."""
    from loka_train.kernels.formats import is_row_strided

    monkeypatch.setattr(tt, "_TILE_R", 8)
    monkeypatch.setattr(tt, "_TILE_C", 16)
    wide = torch.randn(37, 72).to(torch.bfloat16)
    x = wide[:, 8:48]  # rows 72 apart, 40 columns
    assert is_row_strided(x) and not x.is_contiguous()
    assert not is_row_strided(wide) and not is_row_strided(x.t())

    def cast(t, slot):  # type: ignore[no-untyped-def]
        if slot is None:
            return tt.tensorwise_quant_both(t, fmt=Fp8Format.E5M2)
        return tt.tensorwise_quant_static(t, slot, fmt=Fp8Format.E5M2, both=True)

    slots = [_slot(), _slot()] if static else [None, None]
    if static:
        for slot in slots:
            cast(x.contiguous(), slot)  # seeds
    got, want = cast(x, slots[0]), cast(x.contiguous(), slots[1])
    assert _same(got[0], want[0]) and torch.equal(got[1], want[1]) and _same(got[2], want[2])
    if static:
        assert torch.equal(slots[0], slots[1])
    q, scale, q_t = tt.tensorwise_quant_both(x)
    rq, rs = tt.tensorwise_quant_reference(x.contiguous())
    assert _same(q, rq) and torch.equal(scale, rs) and _same(q_t, rq.t().contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        tt.tensorwise_quant(x)  # the one-layout cast reads contiguous inputs only


def test_the_emulated_oracle_quantizes_with_the_slot_as_the_kernel_does():
    """quantize_operand on the emulated backend: the reference's codes, scale and slot update,
    which the Triton kernel matches bit for bit (the drift test above)."""
    emulated = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="emulated")
    triton = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="triton")
    x = torch.randn(48, 40)
    slots = [_slot(), _slot()]
    for t in (x, 2 * x, 300 * x):  # seed, fit, recast
        a = quantize_operand(t, E4M3, emulated, is_weight=False, static=slots[0])
        b = quantize_operand(t, E4M3, triton, is_weight=False, static=slots[1])
        assert torch.equal(a.scale, b.scale) and _same(a.data, b.data) and torch.equal(slots[0], slots[1])
    assert ss.fallbacks(slots[0]) == [1]


def test_the_timer_gives_no_slot_to_the_emulated_candidate_on_a_gpu():
    """On a GPU the emulated candidate's static path would decide on the host, which a graphed
    timing cannot capture: it is timed with its dynamic scale (no CUDA needed to ask)."""
    from loka_train.dispatch.timing import GemmTimer

    emulated = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="emulated")
    gpu = GemmTimer(timing="cost_model", device="cuda", out_dtype=torch.bfloat16, static_scales=True)
    assert gpu.static_slot("forward", emulated) is None
    cpu = GemmTimer(timing="cost_model", device="cpu", out_dtype=torch.float32, static_scales=True)
    assert cpu.static_slot("forward", emulated) is not None  # the CPU's oracle takes it
