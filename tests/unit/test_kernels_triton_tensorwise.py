"""The tensor-wise Triton quantizer (under TRITON_INTERPRET=1) against the reference quantizer:
bit-identical codes and scales, edge values, several blocks, non-finite and all-zero tensors,
and the path ``quantize_operand`` takes for tensor-wise operands."""

import pytest
import torch

from loka_train.kernels import static_scales
from loka_train.kernels import triton_tensorwise as tt
from loka_train.kernels.formats import Fp8Format, Scaling, quantize
from loka_train.kernels.linear import quantize_operand, use_tensorwise_quantizer
from loka_train.kernels.plan import GemmPlan

FMTS = [Fp8Format.E4M3, Fp8Format.E5M2]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_identical_to_the_reference_over_several_blocks(fmt, dtype, monkeypatch):
    monkeypatch.setattr(tt, "_BLOCK", 256)  # 3 programs and a ragged last one, kept small
    monkeypatch.setattr(tt, "_FINAL_BLOCK", 2)  # the finishing loop runs more than once
    g = torch.Generator().manual_seed(0)
    x = (5 * torch.randn(13, 47, generator=g)).to(dtype)
    x[11, 3] = 300.0  # the amax sits in the last block, read in the second finishing chunk
    q, scale = tt.tensorwise_quant(x, fmt=fmt)
    rq, rs = tt.tensorwise_quant_reference(x, fmt=fmt)
    assert q.shape == x.shape and q.dtype == fmt.dtype and scale.shape == ()
    assert torch.equal(scale, rs)
    assert _same(q, rq)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_edge_values_round_like_torch(fmt):
    x = torch.tensor([fmt.max, 124.7, 125.0, 31.4, 0.75 * fmt.min_normal, 1.5 * fmt.min_subnormal,
                      0.49 * fmt.min_subnormal, -31.4, 57.0, 59.0, 61.0, 63.0, 0.0, -0.0])
    q, scale = tt.tensorwise_quant(x, fmt=fmt)
    rq, rs = tt.tensorwise_quant_reference(x, fmt=fmt)
    assert torch.equal(scale, rs) and _same(q, rq)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_gives_a_nan_scale(bad):
    x = torch.randn(9, 33)
    x[4, 5] = bad
    q, scale = tt.tensorwise_quant(x)
    rq, rs = tt.tensorwise_quant_reference(x)
    assert torch.isnan(scale) and torch.isnan(rs)
    # Every dequantized value is NaN through the scale. (The interpreter casts NaN to a finite
    # FP8 code, so the codes themselves are compared on the GPU only.)
    assert torch.isnan(q.float() * scale).all()
    if torch.cuda.is_available():
        assert torch.isnan(q.float()).all() and torch.isnan(rq.float()).all()


def test_all_zero_and_empty_tensors_get_scale_one():
    q, scale = tt.tensorwise_quant(torch.zeros(4, 8))
    assert scale.item() == 1.0 and (q.float() == 0).all()
    q, scale = tt.tensorwise_quant(torch.zeros(0, 8))
    assert scale.item() == 1.0 and q.shape == (0, 8)


def test_refuses_a_transposed_view():
    with pytest.raises(ValueError, match="contiguous"):
        tt.tensorwise_quant(torch.randn(8, 4).t())


def test_quantize_operand_takes_it_for_contiguous_tensorwise_operands():
    plan = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="triton")
    x = torch.randn(16, 24)
    assert use_tensorwise_quantizer(plan, x, plan.fmt)
    assert not use_tensorwise_quantizer(plan, x.t(), plan.fmt)  # the transposing kernel's
    emulated = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="emulated")
    assert not use_tensorwise_quantizer(emulated, x, plan.fmt)  # the oracle keeps the reference
    got = quantize_operand(x, plan.fmt, plan, is_weight=False)
    ref = quantize(x, plan.fmt, Scaling.TENSORWISE)
    assert got.scaling is Scaling.TENSORWISE and got.axis == 1
    assert torch.equal(got.scale, ref.scale) and _same(got.data, ref.data)


def test_opcheck():
    torch.library.opcheck(torch.ops.loka.tensorwise_quant.default, (torch.randn(5, 7), "e4m3"),
                          test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------ both layouts in one pass


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_layouts_are_the_reference_payload_and_its_transpose(fmt, dtype, monkeypatch):
    monkeypatch.setattr(tt, "_TILE_R", 16)  # ragged tiles in both dims
    monkeypatch.setattr(tt, "_TILE_C", 8)
    monkeypatch.setattr(tt, "_BLOCK", 256)
    g = torch.Generator().manual_seed(1)
    x = (5 * torch.randn(37, 21, generator=g)).to(dtype)
    x[30, 19] = -200.0  # the amax sits in a ragged last tile
    q, scale, q_t = tt.tensorwise_quant_both(x, fmt=fmt)
    rq, rs = tt.tensorwise_quant_reference(x, fmt=fmt)
    assert q.shape == (37, 21) and q_t.shape == (21, 37) and q_t.is_contiguous()
    assert torch.equal(scale, rs)
    assert _same(q, rq)
    assert _same(q_t, rq.t().contiguous())


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_an_fp32_input_gets_its_transpose_copied_not_stored_by_the_tile_kernel(static, monkeypatch):
    """fp32 tiles take the one-layout cast and a copy of the payload's transpose (the tile
    kernel's transposed store misplaced codes from fp32 tiles on an H100), rows apart included."""

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the two-layout tile kernel ran on an fp32 input")

    monkeypatch.setattr(tt, "_cast_both_kernel", Refuse())
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(40, 24, generator=g))[:, :20]  # rows 24 apart
    if not static:
        q, scale, q_t = tt.tensorwise_quant_both(x)
        rq, rs = tt.tensorwise_quant_reference(x.contiguous())
        assert torch.equal(scale, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())
        return
    slot = static_scales.new_slots(1, margin=2.0, spread=16.0, device=torch.device("cpu"))[0]
    reference_slot = slot.clone()
    # Seeds the slot; fits; then 100x larger: the gated recast, whose codes the transpose takes.
    for t, recasts in ((x, 0), (x, 0), (100 * x, 1)):
        q, scale, q_t = tt.tensorwise_quant_static(t, slot, both=True)
        rq, rs = static_scales.quantize_static_reference(t.contiguous(), reference_slot, Fp8Format.E4M3)
        assert torch.equal(slot, reference_slot) and slot[static_scales.FALLBACKS] == recasts
        assert torch.equal(scale, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())


def test_both_layouts_of_a_non_finite_tensor_dequantize_to_nan():
    x = torch.randn(9, 33)
    x[2, 7] = float("inf")
    q, scale, q_t = tt.tensorwise_quant_both(x)
    assert torch.isnan(scale)
    assert torch.isnan(q.float() * scale).all() and torch.isnan(q_t.float() * scale).all()


def test_both_layouts_of_an_empty_tensor():
    q, scale, q_t = tt.tensorwise_quant_both(torch.zeros(0, 8))
    assert scale.item() == 1.0 and q.shape == (0, 8) and q_t.shape == (8, 0)


def test_both_layouts_refuse_views_and_other_ranks():
    with pytest.raises(ValueError, match="contiguous"):
        tt.tensorwise_quant_both(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="2-D"):
        tt.tensorwise_quant_both(torch.randn(2, 8, 4))


def test_opcheck_both_layouts():
    torch.library.opcheck(torch.ops.loka.tensorwise_quant_both.default, (torch.randn(5, 7), "e5m2"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
def test_relu_data_with_signed_zeros_is_bit_identical(fmt):
    """Half the values zero (a ReLU'd activation), some of them -0.0: every zero keeps its sign,
    as the reference's division gives it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 65, generator=g).clamp_min(0)
    x[::3, ::2] = -0.0
    for t in (x, x.to(torch.bfloat16)):
        q, scale = tt.tensorwise_quant(t, fmt=fmt)
        rq, rs = tt.tensorwise_quant_reference(t, fmt=fmt)
        assert torch.equal(scale, rs) and _same(q, rq)
        assert (q.view(torch.uint8) == 0x80).any()  # negative zeros kept
        q, scale, q_t = tt.tensorwise_quant_both(t, fmt=fmt)
        assert _same(q, rq) and _same(q_t, rq.t().contiguous())


# ------------------------------------------------------- a folded ReLU's backward in the cast


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_two_layout_casts_apply_a_relu_mask_as_they_read(fmt, dtype, static, monkeypatch):
    """A gradient cast with the mask of a folded ReLU (its pre-activation's bits) is bit for bit
    the cast of the masked gradient, in several tiles a program, with rows apart too; a NaN the
    mask clears is a zero, one it keeps makes the scale NaN."""
    from loka_train.kernels.linear import relu_grad_from_bits, relu_mask_bits

    monkeypatch.setattr(tt, "_TILE_R", 16)
    monkeypatch.setattr(tt, "_TILE_C", 16)
    monkeypatch.setattr(tt, "_BLOCK", 256)
    monkeypatch.setattr(tt, "multiprocessors", lambda device: 1)  # 2 programs: each loops
    g = torch.Generator().manual_seed(4)
    wide = (3 * torch.randn(37, 96, generator=g)).to(dtype)
    pre = torch.randn(37, 48, generator=g).to(torch.bfloat16)
    pre[0, :9] = 0.0  # zeros clear their bit, as threshold_backward zeroes the gradient there
    pre[5, 7] = -0.0
    bits = relu_mask_bits(pre)
    for dy in (wide[:, :48].contiguous(), wide[:, :48]):  # contiguous, and rows apart
        dy = dy.clone() if dy.is_contiguous() else dy
        dy[36, 40] = 500.0 if pre[36, 40] > 0 else -500.0  # the amax: kept or cleared by the mask
        ref_in = relu_grad_from_bits(dy.contiguous(), bits)
        if static:
            slot, ref_slot = (static_scales.new_slots(1, margin=2.0, spread=16.0, device=dy.device)[0]
                              for _ in range(2))
            for t in (1.0, 1.5, 60.0):
                q, scale, q_t = tt.tensorwise_quant_static(dy * t, slot, fmt=fmt, both=True, mask=bits)
                rq, rs = static_scales.quantize_static_reference(ref_in * t, ref_slot, fmt)
                assert torch.equal(scale, rs) and _same(q, rq) and torch.equal(slot, ref_slot)
                assert _same(q_t, rq.t().contiguous())
        else:
            q, scale, q_t = tt.tensorwise_quant_both(dy, fmt=fmt, mask=bits)
            rq, rs = tt.tensorwise_quant_reference(ref_in, fmt=fmt)
            assert torch.equal(scale, rs) and _same(q, rq) and _same(q_t, rq.t().contiguous())
    nan = wide[:, :48].contiguous()
    nan[0, 3] = float("nan")  # under a cleared bit (pre[0, 3] == 0)
    q, scale, _ = tt.tensorwise_quant_both(nan, fmt=fmt, mask=bits)
    assert torch.isfinite(scale) and q.view(torch.uint8)[0, 3] == 0
    nan[1, 3] = float("nan") if pre[1, 3] > 0 else nan[1, 3]
    kept = bool(pre[1, 3] > 0)
    q, scale, _ = tt.tensorwise_quant_both(nan, fmt=fmt, mask=bits)
    assert bool(torch.isnan(scale)) == kept


def test_the_two_layout_casts_refuse_a_mask_of_another_shape_or_kind():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    for bad in (torch.zeros(8, 3, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.int32),
                torch.zeros(2, 8, dtype=torch.uint8).t()):
        with pytest.raises(ValueError, match="mask"):
            tt.tensorwise_quant_both(x, mask=bad)
    slot = static_scales.new_slots(1, margin=2.0, spread=16.0, device=x.device)[0]
    with pytest.raises(ValueError, match="both=True"):
        tt.tensorwise_quant_static(x, slot, mask=torch.zeros(8, 2, dtype=torch.uint8))


def test_opcheck_both_layouts_with_a_mask():
    x = torch.randn(5, 16)
    bits = torch.randint(0, 256, (5, 2), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.loka.tensorwise_quant_both.default, (x, "e5m2", False, bits),
                          test_utils=("test_schema", "test_faketensor"))
