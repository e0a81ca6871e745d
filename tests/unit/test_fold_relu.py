"""A ReLU folded into the next site's FP8 cast (``mods.fold_relu``): the Triton tensor-wise casts
(under TRITON_INTERPRET=1) quantize ``relu(x)`` bit for bit as the reference quantizes it;
``fp8_linear(x, input_relu=True)`` is ``fp8_linear(relu(x))`` in its output and gradients, eagerly
and compiled; ``convert`` folds the ReLUs of ``nn.Sequential`` MLPs and TorchRec Perceptrons, and
a folded model trains like the unfolded one; the Probe sees the ReLU's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_train.kernels import static_scales as ss
from loka_train.kernels import triton_tensorwise as tt
from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.linear import folds_input_relu, fp8_linear
from loka_train.kernels.plan import GemmPlan, LinearPlan
from loka_train.mods import FoldedRelu, Fp8Linear, ModsConfig, convert, sites

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _relu(x: torch.Tensor) -> torch.Tensor:
    """``torch.relu`` as CUDA computes it (``-0.0`` to ``0.0``; the CPU's keeps ``-0.0``)."""
    return torch.relu(x) + 0.0


def _data(seed: int = 0, shape: tuple[int, int] = (37, 70)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    x[1, 2], x[3, 4], x[5, 6] = -0.0, 0.0, -300.0  # signed zeros; a negative amax ReLU drops
    return x


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_every_tensorwise_cast_quantizes_the_relu_of_its_input(fmt, monkeypatch):
    monkeypatch.setattr(tt, "_BLOCK", 512)  # several programs, a ragged last one
    monkeypatch.setattr(tt, "_TILE_R", 16)
    x = _data()
    rq, rs = tt.tensorwise_quant_reference(_relu(x), fmt=fmt)
    q, s = tt.tensorwise_quant(x, fmt=fmt, relu=True)
    assert torch.equal(s, rs) and _same(q, rq)
    q, s, q_t = tt.tensorwise_quant_both(x, fmt=fmt, relu=True)
    assert torch.equal(s, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())
    apart = torch.cat([x, x], dim=1)[:, :70]  # rows apart: the two-layout cast reads them as they are
    q, s, q_t = tt.tensorwise_quant_both(apart, fmt=fmt, relu=True)
    assert torch.equal(s, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())
    for both in (False, True):
        slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
        ref_slot = slot.clone()
        up = 80 if fmt is Fp8Format.E4M3 else 10**4  # beyond each format's headroom
        for t in (x, 1.5 * x, up * x, x):  # seed, fit, recast, recast back
            q, s, q_t = tt.tensorwise_quant_static(t, slot, fmt=fmt, both=both, relu=True)
            rq, rs = ss.quantize_static_reference(_relu(t), ref_slot, fmt)
            assert torch.equal(s, rs) and _same(q, rq) and torch.equal(slot, ref_slot)
            assert q_t is None or _same(q_t, rq.t().contiguous())
        assert ss.fallbacks(slot) == [2]


def test_the_relu_keeps_nan_as_torch_relu_does():
    x = _data()
    x[7, 8] = float("nan")
    q, s = tt.tensorwise_quant(x, relu=True)
    rq, rs = tt.tensorwise_quant_reference(_relu(x))
    assert torch.isnan(s) and torch.isnan(rs)
    # Every dequantized value is NaN through the scale (the interpreter casts NaN to a finite
    # FP8 code: the codes themselves are compared on the GPU only).
    assert torch.isnan(q.float() * s).all()
    if torch.cuda.is_available():
        assert _same(q, rq)


def test_opcheck_with_relu():
    x = _data().float()
    torch.library.opcheck(torch.ops.loka.tensorwise_quant.default, (x, "e4m3", True))
    torch.library.opcheck(torch.ops.loka.tensorwise_quant_both.default, (x, "e4m3", True))
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    torch.library.opcheck(torch.ops.loka.tensorwise_quant_static.default, (x, slot, "e4m3", True, True),
                          test_utils=("test_schema", "test_faketensor"))


TW = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="triton")
MIXED = LinearPlan(
    forward=GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="triton"),
    grad_input=GemmPlan(),  # high precision
    grad_weight=GemmPlan(),
)


def test_it_folds_only_where_the_triton_tensorwise_cast_takes_x(monkeypatch):
    x = torch.randn(8, 32)
    assert folds_input_relu(TW, x) and folds_input_relu(MIXED, x)
    assert not folds_input_relu(LinearPlan.high_precision(), x)
    assert not folds_input_relu(LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton"), x)
    assert not folds_input_relu(LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="emulated"), x)
    assert not folds_input_relu(TW, x.t())  # a transposed view: the transposing quantizer's
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as traced code sees it
    assert folds_input_relu(TW, x, "custom") and not folds_input_relu(TW, x, "inductor")


@pytest.mark.parametrize("plan", [TW, MIXED, LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton")],
                         ids=["tensorwise", "fp8_forward_only", "rowwise_unfolded"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_input_relu_is_the_linear_of_the_relu(plan, static, compiled):
    """Output, all three gradients and the slots' updates, bit for bit, over a seed, a fit and
    a recast; compiled through the opaque op (aot_eager) too."""
    w0, b0 = torch.randn(24, 48), torch.randn(24)
    xs = [4 * torch.randn(3, 20, 48) * s for s in (1.0, 1.5, 60.0)]  # N-D: folded to rows
    xs[0][0, 0, :5] = torch.tensor([-0.0, 0.0, -1.0, 2.0, -3.0])
    g = torch.randn(3, 20, 24)

    def run(folded: bool):  # type: ignore[no-untyped-def]
        slots = ss.new_slots(2, margin=2.0, spread=16.0, device=torch.device("cpu")) if static else None

        def f(x, w, b):  # type: ignore[no-untyped-def]
            if folded:
                return fp8_linear(x, w, b, plan, static_slots=slots, input_relu=True)
            return fp8_linear(torch.relu(x), w, b, plan, static_slots=slots)

        torch._dynamo.reset()  # the same code object compiles for every parametrization
        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        outs = []
        for x in xs:
            xr, w, b = x.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
            y = fn(xr, w, b)
            y.backward(g)
            outs += [y.detach(), xr.grad, w.grad, b.grad]
        return outs, slots

    got, got_slots = run(True)
    want, want_slots = run(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if static:
        assert torch.equal(got_slots, want_slots)



def _record_masks_in_casts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``quantize_with_transpose`` call from now on casts with a mask."""
    from loka_train.kernels import linear

    calls: list[bool] = []
    quantize = linear.quantize_with_transpose

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("mask") is not None)
        return quantize(*args, **kwargs)

    monkeypatch.setattr(linear, "quantize_with_transpose", spy)
    return calls


@pytest.mark.parametrize("producer", [TW, MIXED, LinearPlan.fp8(scaling=Scaling.ROWWISE, backend="triton"),
                                      LinearPlan.high_precision()],
                         ids=["tensorwise", "fp8_forward_only", "rowwise", "high"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_producer_applies_a_folded_relus_backward(producer, static, compiled, monkeypatch):
    """``fp8_linear(x, output_relu=True)`` then ``fp8_linear(y, input_relu=True,
    input_relu_grad=False)`` is the two layers with a ReLU between: output and every gradient bit
    for bit, over a seed, a fit and a recast, eagerly and through the opaque op (aot_eager). The
    producer's mask goes into its dY cast where both its backward GEMMs are tensor-wise (the
    first plan), before its GEMMs elsewhere."""
    masks_in_casts = _record_masks_in_casts(monkeypatch)
    w0, b0 = torch.randn(24, 48), torch.randn(24)
    w1, b1 = torch.randn(16, 24), torch.randn(16)
    xs = [torch.randn(3, 20, 48) * s for s in (1.0, 1.5, 60.0)]
    g = torch.randn(3, 20, 16)

    def run(folded: bool):  # type: ignore[no-untyped-def]
        slots = [ss.new_slots(2, margin=2.0, spread=16.0, device=torch.device("cpu")) if static else None
                 for _ in range(2)]

        def f(x, wa, ba, wb, bb):  # type: ignore[no-untyped-def]
            if folded:
                h = fp8_linear(x, wa, ba, producer, static_slots=slots[0], output_relu=True)
                return fp8_linear(h, wb, bb, TW, static_slots=slots[1], input_relu=True, input_relu_grad=False)
            h = fp8_linear(x, wa, ba, producer, static_slots=slots[0])
            return fp8_linear(torch.relu(h), wb, bb, TW, static_slots=slots[1])

        torch._dynamo.reset()
        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        outs = []
        for x in xs:
            params = [t.clone().requires_grad_() for t in (x, w0, b0, w1, b1)]
            y = fn(*params)
            y.backward(g)
            outs += [y.detach(), *(t.grad for t in params)]
        return outs, slots

    got, got_slots = run(True)
    assert any(masks_in_casts) == (producer is TW)
    want, want_slots = run(False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    if static:
        assert all(torch.equal(a, b) for a, b in zip(got_slots, want_slots, strict=True))


def test_output_relu_needs_n_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        fp8_linear(torch.randn(4, 8), torch.randn(12, 8), None, TW, output_relu=True)

def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))


def test_convert_folds_the_relus_of_sequentials_and_perceptrons():
    from torchrec.models.dlrm import OverArch

    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": _mlp(), "over": OverArch(in_features=16, layer_sizes=[32, 24, 1])})
    convert(model, config=ModsConfig(sites=["mlp"], keep_last_layer_high=True))
    found = sites(model)
    assert isinstance(model["mlp"][1], FoldedRelu) and isinstance(model["mlp"][3], FoldedRelu)
    assert found["mlp.2"].input_relu and found["mlp.4"].input_relu and not found["mlp.0"].input_relu
    perceptrons = model["over"].model[0]._mlp
    assert isinstance(perceptrons[0]._activation_fn, FoldedRelu)
    assert perceptrons[1]._activation_fn is torch.relu  # feeds the logit layer, which is no site
    assert found["over.model.0._mlp.1._linear"].input_relu
    assert sorted(model.loka_mods_report.folded_relus) == [
        "mlp.2", "mlp.4", "over.model.0._mlp.1._linear"]
    off = nn.ModuleDict({"mlp": _mlp()})
    convert(off, config=ModsConfig(sites=["mlp"], fold_relu=False))
    assert isinstance(off["mlp"][1], nn.ReLU) and not any(s.input_relu for s in sites(off).values())


@pytest.mark.parametrize("plan", [LinearPlan.high_precision(), TW], ids=["high", "tensorwise"])
def test_a_folded_model_trains_like_the_unfolded_one(plan):
    """Same outputs, gradients and parameters after two SGD steps, bit for bit."""
    torch.manual_seed(0)
    base = _mlp()
    models = []
    for fold in (True, False):
        m = _mlp()
        m.load_state_dict(base.state_dict())
        convert(m, config=ModsConfig(sites=["mlp"], fold_relu=fold, keep_last_layer_high=False))
        for site in sites(m).values():
            site.set_plan(plan)
        models.append(m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(step))
        outs = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            y = m(x)
            y.square().mean().backward()
            opt.step()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1])
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)



@pytest.mark.parametrize("plan", [TW, MIXED, LinearPlan.high_precision()], ids=["tensorwise", "fp8_forward_only", "high"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_over_arch_whose_sites_apply_the_next_relus_backward_trains_like_the_unfolded_one(plan, compiled,
                                                                                            monkeypatch):
    """``mods.fold_relu_grad``: in a TorchRec OverArch the first site applies the folded ReLU's
    backward. Over a sampled step (the Probe's taps on the sites: a ReLU on the first site's
    output) and an unsampled one (the mask in its op), outputs, gradients and what the Probe
    saw are the unfolded model's, bit for bit."""
    from torchrec.models.dlrm import OverArch

    from loka_train.mods import mark_sampled
    from loka_train.probe import Probe, ProbeConfig

    masks_in_casts = _record_masks_in_casts(monkeypatch)
    torch.manual_seed(0)
    base = OverArch(in_features=64, layer_sizes=[48, 32, 24, 1]).state_dict()
    got, probes = [], []
    for fold in (True, False):
        m = OverArch(in_features=64, layer_sizes=[48, 32, 24, 1])
        m.load_state_dict(base)
        convert(m, config=ModsConfig(sites=["mlp"], fold_relu=fold, fold_relu_grad=fold))
        found = sites(m)
        # The middle site is both: it applies the first ReLU and the backward of the second.
        assert [found[f"model.0._mlp.{i}._linear"].output_relu for i in range(3)] == [fold, fold, False]
        assert [found[f"model.0._mlp.{i}._linear"].input_relu_grad for i in range(3)] == [True, not fold, not fold]
        probe = Probe(ProbeConfig(every_k_steps=2, sites_per_step=None, window=4, interval=50, min_samples=1))
        for name, site in found.items():
            site.set_plan(plan)
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)
        torch._dynamo.reset()
        if compiled:
            m.compile(backend="aot_eager")
        outs = []
        masks_in_casts.clear()
        for step in range(2):  # step 0 sampled, step 1 not
            probe.begin_step(step)
            mark_sampled(found.values(), step)
            x = torch.randn(40, 64, generator=torch.Generator().manual_seed(step))
            y = m(x)
            y.square().mean().backward()
            outs += [y.detach()] + [p.grad.clone() for p in m.parameters()]
            m.zero_grad()
        # The middle site's x needs its gradient: with tensor-wise plans its dY cast takes the mask.
        assert any(masks_in_casts) == (fold and plan is TW)
        probe.reduce()
        got.append(outs)
        probes.append(probe)
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    for site in ("model.0._mlp.0._linear", "model.0._mlp.1._linear"):  # the producers' dY: masked in both
        for role in ("forward", "grad_input", "grad_weight"):
            seen = [p.window_stats(site, role) for p in probes]
            assert bool(seen[0]["valid"].any())
            for key in seen[0]:
                assert torch.equal(seen[0][key], seen[1][key]), (site, role, key)


def test_fold_relu_grad_leaves_a_pair_alone_where_the_producer_cannot_keep_bits(caplog):
    import logging

    from torchrec.models.dlrm import OverArch

    m = OverArch(in_features=64, layer_sizes=[44, 32, 1])  # 44 is not a multiple of 8
    with caplog.at_level(logging.INFO, logger="loka_train.mods.convert"):
        convert(m, config=ModsConfig(sites=["mlp"], fold_relu_grad=True))
    first, second = sites(m)["model.0._mlp.0._linear"], sites(m)["model.0._mlp.1._linear"]
    assert second.input_relu and second.input_relu_grad and not first.output_relu  # the consumer masks
    assert "model.0._mlp.1._linear applies its folded ReLU's backward itself" in caplog.text
    assert "44 wide, not a multiple of 8" in caplog.text
    with pytest.raises(ValueError, match="fold_relu_grad"):
        ModsConfig(fold_relu=False, fold_relu_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_relu_bits_are_relu_mask_bits_on_special_values(dtype, monkeypatch):
    monkeypatch.setattr(tt, "_BITS_BLOCK", 4)  # several programs
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"),
                             info.tiny / 4, -info.tiny / 4, info.tiny, info.max, -info.max, 1.0, -1.0,
                             info.smallest_normal / 2, 3.0, -3.0], dtype=torch.float32).to(dtype)
    y = torch.cat([specials, torch.randn(16 * 7, dtype=torch.float32).to(dtype)]).reshape(8, 16)
    from loka_train.kernels.linear import relu_mask_bits

    assert torch.equal(tt.relu_bits(y), relu_mask_bits(y))
    with pytest.raises(ValueError, match="multiple of 8"):
        tt.relu_bits(torch.randn(4, 12))

def test_the_probe_sees_the_relu_output_as_the_folded_site_input():
    seen: dict[str, torch.Tensor] = {}

    class Spy:
        def observe(self, name, role, a, b):  # type: ignore[no-untyped-def]
            seen[role] = a

    lin = nn.Linear(16, 8)
    site = Fp8Linear.from_linear(lin, plan=TW)
    site.input_relu = True
    site.site_name = "s"
    site.observer = Spy()  # type: ignore[assignment]
    site.sampling = True
    x = torch.randn(12, 16, requires_grad=True)
    site(x).sum().backward()
    assert torch.equal(seen["forward"], torch.relu(x.detach()))
    assert (seen["forward"] >= 0).all() and "grad_weight" in seen


def test_rows_that_come_out_transposed_take_the_relu_first():
    """An N-D input whose rows are a transposed view: the cast cannot read them, so the ReLU is
    computed first (the fold is decided on the rows the Function casts): the same output and
    gradients. (A padded call: tests/unit/test_mods_sites.py.)"""
    torch.manual_seed(0)
    w0 = torch.randn(24, 40)
    x0 = torch.randn(40, 5, 6).permute(1, 2, 0)
    outs = []
    for folded in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_linear(x, w, None, TW, input_relu=True) if folded else fp8_linear(torch.relu(x), w, None, TW)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_module_held_twice_is_not_folded():
    from loka_train.mods import fold_relus

    torch.manual_seed(0)
    site = Fp8Linear.from_linear(nn.Linear(16, 16))
    model = nn.Sequential(nn.ReLU(), site, nn.Tanh(), site)  # the second use follows no ReLU
    x = torch.randn(8, 16)
    want = model(x)
    assert fold_relus(model) == [] and isinstance(model[0], nn.ReLU) and not site.input_relu
    assert torch.equal(model(x), want)

    class Custom(nn.Sequential):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return self[2](self[1](self[0](x))) + self[0](x)

    custom = Custom(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    convert(custom, config=ModsConfig(sites=["mlp"], keep_last_layer_high=False))
    assert isinstance(custom[1], nn.ReLU)  # a forward of its own may use the ReLU's input




@pytest.fixture
def one_rank_group():  # type: ignore[no-untyped-def]
    from tests.unit._process_group import one_rank_group as group

    with group():
        yield


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("bits", [False, True], ids=["x_kept", "mask_bits"])
def test_a_folded_over_arch_in_ddp_trains_like_the_unfolded_one_on_a_sampled_step_compiled(bits):
    """A TorchRec OverArch under DDP (default buckets), compiled, on a step the Probe samples
    (its taps in the compiled code): dynamo's DDP optimizer splits the graph where the first
    bucket fills, which here is between the folded ReLU's mask and the site that casts
    ``relu(x)``. The outputs and gradients are still the unfolded model's, bit for bit: the mask
    travels inside the site's opaque op. A mask applied by an autograd Function of its own
    before the op was lost there (the split graph's output, a view the compiled code recreated
    outside autograd), and the first layer's gradients came out unmasked."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.models.dlrm import OverArch

    from loka_train.mods import mark_sampled
    from loka_train.probe import Probe, ProbeConfig

    assert folds_input_relu(TW, torch.empty(40, 512))  # the cast applies the ReLU: a real fold

    def counted(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    base = OverArch(in_features=1024, layer_sizes=[512, 256, 1]).state_dict()
    got = []
    for fold in (True, False):
        m = OverArch(in_features=1024, layer_sizes=[512, 256, 1])
        m.load_state_dict(base)
        convert(m, config=ModsConfig(sites=["mlp"], fold_relu=fold, relu_mask_bits=bits))
        probe = Probe(ProbeConfig(every_k_steps=1, sites_per_step=None, window=4, interval=50, min_samples=1))
        for name, site in sites(m).items():
            site.set_plan(TW)
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)
        assert sites(m)["model.0._mlp.1._linear"].input_relu is fold
        probe.begin_step(0)
        mark_sampled(sites(m).values(), 0)
        torch._dynamo.reset()
        ddp = DistributedDataParallel(m)
        graphs: list[object] = []
        m.compile(backend=counted)
        x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(1))
        y = ddp(x)
        y.square().mean().backward()
        assert len(graphs) >= 2, "DDP's buckets no longer split the compiled forward: the test shows nothing"
        got.append([y.detach()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
