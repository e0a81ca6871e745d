"""Configuration of the model adaptations (the ``loka.mods`` group of the hydra config).

Example:
    >>> cfg = ModsConfig(sites=["mlp", "dcn"], initial_plan="fp8_rowwise")
    >>> cfg.pad_to_multiple
    16
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.kernels.settings import COMPILED_QUANTIZERS

__all__ = ["SITE_FAMILIES", "INITIAL_PLANS", "ModsConfig"]

SITE_FAMILIES: tuple[str, ...] = ("mlp", "interaction", "dcn", "wukong")
"""Site families ``convert`` knows: ``mlp`` (every ``nn.Linear`` outside an interaction block:
bottom/top MLPs), ``interaction`` (DLRM dot interaction ``bmm``), ``dcn`` (TorchRec
``LowRankCrossNet`` layers), ``wukong`` (FM block projection, ``bmm`` and MLP, LCB, residual)."""

INITIAL_PLANS: tuple[str, ...] = ("high", "fp8_rowwise", "fp8_tensorwise")
"""Plans a site can start with (Dispatch changes them later)."""


def _default_sites() -> list[str]:
    return list(SITE_FAMILIES)


@dataclass(kw_only=True)
class ModsConfig:
    """Which dense GEMMs ``convert`` turns into FP8-capable sites, and which adaptations it uses.

    Example:
        >>> ModsConfig(horizontal_fusion=False).initial_linear_plan().forward.is_fp8
        False
    """

    enabled: bool = True
    """Whether ``convert`` changes the model at all (False: it logs and returns it unchanged)."""

    sites: list[str] = field(default_factory=_default_sites)
    """Site families to convert, a subset of ``SITE_FAMILIES``."""

    keep_last_layer_high: bool = True
    """Leave the final logit ``nn.Linear`` (the last one registered in the model) unconverted:
    it always runs in high precision and is not a site."""

    pad_to_multiple: int = 16
    """Zero-pad the dims of every FP8 GEMM to a multiple of this (FP8 tensor cores and
    ``torch._scaled_mm`` need 16); 0 or 1 turns padding off. High-precision GEMMs are never
    padded."""

    fused_norm_quant: bool = True
    """LayerNorm -> Linear -> ReLU runs as one fused op (``kernels.fused.layernorm_linear``):
    with a row-wise FP8 forward on the ``triton``, ``torch_scaled_mm`` or ``fbgemm_rowwise``
    backend the LayerNorm kernel emits the GEMM's FP8 input and scales directly (no separate
    quantization pass), ReLU's backward emits the grad-input GEMM's, LayerNorm's backward is
    one Triton kernel, and a tensor-wise FP8 grad-weight GEMM takes its transposed operands
    from ``kernels.triton_block.transposed_quant`` (H100, graph-replayed block: 1.25x bf16 at
    8192x1024x1024, 1.50x at 8192x4096x4096;
    bench/results/gemm_block_h100_2026-11-23c/NOTES.md). A forward plan the LayerNorm kernel
    does not quantize (tensor-wise) runs LayerNorm, the Linear and the activation as separate
    modules instead."""

    fold_relu: bool = True
    """A ReLU between two layers, where the second is a converted linear site (``nn.ReLU`` then a
    Linear in an ``nn.Sequential``; TorchRec ``Perceptron`` activations ``torch.relu`` before
    another Perceptron), is applied by that site instead (:class:`~loka_train.mods.site.FoldedRelu`
    takes its place): where the site's FP8 forward takes the Triton tensor-wise cast, the cast
    applies it as it reads the pre-activation, so no pass writes the ReLU's output (a full read
    and write of the activation a step); elsewhere the site computes ``torch.relu`` first. Wukong's
    FM block keeps the ReLU in its fused LayerNorm op where that op runs (``fused_norm_quant``
    with a row-wise FP8 forward). The module that held the ReLU then returns its
    pre-activation; the model's output, its gradients and the state dict are unchanged. Where
    the site's grad-weight does not take the forward's transposed FP8 payload over, its backward
    recomputes the ReLU (one pass), which Dispatch charges to the plan."""

    relu_mask_bits: bool = True
    """Where a folded ReLU feeds a site whose grad-weight takes the forward's tensor-wise FP8
    input over (its own copy of the ReLU's output), keep the ReLU's mask for the backward as one
    bit an element instead of the bf16 pre-activation (``kernels.linear.relu_mask_bits``: the
    same gradients, bit for bit; the input's width a multiple of 8). Without it such a site keeps
    its input twice, 3 bytes an element where a plain Linear after a ReLU keeps 2 (``python -m
    bench.saved_bytes``); with the bits, 1.125 (a site the Probe samples on a step also keeps
    its observed input until the backward). The bits cost a pass over the pre-activation in the
    forward (plain torch ops that inductor fuses; the cast does not write them, and Dispatch
    does not charge them); the backward reads them, an eighth of a byte an element, in place
    of the pre-activation's two bytes. ``false`` keeps the pre-activation (``bench.e2e``'s
    ``+nobits``)."""

    fold_relu_grad: bool = False
    """With ``fold_relu``, where the folded ReLU sits between two TorchRec ``Perceptron`` s whose
    Linears are both sites (an MLP's hidden layers), the first site applies the ReLU's backward
    instead of the second: it keeps its output's sign as bits (one pass over its output, instead of
    the second site's pass over its input) and masks the gradient it receives in its two-layout
    FP8 cast of ``dY`` where both its backward GEMMs are tensor-wise, so that in compiled code no
    pass writes the masked gradient (the bias gradient's sum reads the bits too;
    ``kernels.fp8_linear``'s ``output_relu``); elsewhere it masks first, and on
    sampled steps, or without an FP8 plan, it runs the ReLU itself. The same gradients, bit for
    bit. Dispatch and the ledger do not count the pass it saves or the bits it writes; off by
    default: its bits pass and masked casts cost more than it saves on Wukong
    (``docs/performance.md``; ``bench.e2e``'s ``+foldgrad``). Needs the first Linear's width a
    multiple of 8."""

    drop_unstable_bias: bool = False
    """Drop the bias of converted Linear sites (the final logit layer keeps its bias). A bias
    feeds a DC offset into the next GEMM's FP8 input, so its per-row amax, and with it the
    quantization step, is set by the bias instead of the signal. The bias ``Parameter`` stays
    registered (state dict, optimizer and checkpoints do not change shape) but is zeroed and
    frozen, so the model computes what its state says."""

    horizontal_fusion: bool = True
    """GEMMs that read the same input run as one wider GEMM site: the Wukong FM projection,
    LCB mix and residual projection (all read ``X^T``). Faster also in high precision (one
    GEMM instead of three: 1.12x on the H100 Wukong tower, ``bench/mods.py``), but not
    bit-identical: the gradient of ``X`` is one GEMM's fp32 sum instead of three results
    rounded to the compute dtype and then added, so it differs by reassociation (~1e-7
    relative in fp32, ~1e-3 under bf16 autocast). False keeps the original op sequence."""

    dcn_epilogue_fusion: bool = True
    """DCN cross layer ``x0 * (W (V x) + b) + x``: the bias is added in the second GEMM's
    epilogue and ``x0 * z + x`` is one ``addcmul`` (one elementwise kernel instead of three)."""

    dcn_tail_in_gemm: bool = False
    """With ``dcn_epilogue_fusion``, a cross layer whose ``W`` forward runs tensor-wise FP8 on a
    GPU computes ``x0 * z + x`` (and the bf16 copy the next layer's ``V`` reads, which the net
    returns after its last layer) in that GEMM's epilogue (``kernels.triton_cross``): ``z`` is
    written for the backward and never read back. Where the call does not allow it
    (``kernels.linear.takes_cross_tail``, logged once) or on a sampled step, the ``addcmul`` runs.
    Off by default: its speed and paired NE are not yet measured on this form
    (``docs/performance.md``)."""

    initial_plan: str = "high"
    """Plan every site starts with: ``high`` (no numerics change, but see
    ``horizontal_fusion``), ``fp8_rowwise`` or
    ``fp8_tensorwise`` (e4m3 forward, e5m2 gradients, on ``backend``)."""

    backend: str = "emulated"
    """GEMM backend of the initial FP8 plan (a name in ``kernels.registry``). Batched
    (``bmm``) sites run FP8 only on ``emulated``; with another backend they start in high
    precision (logged)."""

    compiled_quantizer: str = "custom"
    """What quantizes the sites' FP8 operands in code that ``torch.compile`` traces: ``custom``
    (the FP8 Functions as opaque custom ops with the Triton quantizers inside) or ``inductor``
    (traced, plain torch ops for inductor to fuse; measured slower). See
    ``kernels.settings.KernelSettings.compiled_quantizer``; the environment variable
    ``LOKA_COMPILED_QUANTIZER`` overrides it when ``convert`` runs."""

    static_scales: bool = False
    """Tensor-wise FP8 ``x`` and ``dY`` of linear sites take static scales
    (``kernels.static_scales``): one read of the operand instead of two, the scale from the
    Probe's window amax with ``static_scale_margin`` of headroom. A tensor the scale does not fit
    (it would saturate, or sit more than ``static_scale_spread`` below the format's top) is
    recast with its dynamic scale, counted and reported: no value is ever clipped. Row-wise
    operands and weights keep dynamic scales, and so do operands quantized inside the fused
    LayerNorm op (its row-wise forward's backward) or traced for inductor
    (``compiled_quantizer=inductor``). The fallback counts are fp32 (exact up to 2**24)."""

    static_scale_margin: float = 2.0
    """Headroom of a static scale over the amax it is set from (``>= 1``), before rounding up
    to a power of two; e5m2 gradients take 128 times as much (``kernels.static_scales.headroom``:
    their format has 15 more binades of normal values)."""

    static_scale_spread: float = 16.0
    """How far below the format's top (``amax / scale`` against ``fmt.max``) a tensor's amax may
    sit and still take the static scale (``>= 2``): a larger spread recasts less often and
    leaves the small values fewer FP8 steps; e5m2 gradients take ``128**2`` times as much."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"mods.enabled must be a bool, got {self.enabled!r}")
        sites = list(self.sites)
        unknown = [s for s in sites if s not in SITE_FAMILIES]
        if unknown:
            raise ValueError(f"mods.sites has unknown families {unknown}; choose from {SITE_FAMILIES}")
        if len(set(sites)) != len(sites):
            raise ValueError(f"mods.sites has duplicates: {sites}")
        self.sites = sites
        if isinstance(self.pad_to_multiple, bool) or not isinstance(self.pad_to_multiple, int):
            raise ValueError(f"mods.pad_to_multiple must be an int, got {self.pad_to_multiple!r}")
        if self.pad_to_multiple < 0:
            raise ValueError(f"mods.pad_to_multiple={self.pad_to_multiple} must be >= 0")
        for name in (
            "keep_last_layer_high",
            "fused_norm_quant",
            "fold_relu",
            "relu_mask_bits",
            "fold_relu_grad",
            "drop_unstable_bias",
            "horizontal_fusion",
            "dcn_epilogue_fusion",
            "dcn_tail_in_gemm",
            "static_scales",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"mods.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fold_relu_grad and not self.fold_relu:
            raise ValueError("mods.fold_relu_grad=true moves the backward of folded ReLUs, and mods.fold_relu=false "
                             "folds none: set mods.fold_relu=true or mods.fold_relu_grad=false")
        if self.initial_plan not in INITIAL_PLANS:
            raise ValueError(
                f"mods.initial_plan={self.initial_plan!r}: choose one of {INITIAL_PLANS}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"mods.backend must be a backend name, got {self.backend!r}")
        if self.compiled_quantizer not in COMPILED_QUANTIZERS:
            raise ValueError(
                f"mods.compiled_quantizer={self.compiled_quantizer!r}: choose one of {COMPILED_QUANTIZERS}"
            )
        for name, low in (("static_scale_margin", 1.0), ("static_scale_spread", 2.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= low:
                raise ValueError(f"mods.{name} must be a number >= {low}, got {v!r}")
        # Builds the plan once so an unsupported backend/scaling pair fails here, not in convert.
        self.initial_linear_plan()

    @property
    def padding(self) -> int:
        """Effective pad multiple (1 when padding is off)."""
        return max(1, self.pad_to_multiple)

    def initial_linear_plan(self) -> LinearPlan:
        """The :class:`LinearPlan` of ``initial_plan`` on ``backend``.

        Raises:
            ValueError: if the backend cannot take the plan's scaling or formats.
        """
        if self.initial_plan == "high":
            return LinearPlan.high_precision()
        scaling = Scaling.ROWWISE if self.initial_plan == "fp8_rowwise" else Scaling.TENSORWISE
        return LinearPlan.fp8(scaling=scaling, backend=self.backend)
