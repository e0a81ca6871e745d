"""The tensor-wise Triton quantizer on the GPU: bit-identical to the reference quantizer at the
training shapes (many blocks), codes included for non-finite tensors, and inside a CUDA graph;
its two-layout pass writes the same payload and its exact transpose."""

import pytest
import torch

from loka_train.kernels.formats import Fp8Format
from loka_train.kernels.triton_tensorwise import (
    tensorwise_quant,
    tensorwise_quant_both,
    tensorwise_quant_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("shape", [(8192, 4096), (32768, 27), (1000, 1000)])
def test_bit_identical_to_the_reference(fmt, shape):
    x = (7 * torch.randn(*shape, device="cuda")).to(torch.bfloat16)
    q, scale = tensorwise_quant(x, fmt=fmt)
    rq, rs = tensorwise_quant_reference(x, fmt=fmt)
    assert torch.equal(scale, rs)
    assert _same(q, rq)


def test_non_finite_codes_and_a_graph_replay():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    tensorwise_quant(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = tensorwise_quant(x)
    x.mul_(3.0)
    graph.replay()
    rq, rs = tensorwise_quant_reference(x)
    assert torch.equal(scale, rs) and _same(q, rq)
    x[17, 3] = float("nan")
    graph.replay()
    assert torch.isnan(scale) and torch.isnan(q.float()).all()


def _near_midpoints(fmt: Fp8Format, s0: float) -> torch.Tensor:
    """fp32 values whose quotients by about ``s0`` lie on and within 3 ulps of every midpoint
    between neighbouring codes of ``fmt`` (both signs), with zeros of both signs, quotients
    too small for any code, and the largest value (``fmt.max * s0``, the tensor's amax)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    codes = codes[torch.isfinite(codes) & (codes > 0)].unique().sort().values
    base = ((codes[1:] + codes[:-1]) / 2 * s0).float()
    xs, up, down = [base], base, base
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        xs += [up, down]
    x = torch.cat(xs)
    extra = torch.tensor([0.0, -0.0, s0 * 2**-25, -s0 * 2**-19, s0 * 2**-21, fmt.max * s0])
    return torch.cat([x, -x, extra.float()])


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("both", [False, True], ids=["one_layout", "both_layouts"])
def test_codes_near_every_midpoint_round_as_the_division_does(fmt, both):
    # Scales that are not powers of two take the casts' multiply-and-FMA quotient: its codes must
    # be the IEEE division's exactly where rounding is closest to going either way (a plain
    # product with the reciprocal gets dozens of these wrong).
    gen = torch.Generator().manual_seed(0)
    for exp in (-40, -17, -6, 0, 5, 30):
        s0 = float(1.0 + torch.rand((), generator=gen)) * 2.0**exp
        x = _near_midpoints(fmt, s0)
        x = torch.cat([x, x.new_zeros((-x.numel()) % 64)]).reshape(-1, 64).cuda()
        if both:
            q, scale, q_t = tensorwise_quant_both(x, fmt=fmt)
        else:
            q, scale = tensorwise_quant(x, fmt=fmt)
        rq, rs = tensorwise_quant_reference(x, fmt=fmt)
        assert torch.equal(scale, rs)
        assert (scale.view(torch.int32) & 0x7FFFFF) != 0  # not a power of two: the FMA path ran
        assert _same(q, rq), f"scale 2**{exp}: {(q.view(torch.uint8) != rq.view(torch.uint8)).sum()} codes differ"
        if both:
            assert _same(q_t, rq.t().contiguous())


def _every_value(dtype: torch.dtype, top_exp: int) -> torch.Tensor:
    """Every finite value of the 16-bit ``dtype`` with magnitude below ``2**top_exp`` (both
    signs, zeros and subnormals included)."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return v[torch.isfinite(v) & (v.float().abs() < 2.0**top_exp)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
def test_the_tile_kernel_casts_every_16bit_value_in_both_layouts(dtype, fmt):
    # The two-layout tile kernel (16-bit inputs) under scales that are not powers of two, on
    # ragged and many-tile shapes and with rows apart: its payload is the reference's and its
    # transposed store holds exactly that payload's transpose.
    gen = torch.Generator().manual_seed(5)
    for top in (15, 9, 2, -6):
        vals = _every_value(dtype, top)
        for cols in (96, 1024):
            n = -(-max(vals.numel(), 64 * cols) // cols) * cols
            x = vals[torch.randint(vals.numel(), (n,), generator=gen)].reshape(-1, cols)
            wide = torch.zeros(x.shape[0], cols + 32, dtype=dtype)
            wide[:, :cols] = x
            for t in (x.cuda(), wide.cuda()[:, :cols]):
                q, scale, q_t = tensorwise_quant_both(t, fmt=fmt)
                rq, rs = tensorwise_quant_reference(t.contiguous(), fmt=fmt)
                assert torch.equal(scale, rs)
                if (scale.view(torch.int32) & 0x7FFFFF).item() == 0:
                    continue  # a power-of-two scale: the product path, covered elsewhere
                assert _same(q, rq), f"2**{top}, {tuple(t.shape)}: payload differs"
                assert _same(q_t, rq.t().contiguous()), f"2**{top}, {tuple(t.shape)}: transpose differs"


@pytest.mark.parametrize("data", ["relu", "tiny"])
def test_relu_and_tiny_tensors_match_the_reference(data):
    x = torch.randn(4096, 1024, device="cuda")
    x = torch.relu(x) if data == "relu" else x * 1e-14  # a scale below 2**-50 divides
    for t in (x, x.to(torch.bfloat16)):
        q, scale, q_t = tensorwise_quant_both(t)
        rq, rs = tensorwise_quant_reference(t)
        assert torch.equal(scale, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("shape", [(8192, 4096), (4096, 2048), (1000, 27)])
def test_both_layouts_are_the_reference_payload_and_its_transpose(fmt, shape):
    x = (7 * torch.randn(*shape, device="cuda")).to(torch.bfloat16)
    q, scale, q_t = tensorwise_quant_both(x, fmt=fmt)
    rq, rs = tensorwise_quant_reference(x, fmt=fmt)
    assert torch.equal(scale, rs)
    assert _same(q, rq)
    assert q_t.is_contiguous() and _same(q_t, rq.t().contiguous())


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
@pytest.mark.parametrize("both", [False, True], ids=["one_layout", "both_layouts"])
def test_static_scales_match_the_reference_through_drift(fmt, both):
    """Seed, fit, a drift up (recast, re-seeded), fit again, a drift down, an all-zero
    tensor: codes, scales and the slot as the PyTorch reference has them, at a training shape."""
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.triton_tensorwise import tensorwise_quant_static

    x = (3 * torch.randn(8192, 2048, device="cuda")).to(torch.bfloat16)
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    ref_slot = slot.clone()
    up, down = (40, 100) if fmt is Fp8Format.E4M3 else (1000, 10**5)  # beyond each format's headroom
    for t in (x, 1.5 * x, up * x, up * x, x / down, 0 * x):
        q, scale, q_t = tensorwise_quant_static(t, slot, fmt=fmt, both=both)
        rq, rs = ss.quantize_static_reference(t, ref_slot, fmt)
        assert torch.equal(scale, rs) and _same(q, rq) and torch.equal(slot, ref_slot)
        if both:
            assert q_t is not None and _same(q_t, q.t().contiguous())
    assert ss.fallbacks(slot) == [2]  # the drift up and the drift down; the first call only seeds


def test_static_scales_replay_in_a_cuda_graph():
    """A captured static-scale quantization reads the slot at replay time: a host update of the
    scale between replays is taken, a drift is recast and counted by the replay itself."""
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.triton_tensorwise import tensorwise_quant_static

    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    tensorwise_quant_static(x, slot, both=True)  # seeds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale, _ = tensorwise_quant_static(x, slot, both=True)
    before = slot.clone()
    graph.replay()
    assert torch.equal(scale, before[ss.SCALE]) and ss.fallbacks(slot) == ss.fallbacks(before)
    ss.set_from_amax(slot, 1000 * float(x.float().abs().amax()), Fp8Format.E4M3)  # far too coarse
    graph.replay()
    assert ss.fallbacks(slot)[0] == ss.fallbacks(before)[0] + 1
    rq, _ = tensorwise_quant_reference(x)
    assert _same(q, rq)  # the recast is the dynamic payload


def test_two_layout_cast_reads_rows_that_lie_apart():
    """A 32768 x 2048 slice of a 32768 x 3072 gradient (Wukong's concatenation) cast as it is:
    the payloads of its contiguous copy, with a dynamic and with a static scale."""
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.triton_tensorwise import tensorwise_quant_static

    wide = (1e-3 * torch.randn(32768, 3072, device="cuda")).to(torch.bfloat16)
    x = wide[:, 512:2560]
    got = tensorwise_quant_both(x, fmt=Fp8Format.E5M2)
    want = tensorwise_quant_both(x.contiguous(), fmt=Fp8Format.E5M2)
    assert _same(got[0], want[0]) and torch.equal(got[1], want[1]) and _same(got[2], want[2])
    slots = [ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0] for _ in range(2)]
    for slot in slots:
        tensorwise_quant_static(x.contiguous(), slot, fmt=Fp8Format.E5M2, both=True)  # seeds
    got = tensorwise_quant_static(x, slots[0], fmt=Fp8Format.E5M2, both=True)
    want = tensorwise_quant_static(x.contiguous(), slots[1], fmt=Fp8Format.E5M2, both=True)
    assert got[2] is not None and want[2] is not None
    assert _same(got[0], want[0]) and torch.equal(got[1], want[1]) and _same(got[2], want[2])
    assert torch.equal(slots[0], slots[1])


def test_an_emulated_static_operand_in_a_graph_capture_takes_its_dynamic_scale(monkeypatch):
    """The reference static path decides on the host: inside a CUDA graph capture the operand
    takes its dynamic scale instead, counted, and the capture succeeds."""
    import collections

    from loka_train.kernels import linear as kl
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.formats import Scaling
    from loka_train.kernels.plan import GemmPlan

    monkeypatch.setattr(kl, "_REFERENCE_FALLBACKS", collections.Counter())
    plan = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="emulated")
    x = torch.randn(256, 128, device="cuda")
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    kl.quantize_operand(x, plan.fmt, plan, is_weight=False, static=slot, count_fallbacks=True)  # seeds
    assert float(slot[ss.SCALE]) > 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = kl.quantize_operand(x, plan.fmt, plan, is_weight=False, static=slot, count_fallbacks=True)
    graph.replay()
    rq, rs = tensorwise_quant_reference(x)
    assert torch.equal(q.scale, rs) and _same(q.data, rq)
    assert any("CUDA graph capture" in k for k in kl.reference_fallbacks())


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=lambda f: f.value)
def test_a_relu_folded_into_the_static_two_layout_cast_is_the_cast_of_the_relu(fmt):
    """At a training shape, through a seed, a fit and a recast: the codes, transpose, scale and
    slot of relu(x) (mods.fold_relu), as the reference has them."""
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.triton_tensorwise import tensorwise_quant_static

    x = (3 * torch.randn(8192, 2048, device="cuda")).to(torch.bfloat16)
    x[0, :3] = torch.tensor([-0.0, 0.0, float("-inf")])  # -inf: ReLU drops it
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    ref_slot = slot.clone()
    up = 40 if fmt is Fp8Format.E4M3 else 1000
    for t in (x, 1.5 * x, up * x):
        q, scale, q_t = tensorwise_quant_static(t, slot, fmt=fmt, both=True, relu=True)
        rq, rs = ss.quantize_static_reference(torch.relu(t), ref_slot, fmt)
        assert torch.equal(scale, rs) and _same(q, rq) and torch.equal(slot, ref_slot)
        assert q_t is not None and _same(q_t, rq.t().contiguous())
    assert ss.fallbacks(slot) == [1]


@pytest.mark.parametrize("mask_bits", [False, True], ids=["pre-activation", "bits"])
def test_a_folded_relu_trains_like_the_relu_module_compiled(mask_bits):
    """fp8_linear(x, input_relu=True) against fp8_linear(relu(x)) under torch.compile (inductor)
    on torch_scaled_mm: output and gradients bit for bit, static scales on, the ReLU's mask kept
    as the pre-activation or as bits (mods.relu_mask_bits)."""
    from loka_train.kernels import static_scales as ss
    from loka_train.kernels.formats import Scaling
    from loka_train.kernels.linear import fp8_linear
    from loka_train.kernels.plan import LinearPlan

    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
    torch.manual_seed(0)
    w0 = torch.randn(1024, 2048, device="cuda") / 45
    x0 = torch.randn(4096, 2048, device="cuda")
    g = torch.randn(4096, 1024, device="cuda")
    outs = []
    for folded in (True, False):
        torch._dynamo.reset()
        slots = ss.new_slots(2, margin=2.0, spread=16.0, device=x0.device)

        def f(x, w, folded=folded, slots=slots):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if folded:
                    return fp8_linear(x, w, None, plan, static_slots=slots, input_relu=True, mask_bits=mask_bits)
                return fp8_linear(torch.relu(x), w, None, plan, static_slots=slots)

        fn = torch.compile(f)
        got = []
        for s in (1.0, 1.5, 40.0):  # seed, fit, recast
            x, w = (s * x0).requires_grad_(), w0.clone().requires_grad_()
            y = fn(x, w)
            y.backward(g)
            got += [y.detach(), x.grad, w.grad]
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _mlp():
    """A Sequential MLP and a TorchRec OverArch (Perceptrons) on the GPU."""
    from torch import nn
    from torchrec.models.dlrm import OverArch

    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                         OverArch(in_features=512, layer_sizes=[1024, 512, 1])).cuda()


def _folded_mlp(fold: bool, state: dict):
    """:func:`_mlp` with the weights of `state`, converted with or without mods.fold_relu, every
    site on tensor-wise FP8 with static scales on torch_scaled_mm."""
    from loka_train.kernels.formats import Scaling
    from loka_train.kernels.plan import LinearPlan
    from loka_train.mods import ModsConfig, convert, sites

    model = _mlp()
    model.load_state_dict(state)
    convert(model, config=ModsConfig(sites=["mlp"], fold_relu=fold, static_scales=True))
    plan = LinearPlan.fp8(scaling=Scaling.TENSORWISE, backend="torch_scaled_mm")
    for site in sites(model).values():
        site.set_plan(plan)
        site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cuda"))
    assert any(s.input_relu for s in sites(model).values()) == fold
    return model


def _compiled_sgd_losses(model, steps, before_step=lambda step: None):
    """The losses of compiled SGD steps of `model` under bf16 autocast, one seeded batch a step,
    ``before_step(step)`` called before each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    fn = torch.compile(step)
    got = []
    for i in steps:
        before_step(i)
        x = torch.randn(4096, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        opt.zero_grad()
        loss = fn(x)
        loss.backward()
        opt.step()
        got.append(loss.detach().float())
    return torch.stack(got)


def test_a_folded_mlp_trains_like_the_unfolded_one_compiled():
    """A TorchRec OverArch (Perceptrons) and a Sequential MLP converted with and without
    mods.fold_relu, tensor-wise FP8 with static scales on torch_scaled_mm, compiled under bf16
    autocast: the same losses, bit for bit, over three SGD steps."""
    torch.manual_seed(0)
    base = _mlp().state_dict()
    losses = []
    for fold in (True, False):
        torch._dynamo.reset()
        losses.append(_compiled_sgd_losses(_folded_mlp(fold, base), range(3)))
    assert torch.equal(losses[0], losses[1]), losses


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
def test_a_folded_mlp_trains_alike_on_the_probes_sampled_steps_compiled(fold):
    """The MLP of the test above, the Probe attached and sampling every step (its taps in the
    compiled code, ``mods.probe_tap``) against the same steps unsampled: the taps are copies, so
    the losses and weights agree (to the rounding of inductor's different fusions around them)."""
    from loka_train.mods import mark_sampled, sites
    from loka_train.probe import Probe, ProbeConfig

    torch.manual_seed(0)
    base = _mlp().state_dict()
    runs = []
    for sampled in (True, False):
        torch._dynamo.reset()
        model = _folded_mlp(fold, base)
        probe = Probe(ProbeConfig(every_k_steps=1 if sampled else 1000, sites_per_step=None, window=4,
                                  interval=50, min_samples=1), device="cuda")
        for name, site in sites(model).items():
            probe.register_site(name, **site.probe_spec())
            site.attach_observer(probe)

        def sample(step, model=model, probe=probe, sampled=sampled):
            probe.begin_step(step)
            assert bool(mark_sampled(sites(model).values(), step)) == sampled

        got = _compiled_sgd_losses(model, range(1, 4), sample)
        runs.append((got, [p.detach().float().clone() for p in model.parameters()]))
    (l_s, p_s), (l_u, p_u) = runs
    diffs = [float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(p_s, p_u)]
    print(f"fold={fold} losses sampled {l_s.tolist()} unsampled {l_u.tolist()} param rel diffs {diffs}")
    torch.testing.assert_close(l_s, l_u, rtol=1e-3, atol=0)
    assert max(diffs) < 1e-3, diffs
