"""Dispatch: the per-GEMM plan of every site, chosen from Probe verdicts and measured speed.

For each site and each of its GEMM roles (forward, grad_input, grad_weight) Dispatch keeps a
:class:`GemmPlan`. At every Probe interval it re-plans:

1. Candidates: high precision, plus every FP8 (scaling, backend) pair of the config whose
   backend ``supports`` the problem on this device (the reason is kept when it does not).
2. Safety: an FP8 candidate is eligible only if the Probe's verdict for
   (site, role, format, scaling) is safe, i.e. its conservative SQNR bound fits the site's
   budget (the Probe holds the budget and its own hysteresis).
3. Speed: each eligible candidate gets a time for the site's real (M, K, N): measured by an
   on-device micro-benchmark (quantization of both operands included, cached by shape key)
   when a GPU is present, otherwise from a cost model of the target GPU (``cost_model``).
   With ``objective="speed"`` FP8 is chosen only if it beats high precision by ``margin``;
   ``objective="coverage"`` takes the fastest safe FP8 candidate whatever its speed (useful on
   CPU, where FP8 is emulated, to exercise the numerics).
4. Hysteresis: a move to a safer plan (the current plan's verdict turned unsafe) is applied at
   once; any other change needs the same target for ``hysteresis_intervals`` consecutive
   intervals, so plans do not flap.

Collective: the inputs are identical on every rank (verdicts come from all-reduced
statistics, shapes from the same batch size, measured times are all-reduced with MAX), and the
decision is a pure function of them, so every rank applies the same plan at the same step.
Every change is a :class:`PlanChange` (logged, counted, kept in the history). The plan is data:
``state_dict`` / ``load_state_dict`` for checkpoints, ``table()`` to print, ``export()`` for
inference.

Example:
    >>> d = Dispatcher(DispatchConfig(objective="coverage"), device="cpu")
    >>> d.register("over_arch.0", shapes={"forward": (256, 64, 32), ...})
    >>> changes = d.replan(step=99, verdicts=probe.verdicts())
    >>> for c in changes: site_modules[c.site].set_plan(d.plans[c.site])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision
from loka_train.kernels.registry import GemmProblem, get_backend, registered_backends
from loka_train.utils.capture import reset_capture_state

logger = logging.getLogger(__name__)

ROLES = ("forward", "grad_input", "grad_weight")
OBJECTIVES = ("speed", "coverage")
TIMINGS = ("auto", "measure", "cost_model")

Shape = tuple[int, int, int]
"""(M, K, N) of one GEMM: ``(M, K) x (N, K)^T``."""

SiteSupports = Callable[[LinearPlan], tuple[bool, str]]
"""A site's own check of a whole plan: (ok, why not)."""


@dataclass(kw_only=True)
class DispatchConfig:
    """How Dispatch picks each GEMM's plan.

    Example:
        >>> DispatchConfig(objective="speed", margin=0.05, scalings=("rowwise",))
    """

    enabled: bool = True
    """Re-plan at Probe intervals. Off: every site keeps its initial plan (on resume, a
    checkpointed plan other than that or high precision is reset to it, see ``load_state_dict``)."""

    objective: str = "speed"
    """"speed": FP8 only where it is safe AND faster than high precision by `margin`;
    "coverage": FP8 wherever it is safe (fastest safe candidate)."""

    cpu_objective: str | None = None
    """Objective when the job runs on CPU, where FP8 is emulated and only its numerics matter
    (the speed side is the H100 cost model's guess); None: the same as ``objective``."""

    margin: float = 0.05
    """Relative speed-up an FP8 candidate must show over high precision (0.05 = 5%)."""

    scalings: tuple[str, ...] = ("rowwise",)
    """Scaling granularities Dispatch may choose (subset of the Probe's candidates)."""

    backends: tuple[str, ...] = ("triton", "fbgemm_rowwise", "torch_scaled_mm", "emulated")
    """FP8 backends Dispatch may choose, in order of preference on equal time. "emulated"
    (quantize, dequantize, fp32 matmul) is what runs on CPU."""

    cpu_backends: tuple[str, ...] = ("emulated",)
    """Backends Dispatch may choose when the job runs on CPU, where FP8 only serves the
    numerics (the Triton interpreter would run but is far too slow to train with)."""

    fmt_forward: str = "e4m3"
    """Format of the forward GEMM's operands."""

    fmt_backward: str = "e5m2"
    """Format of the output gradient in the backward GEMMs (the other operand stays e4m3)."""

    fp8_roles: tuple[str, ...] = ("forward", "grad_input", "grad_weight")
    """GEMM roles that may run in FP8 at all; the others always stay in high precision."""

    hysteresis_intervals: int = 2
    """Consecutive intervals a new (not safety-driven) target must persist before it is applied."""

    timing: str = "auto"
    """"measure" (on-device micro-benchmark, needs CUDA), "cost_model", or "auto" (measure
    when on CUDA, else the cost model)."""

    bench_iters: int = 20
    """Timed repetitions of each micro-benchmark (after 3 warm-up runs)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"dispatch.objective={self.objective!r}: choose one of {OBJECTIVES}")
        if self.cpu_objective is not None and self.cpu_objective not in OBJECTIVES:
            raise ValueError(
                f"dispatch.cpu_objective={self.cpu_objective!r}: choose one of {OBJECTIVES} or null"
            )
        if self.timing not in TIMINGS:
            raise ValueError(f"dispatch.timing={self.timing!r}: choose one of {TIMINGS}")
        if not (0.0 <= self.margin < 10.0):
            raise ValueError(f"dispatch.margin={self.margin} must be in [0, 10)")
        if self.hysteresis_intervals < 1 or self.bench_iters < 1:
            raise ValueError("dispatch.hysteresis_intervals and dispatch.bench_iters must be >= 1")
        # Accept "rowwise", "ROWWISE" or the enum, like the Probe config.
        self.scalings = tuple(Scaling(str(getattr(s, "value", s)).lower()).value for s in self.scalings)
        self.fmt_forward = Fp8Format(self.fmt_forward).value
        self.fmt_backward = Fp8Format(self.fmt_backward).value
        bad_roles = set(self.fp8_roles) - set(ROLES)
        if bad_roles:
            raise ValueError(f"dispatch.fp8_roles has unknown roles {sorted(bad_roles)}; use {ROLES}")
        if not self.backends or not self.cpu_backends:
            raise ValueError("dispatch.backends and dispatch.cpu_backends must each name a backend")


@dataclass(frozen=True)
class PlanChange:
    """One GEMM's plan changed at `step`, and why."""

    step: int
    site: str
    role: str
    old: str
    new: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step} {self.site}/{self.role}: {self.old} -> {self.new} ({self.reason})"


# ------------------------------------------------------------------------------ cost model
@dataclass(frozen=True)
class GpuCostModel:
    """Roofline estimate of one GEMM on the target GPU, used where none is present.

    Defaults are fitted to the H100 figures of ../shared/design.md (bf16 8192x4096x4096 in
    375 us, FP8 GEMM alone 1.1-1.8x, a separate quantization pass erasing the gain below
    about 2048 wide). Only relative times matter to Dispatch; on a GPU it measures instead.
    """

    bf16_flops: float = 730e12
    fp8_flops: float = 1300e12
    bandwidth: float = 2.8e12
    launch_s: float = 4e-6

    def high(self, m: int, k: int, n: int) -> float:
        flops = 2.0 * m * k * n / self.bf16_flops
        io = 2.0 * (m * k + n * k + m * n) / self.bandwidth
        return max(flops, io) + self.launch_s

    def fp8(self, m: int, k: int, n: int, scaling: str, backend: str) -> float:
        flops = 2.0 * m * k * n / self.fp8_flops
        io = (m * k + n * k + 2.0 * m * n) / self.bandwidth
        gemm = max(flops, io) + self.launch_s
        # Quantizing both operands: read high precision, write FP8 (+ scales). The Triton
        # quantizer is one fused pass; others take an amax pass and a cast pass.
        passes = 1 if backend == "triton" else 2
        elems = m * k + n * k
        quant = passes * (3.0 * elems / self.bandwidth + self.launch_s)
        return gemm + quant


_GRAD_WEIGHT_OUT_DTYPE = torch.float32
"""FP8 weight gradients are written in the weight's dtype (``kernels.linear.grad_weight_dtype``):
fp32 for the fp32 master weights of bf16-autocast training, which is what is timed here."""


def _padded(shape: Shape, multiple: int) -> Shape:
    """``shape`` with every dim rounded up to ``multiple`` (what a padding site runs)."""
    m, k, n = (d + (-d) % multiple for d in shape)
    return (m, k, n)


def _plan_for(cfg: DispatchConfig, role: str, scaling: str, backend: str) -> GemmPlan:
    if role == "forward":
        return GemmPlan(
            precision=Precision.FP8, fmt=Fp8Format(cfg.fmt_forward), scaling=Scaling(scaling),
            backend=backend,
        )
    return GemmPlan(
        precision=Precision.FP8,
        fmt=Fp8Format(cfg.fmt_backward),
        fmt_b=Fp8Format(cfg.fmt_forward),
        scaling=Scaling(scaling),
        backend=backend,
    )


class Dispatcher:
    """Holds every site's plan and re-plans it from verdicts and timings.

    Args:
        config: what may be chosen and how.
        device: the device the GEMMs run on (CUDA enables measured timing).
        out_dtype: output dtype of the GEMMs (bf16 on GPU, fp32 on CPU).
    """

    def __init__(
        self,
        config: DispatchConfig,
        *,
        device: torch.device | str,
        out_dtype: torch.dtype = torch.float32,
        graphed: bool = False,
    ) -> None:
        # A misspelled backend would only ever be "unsupported": FP8 quietly never chosen.
        known = set(registered_backends())
        for key in ("backends", "cpu_backends"):
            unknown = [b for b in getattr(config, key) if b not in known]
            if unknown:
                raise ValueError(
                    f"dispatch.{key} names unknown GEMM backends {unknown}; registered: "
                    f"{sorted(known)}"
                )
        self.config = config
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        self.graphed = graphed
        """The step replays the sites as CUDA graphs (``trainer.cuda_graphs``): candidates are
        timed replayed in a CUDA graph too, without the host's launch cost that an eager step
        pays."""
        self.cost_model = GpuCostModel()
        self.plans: dict[str, LinearPlan] = {}
        self.shapes: dict[str, dict[str, Shape]] = {}
        self._site_supports: dict[str, SiteSupports] = {}
        self.history: list[PlanChange] = []
        self.num_changes = 0
        self._pad: dict[str, int] = {}
        self.measure_failures: dict[str, str] = {}
        """Timing key -> error of a candidate whose micro-benchmark raised (excluded, logged)."""
        self.unsupported: dict[str, str] = {}
        """backend/scaling -> why it cannot run here (reported once)."""
        self._pending: dict[tuple[str, str], tuple[str, int]] = {}
        self._timings: dict[str, float] = {}
        self._reasons: dict[tuple[str, str], str] = {}

    @property
    def objective(self) -> str:
        """The objective in force on this device (``cpu_objective`` on CPU when set)."""
        if self.device.type == "cpu" and self.config.cpu_objective is not None:
            return self.config.cpu_objective
        return self.config.objective

    @property
    def timing_mode(self) -> str:
        if self.config.timing == "auto":
            return "measure" if self.device.type == "cuda" else "cost_model"
        if self.config.timing == "measure" and self.device.type != "cuda":
            raise ValueError(
                "dispatch.timing=measure needs a CUDA device; use timing=auto or cost_model on CPU"
            )
        return self.config.timing

    @property
    def timing_source(self) -> str:
        """Where this dispatcher's GEMM times come from: timing mode, device and output dtype.
        Cached timings are only reused (e.g. from a checkpoint) by a dispatcher of the same
        source."""
        mode = self.timing_mode
        if mode == "measure":
            on_gpu = self.device.type == "cuda" and torch.cuda.is_available()
            where = torch.cuda.get_device_name(self.device) if on_gpu else self.device.type
        else:
            model = self.cost_model
            where = f"cost model {model.bf16_flops:g}/{model.fp8_flops:g} flops, {model.bandwidth:g} B/s"
        launch = ", CUDA graph" if mode == "measure" and self.graphed else ""
        return f"{mode}: {where}, out {str(self.out_dtype).removeprefix('torch.')}{launch}"

    def register(
        self,
        site: str,
        *,
        plan: LinearPlan,
        shapes: Mapping[str, Shape] | None = None,
        supports: SiteSupports | None = None,
        pad_to_multiple: int = 1,
    ) -> None:
        """Add a site with its initial plan (and GEMM shapes, if already known).

        Args:
            site: the site's name.
            plan: its current plan.
            shapes: (M, K, N) per role, if known.
            supports: the site's own check of a plan (e.g. a batched GEMM that only the
                emulated backend runs); candidates it rejects are never chosen.
            pad_to_multiple: the site zero-pads FP8 GEMM dims to this multiple when a backend
                refuses the unpadded shape (``Fp8Linear.pad_to_multiple``); such a backend is
                then a candidate, timed on the padded shape.
        """
        self.plans[site] = plan
        self.shapes[site] = dict(shapes or {})
        self._pad[site] = max(1, int(pad_to_multiple))
        if supports is not None:
            self._site_supports[site] = supports

    def update_shapes(self, site: str, shapes: Mapping[str, Shape]) -> None:
        """Record the site's latest (M, K, N) per role (M from the last forward)."""
        self.shapes[site].update({r: (s[0], s[1], s[2]) for r, s in shapes.items() if min(s) > 0})

    # ------------------------------------------------------------------------ timing
    def _key(self, role: str, shape: Shape, plan: GemmPlan | None) -> str:
        return f"{role}:{shape[0]}x{shape[1]}x{shape[2]}:{plan or 'high'}"

    def _estimate(self, role: str, shape: Shape, plan: GemmPlan | None) -> float:
        key = self._key(role, shape, plan)
        if key not in self._timings:
            m, k, n = shape
            if self.timing_mode == "cost_model":
                t = (
                    self.cost_model.high(m, k, n)
                    if plan is None
                    else self.cost_model.fp8(m, k, n, plan.scaling.value, plan.backend)
                )
            else:
                t = self._measure(shape, plan, role)
            self._timings[key] = t
        return self._timings[key]

    def _measure(self, shape: Shape, plan: GemmPlan | None, role: str = "forward") -> float:
        """Seconds of one GEMM of `role` as the site's autograd function runs it: for FP8,
        quantize both operands (from the role's real layouts) and call the backend; for high
        precision, the matmul on the same layouts.

        A backend that refuses `shape` is timed on it zero-padded to multiples of 16 (what a
        padding site runs). A candidate whose benchmark raises gets ``inf`` (never chosen); the
        error is logged and kept in ``measure_failures``.
        """
        key = self._key(role, shape, plan)
        try:
            return self._measure_once(shape, plan, role)
        except Exception as exc:  # a backend bug must not end the training run
            self.measure_failures[key] = f"{type(exc).__name__}: {exc}"
            logger.warning("dispatch: timing %s failed (%s); the candidate is excluded", key, exc)
            return math.inf

    def _problem(self, role: str, shape: Shape, plan: GemmPlan) -> GemmProblem:
        """The GEMM a site runs for `role` under `plan` (grad-weight writes fp32, see
        ``kernels.linear``), as backends' ``supports`` see it."""
        return GemmProblem(
            m=shape[0], k=shape[1], n=shape[2], fmt=plan.fmt, fmt_b=plan.fmt_b, scaling=plan.scaling,
            device_type=self.device.type, role=role, fast_accum=plan.fast_accum,
            out_dtype=_GRAD_WEIGHT_OUT_DTYPE if role == "grad_weight" else self.out_dtype,
        )

    def _role_operands(self, role: str, m: int, k: int, n: int) -> tuple[Tensor, Tensor, bool, torch.dtype]:
        """``(a_MK, b_NK, b_is_weight, out_dtype)`` laid out as ``kernels.linear`` passes them.

        forward: ``x`` (M, K) and the weight (N, K), both contiguous; grad-input: ``dY``
        (M, K=N_out) and ``W^T`` (a transposed view of the (K, N) weight); grad-weight: ``dY^T``
        and ``X^T``, transposed views of the (K=batch, M) and (K=batch, N) activations, with an
        fp32 output. The views matter: on the backends that take the Triton quantizers they go
        through the transposing one (no transposed copy), elsewhere the reference quantizer
        copies them.
        """
        dtype = torch.bfloat16  # the compute dtype of the sites under bf16 autocast
        gen = torch.Generator(device=self.device).manual_seed(0)

        def randn(*size: int) -> Tensor:
            return torch.randn(*size, device=self.device, dtype=dtype, generator=gen)

        if role == "grad_input":
            return randn(m, k), randn(k, n).t(), True, dtype
        if role == "grad_weight":
            return randn(k, m).t(), randn(k, n).t(), False, _GRAD_WEIGHT_OUT_DTYPE
        return randn(m, k), randn(n, k), True, dtype

    def _measure_once(self, shape: Shape, plan: GemmPlan | None, role: str = "forward") -> float:
        from loka_train.kernels.linear import fp8_gemm_planned

        m, k, n = shape
        if plan is not None and not get_backend(plan.backend).supports(self._problem(role, shape, plan))[0]:
            m, k, n = _padded(shape, 16)
        a, b, b_is_weight, out_dtype = self._role_operands(role, m, k, n)

        def run() -> torch.Tensor:
            if plan is None:
                return a @ b.t()
            return fp8_gemm_planned(a, b, plan, out_dtype=out_dtype, role=role, b_is_weight=b_is_weight)

        for _ in range(3):
            run()
        if self.graphed and self.device.type == "cuda":
            return self._time_graphed(run)
        # Rounds of back-to-back runs; the fastest round's median. An eager step is launch-
        # bound, so single runs jitter by tens of microseconds with the host; the minimum over
        # rounds of the median drops rounds that a host hiccup slowed down.
        rounds = 3 if self.config.bench_iters >= 6 else 1
        per_round = max(1, self.config.bench_iters // rounds)
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

    def _time_graphed(self, run: Callable[[], Tensor], reps: int = 10) -> float:
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
            times = sorted(self._time_one(graph.replay) for _ in range(max(1, self.config.bench_iters)))
        finally:
            graph.reset()
        return times[len(times) // 2] / reps

    def _agree_on_timings(self, keys: list[str]) -> None:
        """Make measured times identical on every rank (MAX), so decisions agree."""
        if not keys or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if self.timing_mode == "cost_model":
            return  # a pure function of the shapes: already identical
        # Ranks may have measured different keys (cache hits); agree on the union first.
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, keys)
        union = sorted({k for ks in gathered for k in ks})
        for key in union:
            if key not in self._timings:
                role, dims, plan_s = key.split(":", 2)
                shape = tuple(int(x) for x in dims.split("x"))
                self._timings[key] = self._measure(shape, self._parse_plan(role, plan_s), role)  # type: ignore[arg-type]
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        vec = torch.tensor([self._timings[k] for k in union], dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        for key, value in zip(union, vec.tolist()):
            self._timings[key] = value

    def _parse_plan(self, role: str, plan_s: str) -> GemmPlan | None:
        if plan_s == "high":
            return None
        for scaling in self.config.scalings:
            for backend in self.config.backends:
                try:
                    plan = _plan_for(self.config, role, scaling, backend)
                except ValueError:
                    continue
                if str(plan) == plan_s:
                    return plan
        raise ValueError(f"unknown plan key {plan_s!r}")

    # ----------------------------------------------------------------------- planning
    def _candidates(self, site: str, role: str, shape: Shape) -> list[GemmPlan]:
        out: list[GemmPlan] = []
        if role not in self.config.fp8_roles:
            return out
        backends = self.config.cpu_backends if self.device.type == "cpu" else self.config.backends
        site_ok = self._site_supports.get(site)
        for scaling in self.config.scalings:
            for backend_name in backends:
                try:
                    plan = _plan_for(self.config, role, scaling, backend_name)
                    backend = get_backend(backend_name)
                except (KeyError, ValueError) as exc:
                    self.unsupported.setdefault(f"{backend_name}/{scaling}", str(exc))
                    continue
                problem = self._problem(role, shape, plan)
                ok, why = backend.supports(problem)
                pad = self._pad.get(site, 1)
                if not ok and pad > 1:
                    padded = _padded(shape, pad)
                    ok = backend.supports(dataclasses.replace(problem, m=padded[0], k=padded[1], n=padded[2]))[0]
                if ok and site_ok is not None:
                    ok, why = site_ok(LinearPlan(**{**self._roles(self.plans[site]), role: plan}))
                    if not ok:
                        continue  # a property of the site, not a fallback
                if ok:
                    out.append(plan)
                else:
                    self.unsupported.setdefault(f"{backend_name}/{scaling}", why)
        return out

    def _target(
        self, site: str, role: str, verdicts: Mapping[Any, Any]
    ) -> tuple[GemmPlan, str, bool]:
        """The plan this GEMM should have now: (plan, reason, current_is_unsafe)."""
        current = getattr(self.plans[site], role)
        shape = self.shapes[site].get(role)
        if shape is None:
            return current, "shape not seen yet", False

        def verdict_of(plan: GemmPlan) -> tuple[Any, str]:
            """(the Probe's verdict for exactly this plan's operand formats, or None; why not)."""
            v = verdicts.get((site, role, plan.fmt, plan.scaling))
            if v is None:
                return None, "no verdict"
            fmt_b = v.fmt_b
            if fmt_b is not plan.operand_b_fmt:
                # The SQNR was measured with another operand-b format: it says nothing of this
                # plan (align probe.backward_fmt_b with dispatch.fmt_forward).
                return None, (
                    f"no verdict for operand b in {plan.operand_b_fmt.value} (the Probe measured "
                    f"{fmt_b.value}: align loka.probe.backward_fmt_b and loka.dispatch.fmt_forward)"
                )
            return v, ""

        current_unsafe = False
        unsafe_reason = ""
        if current.is_fp8:
            v, why_none = verdict_of(current)
            if v is None or not v.safe:
                current_unsafe = True
                unsafe_reason = v.reason if v is not None else f"{why_none} for the current plan"

        safe: list[tuple[float, int, GemmPlan, Any]] = []
        rejected = []
        for i, plan in enumerate(self._candidates(site, role, shape)):
            v, why_none = verdict_of(plan)
            if v is None or not v.safe:
                rejected.append(f"{plan.scaling.value}: {v.reason if v is not None else why_none}")
                continue
            t = self._estimate(role, shape, plan)
            if not math.isfinite(t):
                rejected.append(f"{plan}: its benchmark failed ({self.measure_failures.get(self._key(role, shape, plan), 'no time')})")
                continue
            safe.append((t, i, plan, v))
        t_high = self._estimate(role, shape, None)
        src = "measured" if self.timing_mode == "measure" else "cost model"
        if not safe:
            why = "; ".join(dict.fromkeys(rejected)) or f"no FP8 candidate for {role}"
            reason = f"unsafe: {unsafe_reason}" if current_unsafe else f"no safe FP8: {why}"
            return GemmPlan(), reason, current_unsafe
        t_best, _, best, v = min(safe, key=lambda x: (x[0], x[1]))
        speedup = t_high / t_best if t_best > 0 else math.inf
        shape_s = "x".join(map(str, shape))
        if self.objective == "speed" and speedup < 1.0 + self.config.margin:
            return (
                GemmPlan(),
                f"FP8 speed-up {speedup:.2f}x over high at {shape_s} ({src}) < 1+margin "
                f"{1 + self.config.margin:.2f}",
                current_unsafe,
            )
        reason = f"safe (SQNR p-lo {v.sqnr_lo_db:.1f} dB >= {v.budget_db:.1f}); speed-up {speedup:.2f}x over high at {shape_s} ({src})"
        if self.objective == "coverage" and speedup < 1.0:
            reason += "; taken for coverage although slower"
        if current_unsafe:
            reason = f"{unsafe_reason}; moved to {best} which is {reason}"
        return best, reason, current_unsafe

    def replan(self, *, step: int, verdicts: Mapping[Any, Any]) -> list[PlanChange]:
        """Re-plan every site; returns the changes applied (identical on every rank)."""
        if not self.config.enabled:
            return []
        targets: dict[tuple[str, str], tuple[GemmPlan, str, bool]] = {}
        for site in sorted(self.plans):
            for role in ROLES:
                targets[(site, role)] = self._target(site, role, verdicts)
        self._agree_on_timings(sorted(self._timings))
        # Re-evaluate with agreed timings (cheap: everything is cached now).
        for key in targets:
            targets[key] = self._target(key[0], key[1], verdicts)

        changes: list[PlanChange] = []
        for (site, role), (target, reason, urgent) in targets.items():
            current = getattr(self.plans[site], role)
            self._reasons[(site, role)] = reason
            if target == current:
                self._pending.pop((site, role), None)
                continue
            if not urgent:
                key_s, count = self._pending.get((site, role), (str(target), 0))
                count = count + 1 if key_s == str(target) else 1
                self._pending[(site, role)] = (str(target), count)
                if count < self.config.hysteresis_intervals:
                    continue
                reason = f"{reason} [held {count} intervals]"
            self._pending.pop((site, role), None)
            self.plans[site] = LinearPlan(**{**self._roles(self.plans[site]), role: target})
            change = PlanChange(step, site, role, str(current), str(target), reason)
            changes.append(change)
            logger.info("dispatch: %s", change)
        self.history.extend(changes)
        self.num_changes += len(changes)
        return changes

    def force_high(self, *, step: int, reason: str, sites: list[str] | None = None) -> list[PlanChange]:
        """Move sites (default: all) fully to high precision now (the quality guard's lever)."""
        changes = []
        for site in sorted(sites if sites is not None else self.plans):
            for role in ROLES:
                current = getattr(self.plans[site], role)
                if current.is_fp8:
                    self.plans[site] = LinearPlan(**{**self._roles(self.plans[site]), role: GemmPlan()})
                    changes.append(PlanChange(step, site, role, str(current), "high", reason))
                    self._pending.pop((site, role), None)
        for c in changes:
            logger.warning("dispatch: %s", c)
        self.history.extend(changes)
        self.num_changes += len(changes)
        return changes

    @staticmethod
    def _roles(plan: LinearPlan) -> dict[str, GemmPlan]:
        return {r: getattr(plan, r) for r in ROLES}

    # ------------------------------------------------------------------------ reports
    def fp8_coverage(self) -> float:
        """Fraction of (site, role) GEMMs currently planned in FP8."""
        total = len(self.plans) * len(ROLES)
        fp8 = sum(getattr(p, r).is_fp8 for p in self.plans.values() for r in ROLES)
        return fp8 / total if total else 0.0

    def table(self) -> str:
        """The current plan as a fixed-width text table."""
        rows = [("site", "role", "M x K x N", "plan", "why")]
        for site in sorted(self.plans):
            for role in ROLES:
                shape = self.shapes[site].get(role)
                rows.append(
                    (
                        site,
                        role,
                        "x".join(map(str, shape)) if shape else "-",
                        str(getattr(self.plans[site], role)),
                        self._reasons.get((site, role), "initial plan"),
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join(
            "  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows
        )

    def export(self) -> dict[str, Any]:
        """The plan for inference: site -> LinearPlan.to_dict() (forward is what inference uses)."""
        return {site: plan.to_dict() for site, plan in sorted(self.plans.items())}

    def state_dict(self) -> dict[str, Any]:
        return {
            "plans": self.export(),
            "shapes": {s: {r: list(v) for r, v in d.items()} for s, d in self.shapes.items()},
            "pending": {f"{s}|{r}": list(v) for (s, r), v in self._pending.items()},
            "timings": dict(self._timings),
            "timing_source": self.timing_source,
            "reasons": {f"{s}|{r}": v for (s, r), v in self._reasons.items()},
            "history": [asdict(c) for c in self.history],
            "num_changes": self.num_changes,
            "measure_failures": dict(self.measure_failures),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, step: int = 0) -> list[PlanChange]:
        """Restore :meth:`state_dict` into a dispatcher whose sites are registered.

        Restored plans are checked against the current config (a run may resume with another
        ``loka.dispatch``): a GEMM whose plan the config does not allow is reset, to the site's
        initial plan when dispatch is disabled, else to high precision (role not in
        ``fp8_roles``, scaling not in ``scalings``, backend not among this device's backends,
        formats not the configured ones, or a plan the site cannot run). Each reset is a
        :class:`PlanChange` at ``step`` (logged, counted, in the history). The site's initial
        plan and high precision are always allowed: an uninterrupted run starts from the first
        and every fallback goes to the second, so a resume with the same config changes nothing.

        Args:
            state: what :meth:`state_dict` returned.
            step: the step the resets are recorded at (the checkpoint's step).

        Returns:
            The resets (apply them to the sites like :meth:`replan`'s changes).
        """
        missing = set(state["plans"]) ^ set(self.plans)
        if missing:
            raise ValueError(
                f"dispatch state has different sites than the model ({sorted(missing)[:5]}); "
                "the model or mods config changed since the checkpoint"
            )
        initial = dict(self.plans)
        self.plans = {s: LinearPlan.from_dict(p) for s, p in state["plans"].items()}
        self.shapes = {s: {r: tuple(v) for r, v in d.items()} for s, d in state["shapes"].items()}  # type: ignore[misc]
        self._pending = {tuple(k.split("|")): (v[0], int(v[1])) for k, v in state["pending"].items()}  # type: ignore[misc]
        saved_source = state["timing_source"] if "timing_source" in state else None
        if saved_source == self.timing_source:
            self._timings = dict(state["timings"])
        else:
            # Times of another GPU, dtype or of the cost model would pass for this machine's.
            self._timings = {}
            if state["timings"]:
                logger.info(
                    "dispatch: the checkpoint's %d GEMM timings come from %s, this run times on "
                    "%s: they are measured again", len(state["timings"]), saved_source or "an older "
                    "version", self.timing_source,
                )
        self._reasons = {tuple(k.split("|")): v for k, v in state["reasons"].items()}  # type: ignore[misc]
        self.history = [PlanChange(**c) for c in state["history"]]
        self.num_changes = int(state["num_changes"])
        self.measure_failures = dict(state.get("measure_failures", {}))
        resets: list[PlanChange] = []
        for site in sorted(self.plans):
            resets += self._reset_disallowed(site, initial[site], step)
        for c in resets:
            logger.warning("dispatch: %s", c)
        self.history.extend(resets)
        self.num_changes += len(resets)
        return resets

    def _reset_disallowed(self, site: str, initial: LinearPlan, step: int) -> list[PlanChange]:
        """Reset the GEMMs of ``site`` whose restored plan the config does not allow."""
        restored = self._roles(self.plans[site])
        # Start from the plans that are always allowed, then add the others one by one, so the
        # site's whole-plan check of one role never sees another role's disallowed plan.
        kept = {
            r: p if (not p.is_fp8 or p == getattr(initial, r)) else GemmPlan()
            for r, p in restored.items()
        }
        changes = []
        for role in ROLES:
            plan = restored[role]
            if kept[role] == plan:
                continue
            target, why = self._disallowed(site, role, plan, kept, getattr(initial, role))
            if not why:
                kept[role] = plan
                continue
            kept[role] = target
            reason = f"restored from a checkpoint but not allowed by the current config: {why}"
            changes.append(PlanChange(step, site, role, str(plan), str(target), reason))
            self._reasons[(site, role)] = reason
            self._pending.pop((site, role), None)
        self.plans[site] = LinearPlan(**kept)
        return changes

    def _disallowed(
        self, site: str, role: str, plan: GemmPlan, others: dict[str, GemmPlan], initial: GemmPlan
    ) -> tuple[GemmPlan, str]:
        """(reset target, why) for an FP8 ``plan`` that is not the site's initial one; ``why``
        is empty when the config allows it."""
        cfg = self.config
        if not cfg.enabled:
            return initial, "dispatch.enabled=false keeps every site on its initial plan"
        if role not in cfg.fp8_roles:
            return GemmPlan(), f"{role} is not in dispatch.fp8_roles={list(cfg.fp8_roles)}"
        if plan.scaling.value not in cfg.scalings:
            return GemmPlan(), (
                f"{plan.scaling.value} scaling is not in dispatch.scalings={list(cfg.scalings)}"
            )
        on_cpu = self.device.type == "cpu"
        backends = cfg.cpu_backends if on_cpu else cfg.backends
        if plan.backend not in backends:
            name = "cpu_backends" if on_cpu else "backends"
            return GemmPlan(), (
                f"backend {plan.backend!r} is not in dispatch.{name}={list(backends)} "
                f"(device {self.device.type})"
            )
        fmts = f"dispatch.fmt_forward={cfg.fmt_forward}, fmt_backward={cfg.fmt_backward}"
        try:
            expected = _plan_for(cfg, role, plan.scaling.value, plan.backend)
        except ValueError as exc:
            return GemmPlan(), f"the configured formats ({fmts}) do not fit it: {exc}"
        if plan != expected:
            return GemmPlan(), f"dispatch chooses {expected} there ({fmts}), not {plan}"
        site_ok = self._site_supports.get(site)
        if site_ok is not None:
            ok, why = site_ok(LinearPlan(**{**others, role: plan}))
            if not ok:
                return GemmPlan(), f"the site cannot run it: {why}"
        return GemmPlan(), ""


__all__ = ["DispatchConfig", "Dispatcher", "GpuCostModel", "PlanChange"]
