"""The Probe: per-site FP8 statistics on a rolling window, reduced across ranks, with verdicts.

A *site* is one dense GEMM of the model (a Linear of an MLP, an interaction); each site has
three GEMMs, called *roles* here (operands as the caller passes them, contraction axes per role):

==============  ======================  =====================  =======================
role            a                       b                      result
==============  ======================  =====================  =======================
forward         ``x_MK`` (axis 1)       ``w_NK`` (axis 1)      ``y_MN = x @ w.T``
grad_input      ``dy_MN`` (axis 1)      ``w_NK`` (axis 0)      ``dx_MK = dy @ w``
grad_weight     ``dy_MN`` (axis 0)      ``x_MK`` (axis 0)      ``dw_NK = dy.T @ x``
==============  ======================  =====================  =======================

Leading dims of activations and gradients are flattened into ``M``. The ``axis`` is the
contraction axis handed to :func:`~loka_train.kernels.formats.quantize`.

Shape legend: ``M`` rows (batch), ``K`` input features, ``N`` output features, ``G`` scaling
groups, ``S`` sites, ``R`` roles (3), ``W`` window slots, ``C`` candidates.

Design choices:

* **Sampling.** :meth:`Probe.should_sample` is a pure function of the step and the site
  (every ``every_k_steps``-th step, optionally a rotating subset of ``sites_per_step`` sites;
  the first sampled step a process begins samples every site, ``prime_all_sites``), so every
  rank samples the same (site, role, step) and window slots line up across ranks.
* **Hot path.** On a sampled step :meth:`Probe.observe` computes everything on the operands'
  device and copies two small vectors into preallocated ring buffers (``W`` slots per
  site and role, one row of fields per slot). Constants are written with fill kernels; there
  is no ``.item()``, no host-to-device copy and no host sync. Non-finite inputs are counted and
  zeroed before the statistics are computed, so they never poison the buffers and never raise.
* **Row subsample.** A sample measures at most ``max_rows`` rows of an activation or
  gradient (evenly strided, plus the row holding the largest |value|, so on finite inputs
  the tensor-wise scale is the full tensor's; a row holding a non-finite value is not picked);
  non-finite values are counted on the full tensors. Those two reductions are all that reads
  the full operands: the statistics, and the CUDA graphs that compute them, see only the
  selected rows.
* **Shadow SQNR.** For each candidate (format, scaling) both operands are quantized and
  dequantized with the reference quantizers and multiplied in fp32; the error energy
  ``sum((ref - fp8)**2)`` and the signal energy ``sum(ref**2)`` are stored, not the dB value.
  Energies add across ranks, so the per-slot SQNR after the reduction is *exactly* the SQNR of
  the FP8 result over all ranks' rows together, and the quantile over the window is exact and
  identical on every rank without gathering anything. Saturation and underflow are stored as
  counts (fraction times the element / non-zero count) for the same reason.
* **Reduction.** :meth:`Probe.reduce` packs all sums (every site, role, slot and the cumulative
  non-finite counters) into one tensor for one ``all_reduce(SUM)`` and all maxima (amax,
  negated minimum row amax, observation counts) into one for one ``all_reduce(MAX)``:
  two collectives per interval, whatever the number of sites. All ranks then evaluate the
  verdicts from bit-identical reduced tensors with the same code, so they agree.
* **Exactness.** The reduced statistics equal a single process observing the rows of all ranks
  concatenated whenever the scaling groups do not span ranks: the forward and grad-input GEMMs
  with row-wise, block or MX scaling (their groups lie along K or N, within one rank's rows).
  Tensor-wise scales and the grad-weight GEMM (contraction over the rows themselves) are
  measured per rank, as each rank's FP8 kernel would compute them, and pooled by energy.
  With a row subsample (``M > max_rows``) the statistics are estimates from those rows.
* **Verdicts.** Per (site, role, format, scaling): unsafe when the window has non-finite
  values, fewer than ``min_samples`` samples, a low quantile of SQNR below the budget, or a
  saturation / underflow fraction above its limit (either operand). safe -> unsafe is immediate;
  unsafe -> safe needs ``hysteresis_intervals`` consecutive intervals with new samples that
  clear ``budget + margin_db`` (and the limits scaled down by the same ratio). The reason string
  names the failing bound, its value and its limit, plus the outlier ratio and row spread.
* **Backend timing** is left to Dispatch (the backend registry owns the kernels); the Probe
  only measures numerics.

Example:
    >>> import torch
    >>> from loka_train.probe import Probe, ProbeConfig
    >>> probe = Probe(ProbeConfig(every_k_steps=1, interval=4, min_samples=2, window=4))
    >>> probe.register_site("mlp.0", weight_shape=(8, 16))
    >>> w_NK = torch.randn(8, 16)
    >>> for step in range(4):
    ...     probe.begin_step(step)
    ...     probe.observe("mlp.0", "forward", torch.randn(32, 16), w_NK)
    >>> verdicts = probe.reduce()
    >>> sorted({k[1] for k in verdicts})
    ['forward', 'grad_input', 'grad_weight']
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from loka_train.kernels.formats import (
    SQNR_CAP_DB,
    Fp8Format,
    Scaling,
    dequantize,
    quantize,
    saturation_fraction,
    underflow_fraction,
)
from loka_train.kernels.roles import ROLES
from loka_train.probe.config import ProbeConfig

logger = logging.getLogger(__name__)

__all__ = ["Candidate", "Probe", "Verdict", "VerdictKey"]

VerdictKey = tuple[str, str, Fp8Format, Scaling]
"""(site, role, format of operand a, scaling)."""

_ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
# Contraction axes (operand a, operand b) per role, on the 2-D operands.
_ROLE_AXES = {"forward": (1, 1), "grad_input": (1, 0), "grad_weight": (0, 0)}
# Operand b is a weight (2-D tiles for block scaling) in these roles.
_B_IS_WEIGHT = {"forward": True, "grad_input": True, "grad_weight": False}
_OPERANDS = ("a", "b")
_STATE_VERSION = 1
_RESUME_FIX = "resume with the same loka config, or set trainer.resume=never"
"""How to fix a checkpointed Probe state that does not fit this run (load_state_dict errors)."""


@dataclass(frozen=True)
class Candidate:
    """One FP8 configuration the Probe evaluates for every GEMM."""

    fmt: Fp8Format
    """Format of operand a (and of b in the forward GEMM)."""
    scaling: Scaling
    """Scale granularity of both operands."""

    @property
    def name(self) -> str:
        """Short name used in metric keys, e.g. ``e4m3_rowwise``."""
        return f"{self.fmt.value}_{self.scaling.value}"


@dataclass(frozen=True)
class Verdict:
    """Whether one GEMM of one site may run with one FP8 candidate, and why.

    Fractions are in [0, 1]; dB values are NaN when nothing was measured.
    """

    site: str
    role: str
    fmt: Fp8Format
    """Format of operand a."""
    fmt_b: Fp8Format
    """Format of operand b."""
    scaling: Scaling
    safe: bool
    reason: str
    """Human-readable: the bound that failed or held, its value and its limit."""
    sqnr_lo_db: float
    """The ``quantile`` (lower-interpolated) of the per-sample SQNR over the window."""
    sqnr_median_db: float
    budget_db: float
    saturation: float
    """Upper quantile of the per-sample saturation fraction, worst operand."""
    underflow: float
    """Upper quantile of the per-sample underflow fraction, worst operand."""
    outlier_ratio: float
    """Largest amax / rms over the window, worst operand."""
    row_spread: float
    """Largest (max row amax / min non-zero row amax) over the window, worst operand."""
    amax: float
    """Largest |value| over the window, worst operand."""
    num_samples: int
    num_nonfinite: int
    """Non-finite values (Inf/NaN) in the window's operands, summed over ranks."""
    step: int
    """Step of the reduction that produced this verdict (-1: never reduced)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (enums as strings, non-finite floats as strings)."""
        out = asdict(self)
        for key in ("fmt", "fmt_b", "scaling"):
            out[key] = out[key].value
        return {k: _jsonable(v) for k, v in out.items()}


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class _Layout:
    """Field indices of one window slot: a SUM part and a MAX part."""

    def __init__(self, num_candidates: int) -> None:
        self.num_candidates = num_candidates
        idx = 0

        def take(n: int = 1) -> int:
            nonlocal idx
            start, idx = idx, idx + n
            return start

        self.count = take()
        self.numel = {o: take() for o in _OPERANDS}
        self.nnz = {o: take() for o in _OPERANDS}
        self.sumsq = {o: take() for o in _OPERANDS}
        self.nonfinite = {o: take() for o in _OPERANDS}
        self.signal = take()
        self.error = take(num_candidates)
        self.saturated = {o: take(num_candidates) for o in _OPERANDS}
        self.underflow = {o: take(num_candidates) for o in _OPERANDS}
        self.num_sum = idx
        idx = 0
        self.amax = {o: take() for o in _OPERANDS}  # also the largest row amax
        self.neg_row_min = {o: take() for o in _OPERANDS}
        self.num_max = idx


class _KeyState:
    __slots__ = ("safe", "streak")

    def __init__(self, safe: bool = False, streak: int = 0) -> None:
        self.safe = safe
        self.streak = streak


def _clean(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 copy with non-finite values zeroed, and the number of non-finite values."""
    x32 = x.detach().float()
    finite = torch.isfinite(x32)
    num_nonfinite = finite.numel() - finite.sum()
    return torch.where(finite, x32, 0.0), num_nonfinite


class _CudaGraphs:
    """Replays the measurement of each (role, operand shapes and dtypes) as one CUDA graph.

    A sample is a few hundred small kernels; launched eagerly, their CPU cost dominates
    the probe's overhead. Captured once, a replay is one launch. Its inputs are the rows that
    :func:`_select` chose (at most ``max_rows``) and the two non-finite counts, copied into
    static buffers; the full operands never enter a graph (at batch 32768 their copies were a
    large part of a sample's cost, ``bench/results/README.md``). Outputs are copied out of
    static buffers by the caller. All graphs share one memory pool: every tensor allocated
    during a capture is dead at its end (outputs are written into buffers allocated outside the pool), so replays in
    any order cannot clobber each other's live memory.

    Costs and fallbacks: a capture synchronizes the device once (``torch.cuda.graph``), on the
    first sample of each shape. Beyond ``max_graphs`` shapes, or if a capture fails, the
    measurement runs eagerly (same numbers); both are logged and counted (``num_eager``).
    """

    def __init__(self, measure, *, max_graphs: int) -> None:
        self._measure = measure
        self._max_graphs = max_graphs
        self._entries: dict[tuple, tuple[tuple[Tensor, ...], Any, Tensor, Tensor]] = {}
        self._pool: Any = None
        self.disabled_reason: str | None = None
        self.num_captures = 0
        self.num_eager = 0
        self._warned_full = False

    def run(self, role: str, *operands: Tensor) -> tuple[Tensor, Tensor]:
        key = (role, operands[0].device, *((tuple(t.shape), t.dtype) for t in operands))
        entry = self._entries.get(key)
        if entry is None:
            if self.disabled_reason is not None or len(self._entries) >= self._max_graphs:
                self.num_eager += 1
                if self.disabled_reason is None and not self._warned_full:
                    self._warned_full = True
                    logger.warning(
                        "probe: %d CUDA graphs cached (max_cuda_graphs); new shapes such as "
                        "%s/%s x %s (selected rows) are measured eagerly (slower, same numbers)",
                        self._max_graphs, role, tuple(operands[0].shape), tuple(operands[1].shape),
                    )
                return self._measure(role, *operands)
            try:
                entry = self._capture(role, operands)
            except RuntimeError as exc:
                self.disabled_reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                self.num_eager += 1
                logger.warning(
                    "probe: CUDA graph capture failed (%s); measuring eagerly from now on "
                    "(slower, same numbers)", self.disabled_reason,
                )
                return self._measure(role, *operands)
            self._entries[key] = entry
        statics, graph, out_sum, out_max = entry
        for static, given in zip(statics, operands):
            static.copy_(given)
        graph.replay()
        return out_sum, out_max

    def _capture(self, role: str, operands: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], Any, Tensor, Tensor]:
        statics = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in operands)
        device = operands[0].device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # Warm-up outside the capture (lazy inits, cuBLAS workspaces); also this sample.
            vec_sum, vec_max = self._measure(role, *statics)
            out_sum, out_max = vec_sum.clone(), vec_max.clone()
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            vec_sum, vec_max = self._measure(role, *statics)
            out_sum.copy_(vec_sum)
            out_max.copy_(vec_max)
        self.num_captures += 1
        logger.debug("probe: captured a CUDA graph for %s %s", role, [tuple(t.shape) for t in operands])
        return statics, graph, out_sum, out_max


def _select(
    role: str, a: Tensor, b: Tensor, out_ref: Tensor | None, max_rows: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The work of a sample on the full operands: their non-finite counts, and the rows to
    measure. Returns ``(a, b, nf_a, nf_b, out_ref)`` with ``a`` (and ``b`` for grad-weight,
    ``out_ref`` for the other roles) cut to those rows. The full operands are read by the
    counts (:func:`_count_nonfinite`) and, when rows are subsampled, by the peak search
    (one reduction each over ``a``, and ``b`` for grad-weight); the statistics then read only
    the selected rows."""
    # Non-finite values are counted on the full operands: none may slip past a subsample.
    nf_a, nf_b = _count_nonfinite(a), _count_nonfinite(b)
    rows = _row_subsample(role, a, b, max_rows)
    if rows is not None:
        a = a.index_select(0, rows)
        if role == "grad_weight":
            b = b.index_select(0, rows)
        if out_ref is not None and role != "grad_weight":
            out_ref = out_ref.reshape(-1, out_ref.shape[-1]).index_select(0, rows)
        else:
            out_ref = None
    return a, b, nf_a, nf_b, out_ref


def _count_nonfinite(x: Tensor) -> Tensor:
    """How many values of `x` are inf or NaN (an int64 tensor on `x`'s device, no host sync).

    ``x * 0.0`` is (signed) zero exactly where `x` is finite and NaN elsewhere; on CUDA
    ``count_nonzero`` is a ``ne`` and a ``sum``. So three passes, two of them full-size writes
    of a bool or of `x`'s dtype, where ``numel - isfinite(x).sum()`` took five (``isfinite`` is
    ``abs``, ``ne``, ``eq`` and ``mul`` on the H100: 0.6 ms a step of a 3-step window of DCN at
    32768, 2026-11-25). The float zero matters: inductor folds ``x * 0`` with an integer zero
    to zeros, which would count nothing under ``torch.compile``."""
    return torch.count_nonzero(x.detach().mul(0.0))


def _row_subsample(role: str, a: Tensor, b: Tensor, max_rows: int | None) -> Tensor | None:
    """Indices of at most ``max_rows`` rows (M) to measure on, or None for all rows.

    Evenly strided rows plus the row holding the largest |value| of ``a`` (and of ``b`` for
    grad-weight, whose operands share M), so the tensor-wise amax, and with it the tensor-wise
    scale, is the full tensor's on finite inputs. Each row's peak is one reduction over the
    operand (no full-size temporary); a row holding a non-finite value is not picked
    (non-finite values are counted on the full tensor anyway). Device ops only (argmax stays on the device).
    """
    num_rows = a.shape[0]
    if max_rows is None or num_rows <= max_rows:
        return None
    extra = [a]
    if role == "grad_weight":
        extra.append(b)
    stride = -(-num_rows // (max_rows - len(extra)))
    strided = torch.arange(0, num_rows, stride, device=a.device)
    peaks = [
        torch.nan_to_num(torch.linalg.vector_norm(x.detach(), ord=math.inf, dim=1), nan=0.0, posinf=0.0)
        .argmax()
        .reshape(1)
        for x in extra
    ]
    return torch.cat([strided, *peaks])


def _gemm(role: str, a: Tensor, b: Tensor) -> Tensor:
    if role == "forward":
        return a @ b.T
    if role == "grad_input":
        return a @ b
    return a.T @ b


class Probe:
    """Online FP8 statistics per site and GEMM, with cross-rank reduction and verdicts.

    Args:
        config: what to measure and how to judge it.
        device: where the statistics buffers live; must be the device of the observed
            tensors (the trainer's device).

    Example:
        >>> probe = Probe(ProbeConfig(every_k_steps=10))
        >>> probe.register_site("top.0", weight_shape=(64, 128))
        >>> probe.should_sample(20, "top.0"), probe.should_sample(21, "top.0")
        (True, False)
    """

    def __init__(self, config: ProbeConfig, *, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report their index; compare against the concrete device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.candidates: tuple[Candidate, ...] = tuple(
            Candidate(fmt, scaling) for fmt in config.formats for scaling in config.scalings
        )
        self._layout = _Layout(len(self.candidates))
        self._sites: list[str] = []
        self._site_index: dict[str, int] = {}
        self._weight_shapes: dict[str, tuple[int, int] | None] = {}
        self._budgets: dict[str, dict[str, float]] = {}
        self._step = 0
        self._prime_step: int | None = None
        """The first sampled step this process began (``prime_all_sites``): every site samples."""
        W = config.window
        L = self._layout
        self._local_sum = torch.zeros(0, len(ROLES), W, L.num_sum, dtype=torch.float64, device=self.device)
        self._local_max = torch.full(
            (0, len(ROLES), W, L.num_max), -math.inf, dtype=torch.float64, device=self.device
        )
        self._local_nonfinite_total = torch.zeros(0, len(ROLES), dtype=torch.float64, device=self.device)
        self._num_obs: list[list[int]] = []
        self._slot_steps: list[list[list[int]]] = []
        # Reduced (global) copies on the host, refreshed by reduce().
        self._global_sum: Tensor | None = None
        self._global_max: Tensor | None = None
        self._global_nonfinite_total: Tensor | None = None
        self._num_obs_at_last_reduce: list[list[int]] = []
        self._nonfinite_seen: list[list[float]] = []
        self._key_state: dict[VerdictKey, _KeyState] = {}
        self._verdicts: dict[VerdictKey, Verdict] = {}
        self.history: list[dict[str, Any]] = []
        """Verdict changes: step, site, role, fmt, scaling, safe, reason."""
        self.events: list[dict[str, Any]] = []
        """Logged, counted events (non-finite values, misaligned windows)."""
        self.series: dict[str, list[tuple[int, float]]] = {}
        """Per ``site/role/candidate``: (step, SQNR low quantile) at every reduction."""
        self.num_nonfinite_events = 0
        self.num_misaligned_events = 0
        self._graphs: _CudaGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            self._graphs = _CudaGraphs(self._measure_selected, max_graphs=config.max_cuda_graphs)
        self.num_reduces = 0
        self.num_verdict_changes = 0

    # ------------------------------------------------------------------ registration

    @property
    def sites(self) -> tuple[str, ...]:
        """Registered site names, in registration order."""
        return tuple(self._sites)

    def register_site(
        self,
        name: str,
        *,
        weight_shape: tuple[int, int] | None = None,
        sqnr_budget_db: Mapping[str, float] | None = None,
    ) -> None:
        """Add a site and allocate its window buffers (never on the hot path).

        Args:
            name: unique site name (usually the module's fully qualified name).
            weight_shape: ``(N, K)`` of the weight, checked on every observation when given.
            sqnr_budget_db: per-role overrides of ``config.sqnr_budget_db``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"site name must be a non-empty string, got {name!r}")
        if name in self._site_index:
            raise ValueError(f"site {name!r} is already registered")
        if weight_shape is not None:
            weight_shape = tuple(int(d) for d in weight_shape)  # type: ignore[assignment]
            if len(weight_shape) != 2 or min(weight_shape) <= 0:
                raise ValueError(f"weight_shape must be (N, K) with N, K > 0, got {weight_shape}")
        budgets = dict(self.config.sqnr_budget_db)
        if sqnr_budget_db is not None:
            unknown = set(sqnr_budget_db) - set(ROLES)
            if unknown:
                raise ValueError(f"sqnr_budget_db has unknown roles {sorted(unknown)}; use {ROLES}")
            budgets.update({k: float(v) for k, v in sqnr_budget_db.items()})
        self._site_index[name] = len(self._sites)
        self._sites.append(name)
        self._weight_shapes[name] = weight_shape  # type: ignore[assignment]
        self._budgets[name] = budgets
        W, L, R = self.config.window, self._layout, len(ROLES)
        new_sum = torch.zeros(1, R, W, L.num_sum, dtype=torch.float64, device=self.device)
        new_max = torch.full((1, R, W, L.num_max), -math.inf, dtype=torch.float64, device=self.device)
        self._local_sum = torch.cat([self._local_sum, new_sum])
        self._local_max = torch.cat([self._local_max, new_max])
        self._local_nonfinite_total = torch.cat(
            [self._local_nonfinite_total, torch.zeros(1, R, dtype=torch.float64, device=self.device)]
        )
        self._num_obs.append([0] * R)
        self._slot_steps.append([[-1] * W for _ in range(R)])
        self._num_obs_at_last_reduce.append([0] * R)
        self._nonfinite_seen.append([0.0] * R)
        # Reduced copies must be recomputed with the new shape.
        self._global_sum = self._global_max = self._global_nonfinite_total = None

    def _index(self, site: str) -> int:
        try:
            return self._site_index[site]
        except KeyError:
            raise ValueError(
                f"unknown site {site!r}; call register_site first (known: {self._sites})"
            ) from None

    # ------------------------------------------------------------------ sampling

    def begin_step(self, step: int) -> None:
        """Set the current training step (call at the start of every step)."""
        self._step = int(step)
        cfg = self.config
        if self._prime_step is None and cfg.prime_all_sites and self._step % cfg.every_k_steps == 0:
            self._prime_step = self._step

    @property
    def step(self) -> int:
        """The current step (see :meth:`begin_step`)."""
        return self._step

    def should_sample(self, step: int, site: str) -> bool:
        """Whether ``site`` is measured on ``step`` (host-only, identical on every rank)."""
        cfg = self.config
        i = self._index(site)
        if not cfg.enabled or step % cfg.every_k_steps != 0:
            return False
        num_sites = len(self._sites)
        n = cfg.sites_per_step
        if n is None or n >= num_sites or step == self._prime_step:
            return True
        offset = ((step // cfg.every_k_steps) * n) % num_sites
        return (i - offset) % num_sites < n

    def should_reduce(self, step: int) -> bool:
        """Whether the window is reduced (and verdicts updated) after ``step``."""
        return (step + 1) % self.config.interval == 0

    # ------------------------------------------------------------------ hot path

    def observe(self, site: str, role: str, a: Tensor, b: Tensor, out_ref: Tensor | None = None) -> None:
        """Record the statistics of one GEMM if ``site`` is sampled at the current step.

        Never syncs with the host and never raises on non-finite data (it is counted).

        Args:
            site: a registered site.
            role: ``forward`` (a=x, b=W), ``grad_input`` (a=dY, b=W) or ``grad_weight``
                (a=dY, b=X); see the module docstring for the contraction axes.
            a: first operand; leading dims are flattened into rows.
            b: second operand.
            out_ref: optional bias-free high-precision GEMM result (saves one fp32 GEMM).
        """
        if not self.should_sample(self._step, site):
            return
        self._record(site, role, a, b, out_ref, self._step)

    def observe_forward(self, site: str, x: Tensor, weight: Tensor, out_ref: Tensor | None = None) -> None:
        """Forward GEMM ``y = x @ weight.T`` (call from a site's forward)."""
        self.observe(site, "forward", x, weight, out_ref)

    def observe_backward(self, site: str, grad_out: Tensor, x: Tensor, weight: Tensor) -> None:
        """Both backward GEMMs from ``dY``, the saved input and the weight (call from a backward hook)."""
        if not self.should_sample(self._step, site):
            return
        self._record(site, "grad_input", grad_out, weight, None, self._step)
        self._record(site, "grad_weight", grad_out, x, None, self._step)

    def attach(self, module: nn.Module, site: str) -> RemovableHandle:
        """Observe a ``y = x @ module.weight.T (+ bias)`` module with hooks.

        Registers the site if needed. On sampled steps the forward hook records the forward
        GEMM and puts a hook on the output's gradient that records both backward GEMMs (at the
        step of the forward). On other steps, and for forwards that do not train (module in
        eval mode or autograd off, as in evaluation), the hook costs one host-side check.

        Returns:
            The forward hook's handle (``.remove()`` detaches the probe).

        Example:
            >>> probe = Probe(ProbeConfig(every_k_steps=1))
            >>> handle = probe.attach(torch.nn.Linear(16, 8), "mlp.0")
        """
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"attach needs a module with a 2-D .weight, got {type(module).__name__}")
        if site not in self._site_index:
            self.register_site(site, weight_shape=tuple(weight.shape))  # type: ignore[arg-type]

        def forward_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            step = self._step
            # Evaluation forwards (eval mode or no autograd) run between steps with the
            # Probe's step unchanged; they must not take the slots of a sampled step.
            if (
                not args
                or not mod.training
                or not torch.is_grad_enabled()
                or not self.should_sample(step, site)
            ):
                return
            x = args[0]
            w = mod.weight
            assert isinstance(w, Tensor)
            self._record(site, "forward", x, w, None, step)
            if isinstance(output, Tensor) and output.requires_grad:
                x_saved = x.detach()

                def grad_hook(grad_out: Tensor) -> None:
                    self._record(site, "grad_input", grad_out, w, None, step)
                    self._record(site, "grad_weight", grad_out, x_saved, None, step)

                output.register_hook(grad_hook)

        return module.register_forward_hook(forward_hook)

    def _as_2d(self, site: str, role: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        if role not in _ROLE_INDEX:
            raise ValueError(f"unknown GEMM role {role!r}; use one of {ROLES}")
        if a.dim() < 1 or b.dim() < 1:
            raise ValueError(f"{site}/{role}: operands must have at least one dim")
        a2 = a.reshape(-1, a.shape[-1])
        if role == "grad_weight":
            b2 = b.reshape(-1, b.shape[-1])
            if a2.shape[0] != b2.shape[0]:
                raise ValueError(
                    f"{site}/grad_weight: dY has {a2.shape[0]} rows but X has {b2.shape[0]}"
                )
        else:
            if b.dim() != 2:
                raise ValueError(f"{site}/{role}: the weight must be 2-D, got {tuple(b.shape)}")
            b2 = b
            expected = self._weight_shapes[site]
            if expected is not None and tuple(b2.shape) != expected:
                raise ValueError(
                    f"{site}/{role}: weight shape {tuple(b2.shape)} != registered {expected}"
                )
            contraction_b = b2.shape[1] if role == "forward" else b2.shape[0]
            if a2.shape[1] != contraction_b:
                raise ValueError(
                    f"{site}/{role}: contraction mismatch {tuple(a.shape)} vs {tuple(b.shape)}"
                )
        return a2, b2

    def _record(
        self, site: str, role: str, a: Tensor, b: Tensor, out_ref: Tensor | None, step: int
    ) -> None:
        idx = self._index(site)
        for t in (a, b):
            if t.device != self.device:
                raise ValueError(
                    f"{site}/{role}: operand on {t.device} but the probe's buffers are on "
                    f"{self.device}; construct Probe(device=...) with the training device"
                )
        a2, b2 = self._as_2d(site, role, a, b)
        if a2.numel() == 0 or b2.numel() == 0:
            logger.debug("probe: %s/%s step %d has an empty operand; nothing recorded", site, role, step)
            return
        with torch.no_grad(), record_function("loka/probe/observe"):
            if self._graphs is not None and out_ref is None:
                # The full operands are read here (counts, peak rows); the graph gets the rows.
                a_rows, b_rows, nf_a, nf_b, _ = _select(role, a2, b2, None, self.config.max_rows)
                vec_sum, vec_max = self._graphs.run(role, a_rows, b_rows, nf_a, nf_b)
            else:
                vec_sum, vec_max = self._measure(role, a2, b2, out_ref)
            r = _ROLE_INDEX[role]
            n = self._num_obs[idx][r]
            slot = n % self.config.window
            self._local_sum[idx, r, slot].copy_(vec_sum)
            self._local_max[idx, r, slot].copy_(vec_max)
            L = self._layout
            self._local_nonfinite_total[idx, r] += vec_sum[L.nonfinite["a"]] + vec_sum[L.nonfinite["b"]]
        self._num_obs[idx][r] = n + 1
        self._slot_steps[idx][r][slot] = step

    def _fmt_b(self, role: str, fmt: Fp8Format) -> Fp8Format:
        fmt_b = self.config.backward_fmt_b
        return fmt if role == "forward" or fmt_b is None else fmt_b

    def _measure(self, role: str, a: Tensor, b: Tensor, out_ref: Tensor | None) -> tuple[Tensor, Tensor]:
        """All statistics of one GEMM as (SUM vector, MAX vector), on the device."""
        return self._measure_selected(role, *_select(role, a, b, out_ref, self.config.max_rows))

    def _measure_selected(
        self, role: str, a: Tensor, b: Tensor, nf_a: Tensor, nf_b: Tensor, out_ref: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`_measure` on the rows :func:`_select` chose (what the CUDA graphs capture)."""
        # Hooks run inside the model's autocast region: the shadow GEMMs must stay in fp32.
        with torch.autocast(device_type=a.device.type, enabled=False):
            return self._measure_fp32(role, a, b, nf_a, nf_b, out_ref)

    def _measure_fp32(
        self, role: str, a: Tensor, b: Tensor, nf_a: Tensor, nf_b: Tensor, out_ref: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        L, cfg = self._layout, self.config
        ax_a, ax_b = _ROLE_AXES[role]
        a_c, _ = _clean(a)
        b_c, _ = _clean(b)
        if out_ref is None:
            ref = _gemm(role, a_c, b_c)
        else:
            ref, _ = _clean(out_ref.reshape(-1, out_ref.shape[-1]))
        dev = a_c.device
        sums: list[Tensor | None] = [None] * L.num_sum
        maxes: list[Tensor | None] = [None] * L.num_max
        # Fill kernels, not host-to-device copies: nothing here waits for the device.
        sums[L.count] = torch.ones((), device=dev)
        sums[L.signal] = ref.square().sum()
        operands = {"a": (a_c, nf_a, ax_a), "b": (b_c, nf_b, ax_b)}
        nnz: dict[str, Tensor] = {}
        for o, (x, nf, axis) in operands.items():
            row_amax_G = x.abs().amax(dim=axis)
            nnz[o] = (x != 0).sum().float()
            sums[L.numel[o]] = torch.full((), float(x.numel()), device=dev)
            sums[L.nnz[o]] = nnz[o]
            sums[L.sumsq[o]] = x.square().sum()
            sums[L.nonfinite[o]] = nf.float()
            maxes[L.amax[o]] = row_amax_G.amax()
            maxes[L.neg_row_min[o]] = -torch.where(row_amax_G > 0, row_amax_G, math.inf).amin()
        # Quantized operands and their counts, shared by candidates with the same (format,
        # scaling) for an operand (operand b of the backward GEMMs has one format).
        cache: dict[tuple[str, Fp8Format, Scaling], tuple[Tensor, Tensor, Tensor]] = {}

        def quantized(o: str, fmt: Fp8Format, scaling: Scaling) -> tuple[Tensor, Tensor, Tensor]:
            hit = cache.get((o, fmt, scaling))
            if hit is not None:
                return hit
            x, _, axis = operands[o]
            kw: dict[str, Any] = {}
            if scaling is Scaling.BLOCK:
                kw = {"block_size": cfg.block_size, "block_2d": o == "b" and _B_IS_WEIGHT[role]}
            q = quantize(x, fmt, scaling, axis=axis, **kw)
            sat = saturation_fraction(x, fmt, scaling, axis=axis, scale=q.scale, **kw)
            und = underflow_fraction(x, fmt, scaling, axis=axis, scale=q.scale, **kw)
            cache[(o, fmt, scaling)] = out = (dequantize(q), sat * x.numel(), und * nnz[o])
            return out

        for c, cand in enumerate(self.candidates):
            deq_a, sat_a, und_a = quantized("a", cand.fmt, cand.scaling)
            deq_b, sat_b, und_b = quantized("b", self._fmt_b(role, cand.fmt), cand.scaling)
            sums[L.error + c] = (ref - _gemm(role, deq_a, deq_b)).square().sum()
            sums[L.saturated["a"] + c], sums[L.underflow["a"] + c] = sat_a, und_a
            sums[L.saturated["b"] + c], sums[L.underflow["b"] + c] = sat_b, und_b
        assert all(t is not None for t in sums) and all(t is not None for t in maxes)
        vec_sum = torch.stack([t.float() for t in sums])  # type: ignore[union-attr]
        vec_max = torch.stack([t.float() for t in maxes])  # type: ignore[union-attr]
        return vec_sum.to(torch.float64), vec_max.to(torch.float64)

    # ------------------------------------------------------------------ reduction

    def reduce(self, process_group: dist.ProcessGroup | None = None) -> dict[VerdictKey, Verdict]:
        """Reduce the windows across ranks and update the verdicts (one interval).

        Two collectives (one SUM, one MAX) for all sites together, then two small
        device-to-host copies; call it every ``interval`` steps (see :meth:`should_reduce`) on
        every rank, with the same sites registered in the same order everywhere (the packed
        tensors must have the same layout on all ranks).

        Args:
            process_group: the group to reduce over; None = the default group when
                ``torch.distributed`` is initialized, else this process alone.

        Returns:
            The verdicts (as :meth:`verdicts`).
        """
        with torch.no_grad(), record_function("loka/probe/reduce"):
            S, R = len(self._sites), len(ROLES)
            obs = torch.tensor(self._num_obs, dtype=torch.float64).reshape(S, R).to(self.device)
            sum_pack = torch.cat([self._local_sum.flatten(), self._local_nonfinite_total.flatten()])
            max_pack = torch.cat([self._local_max.flatten(), obs.flatten(), -obs.flatten()])
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
                dist.all_reduce(sum_pack, op=dist.ReduceOp.SUM, group=process_group)
                dist.all_reduce(max_pack, op=dist.ReduceOp.MAX, group=process_group)
            sum_pack, max_pack = sum_pack.cpu(), max_pack.cpu()
            n_sum, n_max = self._local_sum.numel(), self._local_max.numel()
            self._global_sum = sum_pack[:n_sum].reshape(self._local_sum.shape)
            self._global_nonfinite_total = sum_pack[n_sum:].reshape(S, R)
            self._global_max = max_pack[:n_max].reshape(self._local_max.shape)
            obs_max = max_pack[n_max : n_max + S * R].reshape(S, R)
            obs_min = -max_pack[n_max + S * R :].reshape(S, R)
        self.num_reduces += 1
        self._check_alignment(obs_max, obs_min)
        self._count_nonfinite_events()
        self._update_verdicts([[int(n) for n in row] for row in obs_max.tolist()])
        return self.verdicts()

    def _check_alignment(self, obs_max: Tensor, obs_min: Tensor) -> None:
        mismatch = (obs_max != obs_min).nonzero().tolist()
        for s, r in mismatch:
            self.num_misaligned_events += 1
            event = {
                "kind": "misaligned",
                "step": self._step,
                "site": self._sites[s],
                "role": ROLES[r],
                "min_observations": int(obs_min[s, r]),
                "max_observations": int(obs_max[s, r]),
            }
            self.events.append(event)
            logger.warning(
                "probe: ranks observed %s/%s %d..%d times; window slots of different steps "
                "are being pooled (every rank must run the same sampled GEMMs)",
                self._sites[s], ROLES[r], event["min_observations"], event["max_observations"],
            )

    def _count_nonfinite_events(self) -> None:
        assert self._global_nonfinite_total is not None
        for s, site in enumerate(self._sites):
            for r, role in enumerate(ROLES):
                total = float(self._global_nonfinite_total[s, r])
                new = total - self._nonfinite_seen[s][r]
                if new > 0:
                    self.num_nonfinite_events += 1
                    self.events.append(
                        {"kind": "nonfinite", "step": self._step, "site": site, "role": role, "count": int(new)}
                    )
                    logger.warning(
                        "probe: %d non-finite values (Inf/NaN) in %s/%s operands since the last "
                        "reduction (step %d); its FP8 verdicts are unsafe until they leave the "
                        "window (event %d)",
                        int(new), site, role, self._step, self.num_nonfinite_events,
                    )
                self._nonfinite_seen[s][r] = total

    # ------------------------------------------------------------------ statistics

    def window_stats(self, site: str, role: str) -> dict[str, Tensor]:
        """Per-slot statistics of the reduced window of one GEMM (host tensors, slot order).

        Keys: ``valid`` [W] bool, ``step`` [W], ``count`` [W] (ranks that contributed),
        ``sqnr_db`` [W, C] (C candidates, order of :attr:`candidates`), and per operand
        ``o`` in (a, b): ``saturation_o`` / ``underflow_o`` [W, C], ``amax_o``,
        ``outlier_ratio_o``, ``row_spread_o``, ``nonfinite_o`` [W].

        Raises:
            ValueError: before the first :meth:`reduce` since the site was registered.
        """
        if self._global_sum is None or self._global_max is None:
            raise ValueError("no reduced window yet: call reduce() first")
        s, r = self._index(site), _ROLE_INDEX[role]
        out = self._derive(self._global_sum[s, r], self._global_max[s, r])
        out["step"] = torch.tensor(self._slot_steps[s][r], dtype=torch.int64)
        return out

    def _derive(self, gs: Tensor, gm: Tensor) -> dict[str, Tensor]:
        """Per-slot statistics from reduced slots ``gs`` [..., W, num_sum], ``gm`` [..., W, num_max]."""
        L = self._layout
        C = len(self.candidates)
        out: dict[str, Tensor] = {}
        out["count"] = gs[..., L.count]
        out["valid"] = gs[..., L.count] > 0
        signal = gs[..., L.signal : L.signal + 1]
        error = gs[..., L.error : L.error + C]
        sqnr = 10.0 * (torch.log10(signal) - torch.log10(error))
        sqnr = sqnr.clamp(-SQNR_CAP_DB, SQNR_CAP_DB)
        out["sqnr_db"] = torch.where(error == 0, torch.full_like(sqnr, SQNR_CAP_DB), sqnr)
        for o in _OPERANDS:
            numel = gs[..., L.numel[o]].clamp_min(1.0)
            nnz = gs[..., L.nnz[o]].clamp_min(1.0)
            out[f"saturation_{o}"] = gs[..., L.saturated[o] : L.saturated[o] + C] / numel[..., None]
            out[f"underflow_{o}"] = gs[..., L.underflow[o] : L.underflow[o] + C] / nnz[..., None]
            amax = gm[..., L.amax[o]]
            rms = (gs[..., L.sumsq[o]] / numel).sqrt()
            out[f"amax_{o}"] = amax
            out[f"outlier_ratio_{o}"] = torch.where(rms > 0, amax / rms, torch.ones_like(amax))
            row_max, row_min = amax, -gm[..., L.neg_row_min[o]]
            ok = torch.isfinite(row_min) & (row_min > 0)
            out[f"row_spread_{o}"] = torch.where(ok, row_max / torch.where(ok, row_min, 1.0), 1.0)
            out[f"nonfinite_{o}"] = gs[..., L.nonfinite[o]]
        return out

    # ------------------------------------------------------------------ verdicts

    def _update_verdicts(self, num_obs_reduced: list[list[int]]) -> None:
        """Verdicts from the reduced windows. ``num_obs_reduced``: observations per (site,
        role), the MAX over ranks: whether an interval brought new data is decided from it,
        not from this rank's own count, so a rank that sampled nothing in an interval (an empty
        operand) still advances every hysteresis streak in step with the others."""
        cfg = self.config
        assert self._global_sum is not None and self._global_max is not None
        relax = 10.0 ** (-cfg.margin_db / 10.0)
        q = cfg.quantile
        # All sites and roles at once on the host copies ([S, R, W, ...]), then one .tolist()
        # per statistic: the Python loop below only compares numbers and formats strings.
        d = self._derive(self._global_sum, self._global_max)
        valid = d["valid"]
        num_samples_all = valid.sum(-1).tolist()
        lo_all = _masked_quantile(d["sqnr_db"], valid, q, higher=False).tolist()
        med_all = _masked_quantile(d["sqnr_db"], valid, 0.5, higher=False).tolist()
        sat_all = {
            o: _masked_quantile(d[f"saturation_{o}"], valid, 1 - q, higher=True).tolist() for o in _OPERANDS
        }
        und_all = {
            o: _masked_quantile(d[f"underflow_{o}"], valid, 1 - q, higher=True).tolist() for o in _OPERANDS
        }
        outlier_all = {o: _masked_max(d[f"outlier_ratio_{o}"], valid).tolist() for o in _OPERANDS}
        spread_all = {o: _masked_max(d[f"row_spread_{o}"], valid).tolist() for o in _OPERANDS}
        amax_all = {o: _masked_max(d[f"amax_{o}"], valid).tolist() for o in _OPERANDS}
        nonfinite_all = {
            o: torch.where(valid, d[f"nonfinite_{o}"], 0.0).sum(-1).tolist() for o in _OPERANDS
        }
        for s, site in enumerate(self._sites):
            for r, role in enumerate(ROLES):
                num_samples = int(num_samples_all[s][r])
                new_data = num_obs_reduced[s][r] != self._num_obs_at_last_reduce[s][r]
                self._num_obs_at_last_reduce[s][r] = num_obs_reduced[s][r]
                budget = self._budgets[site][role]
                outlier = {o: outlier_all[o][s][r] for o in _OPERANDS}
                spread = {o: spread_all[o][s][r] for o in _OPERANDS}
                nonfinite = {o: int(nonfinite_all[o][s][r]) for o in _OPERANDS}
                amax = _nan_max(amax_all["a"][s][r], amax_all["b"][s][r])
                context = (
                    f"outlier ratio (max/rms) a {outlier['a']:.3g}, b {outlier['b']:.3g}; "
                    f"row amax spread a {spread['a']:.3g}, b {spread['b']:.3g}"
                )
                for c, cand in enumerate(self.candidates):
                    key: VerdictKey = (site, role, cand.fmt, cand.scaling)
                    fmt_b = self._fmt_b(role, cand.fmt)
                    where = f"{cand.scaling.value} {cand.fmt.value}x{fmt_b.value}"
                    lo, med = lo_all[s][r][c], med_all[s][r][c]
                    sat_o = {o: sat_all[o][s][r][c] for o in _OPERANDS}
                    und_o = {o: und_all[o][s][r][c] for o in _OPERANDS}
                    sat_worst = _worst_operand(sat_o)
                    und_worst = _worst_operand(und_o)
                    sat, und = sat_o[sat_worst], und_o[und_worst]
                    qname = f"p{100 * q:g}"
                    failures: list[str] = []
                    if not cfg.enabled:
                        failures.append("probe disabled")
                    if nonfinite["a"] or nonfinite["b"]:
                        failures.append(
                            f"non-finite values in the window (a {nonfinite['a']}, b {nonfinite['b']})"
                        )
                    if num_samples < cfg.min_samples:
                        failures.append(f"{num_samples} samples < min_samples {cfg.min_samples}")
                    if num_samples and lo < budget:
                        failures.append(f"sqnr {qname} {lo:.1f} dB < budget {budget:.1f} dB")
                    if num_samples and sat > cfg.max_saturation_fraction:
                        failures.append(
                            f"saturation {sat:.2%} > {cfg.max_saturation_fraction:.2%} at {where} "
                            f"(operand {sat_worst})"
                        )
                    if num_samples and und > cfg.max_underflow_fraction:
                        failures.append(
                            f"underflow {und:.2%} > {cfg.max_underflow_fraction:.2%} at {where} "
                            f"(operand {und_worst})"
                        )
                    measured = (
                        f"sqnr {qname} {lo:.1f} dB vs budget {budget:.1f} dB; saturation {sat:.2%}, "
                        f"underflow {und:.2%} at {where}"
                    )
                    clear = (
                        not failures
                        and lo >= budget + cfg.margin_db
                        and sat <= cfg.max_saturation_fraction * relax
                        and und <= cfg.max_underflow_fraction * relax
                    )
                    state = self._key_state.setdefault(key, _KeyState())
                    was_safe = state.safe
                    if failures:
                        state.safe, state.streak = False, 0
                        reason = "unsafe: " + "; ".join(failures) + f"; {context}"
                    elif state.safe:
                        reason = f"safe: {measured}; {context}"
                    elif clear:
                        if new_data:
                            state.streak += 1
                        if state.streak >= cfg.hysteresis_intervals:
                            state.safe, state.streak = True, 0
                            reason = f"safe: {measured}; {context}"
                        else:
                            reason = (
                                f"unsafe (hysteresis): bounds clear for {state.streak}/"
                                f"{cfg.hysteresis_intervals} intervals; {measured}; {context}"
                            )
                    else:
                        state.streak = 0
                        reason = (
                            f"unsafe (hysteresis): within the {cfg.margin_db:g} dB margin; "
                            f"{measured}; {context}"
                        )
                    verdict = Verdict(
                        site=site,
                        role=role,
                        fmt=cand.fmt,
                        fmt_b=fmt_b,
                        scaling=cand.scaling,
                        safe=state.safe,
                        reason=reason,
                        sqnr_lo_db=lo,
                        sqnr_median_db=med,
                        budget_db=budget,
                        saturation=sat,
                        underflow=und,
                        outlier_ratio=max(outlier.values(), key=_nan_low),
                        row_spread=max(spread.values(), key=_nan_low),
                        amax=amax,
                        num_samples=num_samples,
                        num_nonfinite=nonfinite["a"] + nonfinite["b"],
                        step=self._step,
                    )
                    self._verdicts[key] = verdict
                    self.series.setdefault(f"{site}/{role}/{cand.name}", []).append((self._step, lo))
                    if verdict.safe != was_safe:
                        self._record_change(verdict)

    def _record_change(self, verdict: Verdict) -> None:
        self.num_verdict_changes += 1
        self.history.append(
            {
                "step": verdict.step,
                "site": verdict.site,
                "role": verdict.role,
                "fmt": verdict.fmt.value,
                "scaling": verdict.scaling.value,
                "safe": verdict.safe,
                "reason": verdict.reason,
            }
        )
        # Every flip is in `history` and the report; Dispatch logs the plan changes it causes.
        logger.debug(
            "probe: %s/%s %s/%s -> %s at step %d: %s",
            verdict.site, verdict.role, verdict.fmt.value, verdict.scaling.value,
            "safe" if verdict.safe else "unsafe", verdict.step, verdict.reason,
        )

    def verdicts(self) -> dict[VerdictKey, Verdict]:
        """Current verdict per (site, role, fmt, scaling); unsafe until first judged."""
        out: dict[VerdictKey, Verdict] = {}
        for site in self._sites:
            for role in ROLES:
                for cand in self.candidates:
                    key = (site, role, cand.fmt, cand.scaling)
                    out[key] = self._verdicts.get(key) or self._unjudged(key)
        return out

    def verdict(self, site: str, role: str, fmt: Fp8Format | str, scaling: Scaling | str) -> Verdict:
        """One verdict; ``fmt`` and ``scaling`` may be given as strings ("e4m3", "rowwise")."""
        key = (site, role, Fp8Format(fmt), Scaling(scaling))
        if key[0] not in self._site_index or role not in _ROLE_INDEX:
            raise ValueError(f"unknown site/role {site!r}/{role!r}")
        if Candidate(key[2], key[3]) not in self.candidates:
            raise ValueError(f"{key[2].value}/{key[3].value} is not a configured candidate")
        return self._verdicts.get(key) or self._unjudged(key)

    def _unjudged(self, key: VerdictKey) -> Verdict:
        site, role, fmt, scaling = key
        fmt_b = self._fmt_b(role, fmt)
        return Verdict(
            site=site, role=role, fmt=fmt, fmt_b=fmt_b, scaling=scaling, safe=False,
            reason="unsafe: not measured yet (no reduction since the site was registered)",
            sqnr_lo_db=math.nan, sqnr_median_db=math.nan, budget_db=self._budgets[site][role],
            saturation=math.nan, underflow=math.nan, outlier_ratio=math.nan, row_spread=math.nan,
            amax=math.nan, num_samples=0, num_nonfinite=0, step=-1,
        )

    # ------------------------------------------------------------------ reporting

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics logger, keys ``probe/<site>/<role>/<stat>[/<candidate>]``."""
        out: dict[str, float] = {
            "probe/nonfinite_events": float(self.num_nonfinite_events),
            "probe/misaligned_events": float(self.num_misaligned_events),
            "probe/verdict_changes": float(self.num_verdict_changes),
        }
        for (site, role, fmt, scaling), v in self._verdicts.items():
            name = Candidate(fmt, scaling).name
            prefix = f"probe/{site}/{role}"
            out[f"{prefix}/sqnr_db/{name}"] = v.sqnr_lo_db
            out[f"{prefix}/safe/{name}"] = float(v.safe)
            out[f"{prefix}/underflow/{name}"] = v.underflow
            out[f"{prefix}/saturation/{name}"] = v.saturation
            out[f"{prefix}/outlier_ratio"] = v.outlier_ratio
            out[f"{prefix}/row_spread"] = v.row_spread
            out[f"{prefix}/amax"] = v.amax
            out[f"{prefix}/nonfinite"] = float(v.num_nonfinite)
        return out

    def report(self) -> dict[str, Any]:
        """Everything a run report needs, JSON-able (``json.dumps`` works on it)."""
        cfg = self.config
        return {
            "step": self._step,
            "num_reduces": self.num_reduces,
            "config": {
                "enabled": cfg.enabled,
                "every_k_steps": cfg.every_k_steps,
                "sites_per_step": cfg.sites_per_step,
                "window": cfg.window,
                "interval": cfg.interval,
                "quantile": cfg.quantile,
                "margin_db": cfg.margin_db,
                "hysteresis_intervals": cfg.hysteresis_intervals,
                "min_samples": cfg.min_samples,
                "max_saturation_fraction": cfg.max_saturation_fraction,
                "max_underflow_fraction": cfg.max_underflow_fraction,
                "candidates": [c.name for c in self.candidates],
                "backward_fmt_b": None if cfg.backward_fmt_b is None else cfg.backward_fmt_b.value,
            },
            "sites": {
                site: {
                    "weight_shape": None if self._weight_shapes[site] is None else list(self._weight_shapes[site]),  # type: ignore[arg-type]
                    "sqnr_budget_db": dict(self._budgets[site]),
                    "num_observations": dict(zip(ROLES, self._num_obs[i], strict=True)),
                }
                for i, site in enumerate(self._sites)
            },
            "verdicts": [v.to_dict() for v in self.verdicts().values()],
            "events": {
                "nonfinite": self.num_nonfinite_events,
                "misaligned": self.num_misaligned_events,
                "verdict_changes": self.num_verdict_changes,
                "log": [{k: _jsonable(v) for k, v in e.items()} for e in self.events],
            },
            "cuda_graphs": None
            if self._graphs is None
            else {
                "captures": self._graphs.num_captures,
                "eager_measurements": self._graphs.num_eager,
                "disabled_reason": self._graphs.disabled_reason,
            },
            "history": list(self.history),
            "series": {k: [[s, _jsonable(v)] for s, v in pts] for k, pts in self.series.items()},
        }

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of the SQNR low quantile per site and candidate over steps, one panel
        per GEMM role, with each site's budget dashed. Imports matplotlib lazily (Agg canvas,
        no global backend switch)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        fig = Figure(figsize=(10, 3.2 * len(ROLES)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(ROLES), 1, sharex=True, squeeze=False)[:, 0]
        for ax, role in zip(axes, ROLES, strict=True):
            for key, pts in self.series.items():
                site, key_role, cand = key.rsplit("/", 2)
                if key_role != role or not pts:
                    continue
                steps = [p[0] for p in pts]
                vals = [p[1] for p in pts]
                ax.plot(steps, vals, marker=".", label=f"{site} {cand}")
            budgets = sorted({self._budgets[s][role] for s in self._sites})
            for b in budgets:
                ax.axhline(b, linestyle="--", color="gray", linewidth=0.8)
            ax.set_title(f"{role}: SQNR p{100 * self.config.quantile:g} over the window")
            ax.set_ylabel("dB")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, ncol=2)
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
        return path

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Window contents, counters and verdict state (plain types and CPU tensors)."""
        return {
            "version": _STATE_VERSION,
            "window": self.config.window,
            "candidates": [(c.fmt.value, c.scaling.value) for c in self.candidates],
            "sites": [
                {
                    "name": s,
                    "weight_shape": self._weight_shapes[s],
                    "sqnr_budget_db": dict(self._budgets[s]),
                }
                for s in self._sites
            ],
            "step": self._step,
            "local_sum": self._local_sum.cpu().clone(),
            "local_max": self._local_max.cpu().clone(),
            "local_nonfinite_total": self._local_nonfinite_total.cpu().clone(),
            "num_obs": [list(x) for x in self._num_obs],
            "slot_steps": [[list(r) for r in s] for s in self._slot_steps],
            "global_sum": None if self._global_sum is None else self._global_sum.clone(),
            "global_max": None if self._global_max is None else self._global_max.clone(),
            "global_nonfinite_total": (
                None if self._global_nonfinite_total is None else self._global_nonfinite_total.clone()
            ),
            "num_obs_at_last_reduce": [list(x) for x in self._num_obs_at_last_reduce],
            "nonfinite_seen": [list(x) for x in self._nonfinite_seen],
            "key_state": {
                (k[0], k[1], k[2].value, k[3].value): (st.safe, st.streak)
                for k, st in self._key_state.items()
            },
            "verdicts": [v.to_dict() for v in self._verdicts.values()],
            "history": [dict(h) for h in self.history],
            "events": [dict(e) for e in self.events],
            "series": {k: list(v) for k, v in self.series.items()},
            "counters": {
                "num_nonfinite_events": self.num_nonfinite_events,
                "num_misaligned_events": self.num_misaligned_events,
                "num_reduces": self.num_reduces,
                "num_verdict_changes": self.num_verdict_changes,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. A probe with no sites registers the saved ones;
        otherwise the registered sites (names and order), window and candidates must match."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"probe state version {state.get('version')} != {_STATE_VERSION}: the checkpoint "
                f"comes from another loka_train version; {_RESUME_FIX}"
            )
        if state["window"] != self.config.window:
            raise ValueError(
                f"probe state has window {state['window']} but loka.probe.window="
                f"{self.config.window}; {_RESUME_FIX}"
            )
        mine = [(c.fmt.value, c.scaling.value) for c in self.candidates]
        if [tuple(c) for c in state["candidates"]] != mine:
            raise ValueError(
                f"probe state candidates {state['candidates']} != configured {mine} "
                f"(loka.probe.formats / loka.probe.scalings); {_RESUME_FIX}"
            )
        names = [s["name"] for s in state["sites"]]
        if not self._sites:
            for s in state["sites"]:
                self.register_site(s["name"], weight_shape=s["weight_shape"], sqnr_budget_db=s["sqnr_budget_db"])
        elif names != self._sites:
            raise ValueError(
                f"probe state sites {names} != registered sites {self._sites} (the model or "
                f"loka.mods changed); {_RESUME_FIX}"
            )
        self._step = int(state["step"])
        self._local_sum = state["local_sum"].to(self.device, torch.float64).clone()
        self._local_max = state["local_max"].to(self.device, torch.float64).clone()
        self._local_nonfinite_total = state["local_nonfinite_total"].to(self.device, torch.float64).clone()
        self._num_obs = [list(x) for x in state["num_obs"]]
        self._slot_steps = [[list(r) for r in s] for s in state["slot_steps"]]
        for name in ("global_sum", "global_max", "global_nonfinite_total"):
            value = state[name]
            setattr(self, f"_{name}", None if value is None else value.clone())
        self._num_obs_at_last_reduce = [list(x) for x in state["num_obs_at_last_reduce"]]
        self._nonfinite_seen = [list(x) for x in state["nonfinite_seen"]]
        self._key_state = {
            (k[0], k[1], Fp8Format(k[2]), Scaling(k[3])): _KeyState(bool(v[0]), int(v[1]))
            for k, v in state["key_state"].items()
        }
        self._verdicts = {}
        for d in state["verdicts"]:
            fields: dict[str, Any] = {
                k: (float(v) if isinstance(v, str) and k not in _STR_FIELDS else v) for k, v in d.items()
            }
            fields["fmt"], fields["fmt_b"] = Fp8Format(d["fmt"]), Fp8Format(d["fmt_b"])
            fields["scaling"] = Scaling(d["scaling"])
            v = Verdict(**fields)
            self._verdicts[(v.site, v.role, v.fmt, v.scaling)] = v
        self.history = [dict(h) for h in state["history"]]
        self.events = [dict(e) for e in state["events"]]
        self.series = {k: [tuple(p) for p in v] for k, v in state["series"].items()}  # type: ignore[misc]
        counters = state["counters"]
        self.num_nonfinite_events = int(counters["num_nonfinite_events"])
        self.num_misaligned_events = int(counters["num_misaligned_events"])
        self.num_reduces = int(counters["num_reduces"])
        self.num_verdict_changes = int(counters["num_verdict_changes"])


_STR_FIELDS = frozenset({"site", "role", "fmt", "fmt_b", "scaling", "reason"})


def _worst_operand(values: dict[str, float]) -> str:
    """The operand with the largest value (NaN counts as smallest)."""
    return max(_OPERANDS, key=lambda o: _nan_low(values[o]))


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _nan_max(*vals: float) -> float:
    finite = [v for v in vals if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _masked_quantile(values: Tensor, valid: Tensor, q: float, *, higher: bool) -> Tensor:
    """Quantile over the window of ``values`` [S, R, W, C] where ``valid`` [S, R, W].

    Same as ``torch.quantile`` on the valid entries with ``interpolation="lower"`` (or
    ``"higher"``): always an observed sample. NaN where no slot is valid. Returns [S, R, C].
    """
    v = values.movedim(-2, -1)
    mask = valid.unsqueeze(-2).expand_as(v)
    ordered = torch.where(mask, v, math.inf).sort(dim=-1).values
    n = mask.sum(dim=-1, keepdim=True).to(values.dtype)
    pos = q * (n - 1).clamp_min(0)
    idx = (pos.ceil() if higher else pos.floor()).long()
    out = ordered.gather(-1, idx).squeeze(-1)
    return torch.where(n.squeeze(-1) > 0, out, math.nan)


def _masked_max(values: Tensor, valid: Tensor) -> Tensor:
    """Max over the window (last dim) of the valid slots; NaN where none is valid."""
    out = torch.where(valid, values, -math.inf).amax(dim=-1)
    return torch.where(valid.any(dim=-1), out, math.nan)
