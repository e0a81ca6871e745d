"""GEMM times for Dispatch: measured on the device, or from a cost model of the target GPU.

:class:`GemmTimer` gives the seconds of one GEMM of a role at its ``(M, K, N)``, for high
precision or an FP8 plan, cached by :func:`timing_key`:

* ``measure`` (CUDA): a micro-benchmark of the GEMM as the site's autograd function runs it,
  quantization of both operands from the role's real layouts included (CUDA events, the
  fastest round's median); when the step replays the sites as CUDA graphs, the candidates are
  timed replayed in a CUDA graph too (:meth:`GemmTimer.time_graphed`). A candidate whose
  benchmark raises gets ``inf`` (never chosen), logged and kept in ``failures``.
* ``cost_model``: :class:`GpuCostModel`, a roofline of the H100 (only relative times matter).

Example:
    >>> timer = GemmTimer(timing="auto", device="cpu", out_dtype=torch.float32)
    >>> timer.mode
    'cost_model'
    >>> timer.estimate("forward", (8192, 4096, 4096), None) > 0
    True
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from loka_train.dispatch.planning import GRAD_WEIGHT_OUT_DTYPE, Shape, gemm_problem, padded
from loka_train.kernels import linear as kernels_linear
from loka_train.kernels import static_scales
from loka_train.kernels.formats import Fp8Format, QTensor, Scaling
from loka_train.kernels.plan import GemmPlan
from loka_train.kernels.registry import get_backend
from loka_train.utils.capture import reset_capture_state

logger = logging.getLogger(__name__)

__all__ = [
    "NO_REUSE", "GemmTimer", "GpuCostModel", "Reuse", "parse_timing_key", "reused_payload", "role_operands",
    "timing_key", "transposed_write_s",
]


@dataclass(frozen=True)
class GpuCostModel:
    """Roofline estimate of one GEMM on the target GPU, used where none is present.

    Defaults are fitted to the H100 figures of ../shared/design.md (bf16 8192x4096x4096 in
    375 us, FP8 GEMM alone 1.1-1.8x, a separate quantization pass erasing the gain below
    about 2048 wide). Only relative times matter to Dispatch; on a GPU it measures instead.

    Example:
        >>> cm = GpuCostModel()
        >>> cm.high(8192, 512, 512) < cm.fp8(8192, 512, 512, "rowwise", "emulated")
        True
    """

    bf16_flops: float = 730e12
    fp8_flops: float = 1300e12
    bandwidth: float = 2.8e12
    launch_s: float = 4e-6

    def high(self, m: int, k: int, n: int) -> float:
        """Seconds of the high-precision GEMM."""
        flops = 2.0 * m * k * n / self.bf16_flops
        io = 2.0 * (m * k + n * k + m * n) / self.bandwidth
        return max(flops, io) + self.launch_s

    def fp8(
        self, m: int, k: int, n: int, scaling: str, backend: str, *, quant_a: bool = True, quant_b: bool = True
    ) -> float:
        """Seconds of the FP8 GEMM, with the quantization of the operands it quantizes itself
        (both by default)."""
        flops = 2.0 * m * k * n / self.fp8_flops
        io = (m * k + n * k + 2.0 * m * n) / self.bandwidth
        gemm = max(flops, io) + self.launch_s
        # Quantizing both operands: read high precision, write FP8 (+ scales). The Triton
        # quantizer is one fused pass; others take an amax pass and a cast pass.
        passes = 1 if backend == "triton" else 2
        elems = m * k * quant_a + n * k * quant_b
        quant = passes * (3.0 * elems / self.bandwidth + self.launch_s) if elems else 0.0
        return gemm + quant


Reuse = tuple[bool, bool]
"""Which operands ``(a, b)`` of a GEMM the site takes over already quantized from another of its
GEMMs (``kernels.linear.transposed_reuse``), so that timing them leaves their quantization out."""

NO_REUSE: Reuse = (False, False)


def timing_key(role: str, shape: Shape, plan: GemmPlan | None, reuse: Reuse = NO_REUSE) -> str:
    """``"role:MxKxN:plan"`` (``plan`` printed, ``high`` for high precision), with
    ``"|reuse=a"``, ``"b"`` or ``"ab"`` appended for reused operands: the cache key of a time,
    identical on every rank."""
    key = f"{role}:{shape[0]}x{shape[1]}x{shape[2]}:{plan or 'high'}"
    if plan is not None and any(reuse):
        key += "|reuse=" + "a" * reuse[0] + "b" * reuse[1]
    return key


def parse_timing_key(key: str) -> tuple[str, Shape, str, Reuse]:
    """``(role, shape, plan string, reuse)`` of a :func:`timing_key`."""
    key, _, reused = key.partition("|reuse=")
    role, dims, plan_s = key.split(":", 2)
    m, k, n = (int(x) for x in dims.split("x"))
    return role, (m, k, n), plan_s, ("a" in reused, "b" in reused)


def role_operands(
    role: str,
    shape: Shape,
    *,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    zero_half: bool = False,
) -> tuple[Tensor, Tensor, bool, torch.dtype]:
    """``(a_MK, b_NK, b_is_weight, out_dtype)`` of one GEMM laid out as ``kernels.linear``
    passes them, random (never zeros: they time faster than real data).

    forward: ``x`` (M, K) and the weight (N, K), both contiguous; grad-input: ``dY``
    (M, K=N_out) and ``W^T`` (a transposed view of the (K, N) weight); grad-weight: ``dY^T``
    and ``X^T``, transposed views of the (K=batch, M) and (K=batch, N) activations, with an
    fp32 output. The views matter: on the backends that take the Triton quantizers they go
    through the transposing one (no transposed copy), elsewhere the reference quantizer
    copies them. ``dtype`` is the sites' compute dtype (bf16 under autocast). ``zero_half``:
    every other value of the activations and gradients (not the weights) is zero, at random, as
    behind a ReLU and in its backward; a GEMM's speed can depend on its data.
    """
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, device=device, dtype=dtype, generator=gen)

    def act(*size: int) -> Tensor:
        t = randn(*size)
        return t * (randn(*size) > 0) if zero_half else t

    if role == "grad_input":
        return act(m, k), randn(k, n).t(), True, dtype
    if role == "grad_weight":
        return act(k, m).t(), act(k, n).t(), False, GRAD_WEIGHT_OUT_DTYPE
    return act(m, k), randn(n, k), True, dtype


def reused_payload(t: Tensor, fmt: Fp8Format, plan: GemmPlan, *, is_weight: bool) -> QTensor:
    """The operand ``t`` (a transposed view) as a site reuses it: quantized in the layout of the
    GEMM that produced it (``t.t()``), its transpose written contiguous in the same pass where
    the site does so (``kernels.linear.quantize_with_transpose``), else viewed transposed."""
    _, q_t = kernels_linear.quantize_with_transpose(t.t(), fmt, plan, plan, fmt, is_weight=is_weight)
    assert q_t is not None  # a reused operand is a tensor-wise one (planning.reused_operands)
    return q_t


def transposed_write_s(
    t: Tensor, fmt: Fp8Format, plan: GemmPlan, time: Callable[[Callable[[], object]], float],
    static: Tensor | None = None,
) -> float:
    """What a site pays for taking the operand ``t`` (a transposed view) over from another GEMM:
    the transposed write that GEMM's quantizer adds where it writes both layouts in one pass
    (:func:`reused_payload`), timed with ``time`` as that pass less the one-layout pass (never
    below 0); 0 where the reused operand is a view of the other GEMM's payload. ``static``: the
    static-scale slot that GEMM's quantizer takes (``x`` and ``dY`` under ``mods.static_scales``):
    both passes are then timed in their static-scale form, the one the site runs (one read of
    ``t``, no amax pass)."""
    src = t.t().contiguous()  # the one-layout casts read a contiguous tensor (t is a transposed view)
    if not kernels_linear.writes_both_layouts(plan, src, fmt, plan, fmt):
        return 0.0
    from loka_train.kernels.triton_tensorwise import (
        tensorwise_quant,
        tensorwise_quant_both,
        tensorwise_quant_static,
    )

    if static is not None:
        both = time(lambda: tensorwise_quant_static(src, static, fmt=fmt, both=True))
        one = time(lambda: tensorwise_quant_static(src, static, fmt=fmt, both=False))
    else:
        both = time(lambda: tensorwise_quant_both(src, fmt=fmt))
        one = time(lambda: tensorwise_quant(src, fmt=fmt))
    return max(0.0, both - one)


class GemmTimer:
    """Seconds of one GEMM per (role, shape, plan), measured or from the cost model, cached.

    Args:
        timing: ``dispatch.timing``: ``"measure"`` (needs CUDA), ``"cost_model"`` or ``"auto"``
            (measure on CUDA, else the cost model).
        device: where the GEMMs run.
        out_dtype: output dtype of the forward and grad-input GEMMs (grad-weight writes fp32).
        graphed: the step replays the sites as CUDA graphs: time candidates graph-replayed.
        static_scales: the sites quantize tensor-wise ``x`` and ``dY`` with static scales
            (``mods.static_scales``): time those operands' quantization so, and the transposed
            write a GEMM that takes them over pays (:meth:`reused_static_slot`).
        bench_iters: timed repetitions of each micro-benchmark (after 3 warm-up runs).
        cost_model: the model used where nothing is measured.
    """

    def __init__(
        self,
        *,
        timing: str,
        device: torch.device | str,
        out_dtype: torch.dtype,
        graphed: bool = False,
        bench_iters: int = 20,
        cost_model: GpuCostModel | None = None,
        static_scales: bool = False,
    ) -> None:
        self.timing = timing
        self.static_scales = static_scales
        self._static_slot: Tensor | None = None
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        self.graphed = graphed
        self.bench_iters = bench_iters
        self.cost_model = GpuCostModel() if cost_model is None else cost_model
        self.timings: dict[str, float] = {}
        """Timing key -> seconds."""
        self.failures: dict[str, str] = {}
        """Timing key -> error of a candidate whose micro-benchmark raised (excluded, logged)."""
        self._transposed_writes: dict[tuple, float] = {}
        """(operand shape, format, backend, static scale) -> seconds of :func:`transposed_write_s`."""

    @property
    def mode(self) -> str:
        """``"measure"`` or ``"cost_model"``, as ``timing`` resolves on this device.

        Raises:
            ValueError: for ``timing="measure"`` without a CUDA device.
        """
        if self.timing == "auto":
            return "measure" if self.device.type == "cuda" else "cost_model"
        if self.timing == "measure" and self.device.type != "cuda":
            raise ValueError(
                "dispatch.timing=measure needs a CUDA device; use timing=auto or cost_model on CPU"
            )
        return self.timing

    @property
    def source(self) -> str:
        """Where the times come from: timing mode, device, output dtype, graph replay and static
        tensor-wise scales. Cached times are
        only reused (e.g. from a checkpoint) by a timer of the same source."""
        mode = self.mode
        if mode == "measure":
            on_gpu = self.device.type == "cuda" and torch.cuda.is_available()
            where = torch.cuda.get_device_name(self.device) if on_gpu else self.device.type
        else:
            model = self.cost_model
            where = f"cost model {model.bf16_flops:g}/{model.fp8_flops:g} flops, {model.bandwidth:g} B/s"
        launch = ", CUDA graph" if mode == "measure" and self.graphed else ""
        static = (", static tensor-wise scales and transposed writes" if mode == "measure" and self.static_scales
                  else "")
        return f"{mode}: {where}, out {str(self.out_dtype).removeprefix('torch.')}{launch}{static}"

    def static_slot(self, role: str, plan: GemmPlan | None) -> Tensor | None:
        """The scratch static-scale slot that the ``a`` operand of ``role`` takes under
        ``static_scales`` (a site's ``x`` or ``dY``, tensor-wise; seeded by the warm-up runs),
        else None."""
        if not self.static_scales or plan is None or not plan.is_fp8 or plan.scaling is not Scaling.TENSORWISE:
            return None
        if role not in ("forward", "grad_input"):
            return None
        if self.device.type == "cuda" and not kernels_linear.takes_triton_quantizers(plan.backend):
            # The emulated candidate's static path decides on the host (a graphed timing cannot
            # capture it); it is never the fast one on a GPU: timed with its dynamic scale.
            return None
        if self._static_slot is None:
            # The timing's own slot, with the default knobs: on the random operands timed, the
            # seeded scale fits whatever the run's margin and spread.
            self._static_slot = static_scales.new_slots(1, margin=2.0, spread=16.0, device=self.device)[0]
        return self._static_slot

    def reused_static_slot(self, plan: GemmPlan, is_weight: bool) -> Tensor | None:
        """The static-scale slot of the pass that quantizes an operand a GEMM under ``plan``
        takes over from another GEMM (:func:`transposed_write_s`): an activation or gradient
        (``x`` or ``dY``, cast by the forward or grad-input) takes the slot those roles' ``a``
        takes (:meth:`static_slot`, asked as the forward's: the forward and grad-input are
        alike there); a weight is cast with its dynamic scale."""
        return None if is_weight else self.static_slot("forward", plan)

    def estimate(self, role: str, shape: Shape, plan: GemmPlan | None, reuse: Reuse = NO_REUSE) -> float:
        """Seconds of one GEMM of ``role`` at ``shape`` (high precision for ``plan=None``),
        from the cache, else measured or modelled and cached. ``reuse`` names the operands the
        site takes over already quantized from another of its GEMMs (not quantized here)."""
        key = timing_key(role, shape, plan, reuse)
        if key not in self.timings:
            m, k, n = shape
            if self.mode == "cost_model":
                t = (
                    self.cost_model.high(m, k, n)
                    if plan is None
                    else self.cost_model.fp8(
                        m, k, n, plan.scaling.value, plan.backend, quant_a=not reuse[0], quant_b=not reuse[1]
                    )
                )
            else:
                t = self.measure(shape, plan, role, reuse)
            self.timings[key] = t
        return self.timings[key]

    def folds_relu(self, plan: GemmPlan | None) -> bool:
        """Whether a site's forward under ``plan`` applies a folded ReLU in its cast
        (``kernels.fp8_linear``'s ``input_relu``: the Triton tensor-wise cast, where Triton runs
        on this device)."""
        if plan is None or not plan.is_fp8 or plan.scaling is not Scaling.TENSORWISE:
            return False
        if not kernels_linear.takes_triton_quantizers(plan.backend):
            return False
        from loka_train.kernels.backends import TRITON_INSTALLED

        if not TRITON_INSTALLED:
            return False
        from loka_train.kernels.triton_kernels import triton_runnable

        return triton_runnable(self.device)[0]

    def relu_pass_s(self, m: int, k: int) -> float:
        """Seconds of a ReLU pass over an ``(m, k)`` activation in the sites' compute dtype (a
        read and a write at the cost model's bandwidth, plus a launch): what a forward candidate
        pays that does not apply a folded ReLU in its cast, and the pass the backward runs again
        where one that applies it hands no ``x`` to grad-weight. From the roofline in every timing
        mode, so that every rank adds the same (a 32768 x 4096 bf16 ReLU took 176 us on an H100,
        bench/results/fold_relu_h100-h200_2026-11-26/call2/producer.txt; the roofline says 196)."""
        elem = torch.finfo(self.out_dtype).bits // 8  # the sites' compute dtype
        return 2.0 * elem * m * k / self.cost_model.bandwidth + self.cost_model.launch_s

    def measure(
        self, shape: Shape, plan: GemmPlan | None, role: str = "forward", reuse: Reuse = NO_REUSE
    ) -> float:
        """Seconds of one GEMM of `role` as the site's autograd function runs it: for FP8,
        quantize both operands (from the role's real layouts) and call the backend; for high
        precision, the matmul on the same layouts. An operand in ``reuse`` is quantized before
        the timed run: the site takes it over from another of its GEMMs.

        A backend that refuses `shape` is timed on it zero-padded to multiples of 16 (what a
        padding site runs). A candidate whose benchmark raises gets ``inf`` (never chosen); the
        error is logged and kept in ``failures``.
        """
        key = timing_key(role, shape, plan, reuse)
        try:
            return self.measure_once(shape, plan, role, reuse)
        except Exception as exc:  # a backend bug must not end the training run
            self.failures[key] = f"{type(exc).__name__}: {exc}"
            logger.warning("dispatch: timing %s failed (%s); the candidate is excluded", key, exc)
            return math.inf

    def measure_once(
        self, shape: Shape, plan: GemmPlan | None, role: str = "forward", reuse: Reuse = NO_REUSE
    ) -> float:
        """:meth:`measure` without catching a benchmark's error.

        As the site runs it: a backend that refuses the shape runs it zero-padded to multiples
        of 16, and the timed run pays the site's padding copies of both operands; a reused
        operand is what the other GEMM's quantizer hands over (:func:`reused_payload`): the
        transpose it writes in the same pass, whose write is added to the time
        (:func:`transposed_write_s`), or the transposed view of its payload, which a backend
        that must copy it pays for in the timed run.
        """
        m, k, n = shape
        pad = False
        if plan is not None:
            problem = gemm_problem(role, shape, plan, device_type=self.device.type, out_dtype=self.out_dtype)
            if not get_backend(plan.backend).supports(problem)[0]:
                pad = True
                m, k, n = padded(shape, 16)
        a, b, b_is_weight, out_dtype = role_operands(role, (m, k, n), device=self.device)
        a_q = b_q = None
        if plan is not None:
            if reuse[0]:
                a_q = reused_payload(a, plan.fmt, plan, is_weight=False)
            if reuse[1]:
                b_q = reused_payload(b, plan.operand_b_fmt, plan, is_weight=b_is_weight)
        static_a = self.static_slot(role, plan)
        a_src = a[: shape[0], : shape[1]].contiguous() if pad else a
        b_src = b[: shape[2], : shape[1]].contiguous() if pad else b

        def run() -> torch.Tensor:
            if plan is None:
                return a @ b.t()
            a_run, b_run = a, b
            # The site's copies into padded operands (planned_linear's F.pad); a reused operand
            # was padded where it was quantized.
            if pad and a_q is None:
                a_run = torch.nn.functional.pad(a_src, (0, k - shape[1], 0, m - shape[0]))
            if pad and b_q is None:
                b_run = torch.nn.functional.pad(b_src, (0, k - shape[1], 0, n - shape[2]))
            return kernels_linear.fp8_gemm_planned(
                a_run, b_run, plan, out_dtype=out_dtype, role=role, b_is_weight=b_is_weight, a_q=a_q, b_q=b_q,
                static_a=static_a,
            )

        extra = 0.0
        if plan is not None:
            for t, fmt, reused, is_weight in (
                (a, plan.fmt, reuse[0], False), (b, plan.operand_b_fmt, reuse[1], b_is_weight)
            ):
                if reused:
                    static = self.reused_static_slot(plan, is_weight=is_weight)
                    key = (tuple(t.shape), fmt, plan.backend, static is not None)
                    if key not in self._transposed_writes:
                        self._transposed_writes[key] = transposed_write_s(t, fmt, plan, self.time, static)
                    extra += self._transposed_writes[key]
        return self.time(run) + extra

    def time(self, run: Callable[[], object]) -> float:
        """Seconds of one ``run()`` after 3 warm-up runs: graph-replayed (:meth:`time_graphed`)
        when the step is graphed on a GPU, else the fastest of a few rounds' medians."""
        for _ in range(3):
            run()
        if self.graphed and self.device.type == "cuda":
            return self.time_graphed(run)
        # Rounds of back-to-back runs; the fastest round's median. An eager step is launch-
        # bound, so single runs jitter by tens of microseconds with the host; the minimum over
        # rounds of the median drops rounds that a host hiccup slowed down.
        rounds = 3 if self.bench_iters >= 6 else 1
        per_round = max(1, self.bench_iters // rounds)
        best = math.inf
        for _ in range(rounds):
            times = sorted(self._time_one(run) for _ in range(per_round))
            best = min(best, times[len(times) // 2])
        return best

    def _time_one(self, run: Callable[[], object]) -> float:
        """Seconds of one ``run()``: CUDA events on a GPU, the host clock elsewhere (tests)."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    def time_graphed(self, run: Callable[[], object], reps: int = 10) -> float:
        """Seconds of one ``run()`` as a graphed step runs it: `reps` runs captured in one CUDA
        graph, the median replay of ``bench_iters`` divided by `reps`. A run that cannot be
        captured raises (the candidate is then excluded, as the step could not graph it)."""
        graph = torch.cuda.CUDAGraph()
        try:
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    for _ in range(reps):
                        run()
            except BaseException:
                reset_capture_state()
                raise
            graph.replay()
            times = sorted(self._time_one(graph.replay) for _ in range(max(1, self.bench_iters)))
        finally:
            graph.reset()
        return times[len(times) // 2] / reps
