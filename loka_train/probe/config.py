"""Configuration of the Probe (the ``loka.probe`` group of the hydra config).

Choices made here (and why):

* Candidates are the product ``formats x scalings``. ``fmt`` is the format of operand ``a``
  (``x`` forward, ``dY`` in both backward GEMMs); operand ``b`` uses the same format in the
  forward GEMM and ``backward_fmt_b`` in the backward GEMMs, matching the hybrid recipe of
  :class:`loka_train.kernels.plan.GemmPlan` (``fmt`` / ``fmt_b``).
* Default sampling: every 100th step, 2 sites per sampled step (rotating), rows subsampled to
  1024, CUDA graphs on. On an H100, one sampled site of the MLPerf DLRM MLPs at batch 8192
  costs about 2.3 ms (3 GEMMs x 4 candidates, graphed), about 1.3% of the MLP-only step time
  at these defaults; see ``bench/probe_overhead.py``.
* Budgets are SQNR floors in dB of the FP8 GEMM result against the high-precision result,
  one per GEMM role. Reference points (Gaussian data, K=256, both operands quantized):
  E4M3 about 28.5 dB, E5M2 about 22.6 dB, E5M2 x E4M3 about 24 dB.
* The conservative bound is a low quantile (``quantile``) of the per-sample SQNR over the
  window, taken with ``interpolation="lower"`` so it is always an observed sample. Saturation
  and underflow fractions use the mirrored upper quantile (``1 - quantile``).

Example:
    >>> cfg = ProbeConfig(every_k_steps=50, window=32, formats=("e4m3",))
    >>> cfg.formats
    (<Fp8Format.E4M3: 'e4m3'>,)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES

__all__ = ["ProbeConfig", "default_sqnr_budget_db"]


def default_sqnr_budget_db() -> dict[str, float]:
    """Default SQNR floor per GEMM role, in dB."""
    return {"forward": 20.0, "grad_input": 16.0, "grad_weight": 16.0}


_E = TypeVar("_E", bound=enum.Enum)


def _coerce_enum(enum_type: type[_E], value: Any, field_name: str) -> _E:
    """Accept an enum member, its value ("e4m3") or its name ("E4M3")."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        try:
            return enum_type(value.lower())
        except ValueError:
            pass
        try:
            return enum_type[value.upper()]
        except KeyError:
            pass
    allowed = [m.value for m in enum_type]
    raise ValueError(f"probe.{field_name}: {value!r} is not one of {allowed}")


@dataclass(kw_only=True)
class ProbeConfig:
    """What the Probe measures, how often, and how it turns statistics into verdicts.

    Example:
        >>> cfg = ProbeConfig(every_k_steps=10, sites_per_step=4, interval=200)
        >>> cfg.sqnr_budget_db["forward"]
        20.0
    """

    enabled: bool = True
    """Measure at all. The Probe never changes numerics; disabling it only stops measuring
    (and then no site is ever declared safe)."""

    every_k_steps: int = 100
    """Sample on steps where ``step % every_k_steps == 0``."""

    sites_per_step: int | None = 2
    """An int n: a rotating subset of n sites (in registration order) per sampled step, so the
    cost of a sampled step is bounded whatever the model; each site is then sampled every
    ``every_k_steps * ceil(num_sites / n)`` steps. None: every site on every sampled step."""

    prime_all_sites: bool = True
    """The first sampled step of a process samples every site, whatever ``sites_per_step``.
    A site's first sample captures its measurement CUDA graphs (a device sync each). On an H100
    (DCN at batch 32768, 13 sites, 2 per sampled step) the sampled steps 50 and 100 took 60-140
    ms against 14 ms in every timed run; 13 sites reach their first sample only on the seventh
    sampled step (``bench/results/e2e_pinning_h100_2026-11-25b/NOTES.md``). Primed, the captures cost one slow step, and every site has a
    first sample in the window at once. Identical on every rank (all start at the same step)."""

    window: int = 16
    """W: samples kept per (site, GEMM) in the rolling window (a ring buffer on the device)."""

    interval: int = 500
    """Steps between cross-rank reductions (and verdict updates): ``(step + 1) % interval == 0``."""

    formats: tuple[Fp8Format, ...] = (Fp8Format.E4M3, Fp8Format.E5M2)
    """Candidate formats of operand ``a`` (accepts "e4m3" or "E4M3")."""

    scalings: tuple[Scaling, ...] = (Scaling.TENSORWISE, Scaling.ROWWISE)
    """Candidate scaling granularities. The default holds those with H100 GEMM backends;
    add "block" (1 x ``block_size`` along the contraction axis for activations and gradients,
    ``block_size`` square tiles for weights) or "mx" to measure them too."""

    max_rows: int | None = 1024
    """Measure on at most this many rows (M) of each activation / gradient: evenly spread
    rows plus the row holding the largest |value| (so the tensor-wise scale is the full
    tensor's). None measures every row. Non-finite values are always counted on the full
    tensor. Subsampling bounds the cost of a sample independently of the batch size."""

    max_cols: int | None = 1024
    """Measure on at most this many output features of each GEMM (the weight's rows for the
    forward, its columns for the grad-input, the columns of ``dY`` and of ``X`` for the
    grad-weight): evenly spread slices plus the one holding the largest |value| (so the
    tensor-wise scale is the full tensor's); every kept slice keeps its row-wise scale, which
    runs along the contraction. A 4096-wide layer then quantizes a quarter of its weight per
    candidate and its grad-weight error covers 1024 x 1024 outputs instead of 4096 x 4096. None
    measures every output feature; so do block and MX candidates, whose tiles span the cut
    dimension."""

    cuda_graphs: bool = True
    """On CUDA, capture each (GEMM role, operand shapes) measurement once as a CUDA graph and
    replay it: one launch instead of hundreds of small ones. The capture synchronizes the
    device once per shape; a failed capture is logged, counted and measured eagerly."""

    max_cuda_graphs: int = 64
    """Most graphs kept; further shapes are measured eagerly (logged once, counted)."""

    backward_fmt_b: Fp8Format | None = Fp8Format.E4M3
    """Format of operand ``b`` (W for grad-input, X for grad-weight) in the backward GEMMs;
    None means the candidate's own format."""

    block_size: int = 128
    """Group length (and weight tile edge) of ``Scaling.BLOCK``."""

    sqnr_budget_db: dict[str, float] = field(default_factory=default_sqnr_budget_db)
    """Default SQNR floor per GEMM role (keys: forward, grad_input, grad_weight); a site may
    override it at registration."""

    logit_feeder_budget_db: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(ROLES))
    """Per-role SQNR floors of the site that feeds the logit layer (``mods``'
    ``ConvertReport.logit_feeder``: the DLRM family's last top-MLP layer), replacing
    ``sqnr_budget_db``'s for the roles not None (keys: forward, grad_input, grad_weight; all
    None: that site has every site's floors). Its ``dY`` is the loss gradient through the logit
    weight, one value per sample times one per feature before the ReLU mask; the aggressive
    preset holds its grad-weight to safe's 20 dB (what that does to NE: ``docs/performance.md``,
    the paired NE protocol). Applied by the LoKA callback, which knows that site; a Probe used
    on its own takes per-site floors at ``register_site``."""

    quantile: float = 0.1
    """The verdict compares this low quantile of the window's per-sample SQNR to the budget."""

    margin_db: float = 1.0
    """Hysteresis band: an unsafe verdict turns safe only at ``budget + margin_db``, and the
    fraction limits shrink by the same ratio (``10**(-margin_db/10)``) for that transition."""

    hysteresis_intervals: int = 2
    """Consecutive intervals that must clear the (margin-raised) bar before unsafe -> safe.
    safe -> unsafe is immediate: a failing bound is never waited out."""

    min_samples: int = 4
    """Fewer valid samples than this in the window: the verdict is unsafe (not enough data)."""

    max_saturation_fraction: float = 1e-3
    """Largest tolerated fraction of values clipping at the format maximum (either operand)."""

    max_underflow_fraction: float = 1e-3
    """Largest tolerated fraction of non-zero values flushed below the smallest subnormal
    (either operand). This catches outlier channels that a whole-output SQNR hides."""

    def __post_init__(self) -> None:
        if self.max_rows is not None and (
            isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 4
        ):
            raise ValueError(f"probe.max_rows={self.max_rows!r} must be None or an int >= 4")
        if self.max_cols is not None and (
            isinstance(self.max_cols, bool) or not isinstance(self.max_cols, int) or self.max_cols < 4
        ):
            raise ValueError(f"probe.max_cols={self.max_cols!r} must be None or an int >= 4")
        for name in ("every_k_steps", "window", "interval", "block_size", "min_samples", "max_cuda_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"probe.{name}={value!r} must be a positive int")
        if self.sites_per_step is not None and (
            isinstance(self.sites_per_step, bool)
            or not isinstance(self.sites_per_step, int)
            or self.sites_per_step <= 0
        ):
            raise ValueError(f"probe.sites_per_step={self.sites_per_step!r} must be None or > 0")
        if self.min_samples > self.window:
            raise ValueError(
                f"probe.min_samples={self.min_samples} exceeds probe.window={self.window}: "
                "no window could ever be judged"
            )
        for name in ("enabled", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"probe.{name} must be a bool, got {getattr(self, name)!r}")
        self.formats = tuple(_coerce_enum(Fp8Format, f, "formats") for f in self.formats)
        self.scalings = tuple(_coerce_enum(Scaling, s, "scalings") for s in self.scalings)
        if not self.formats or not self.scalings:
            raise ValueError("probe.formats and probe.scalings must each name at least one entry")
        for name, seq in (("formats", self.formats), ("scalings", self.scalings)):
            if len(set(seq)) != len(seq):
                raise ValueError(f"probe.{name} has duplicates: {[s.value for s in seq]}")
        if self.backward_fmt_b is not None:
            self.backward_fmt_b = _coerce_enum(Fp8Format, self.backward_fmt_b, "backward_fmt_b")
        budgets = dict(self.sqnr_budget_db)
        if set(budgets) != set(ROLES):
            raise ValueError(
                f"probe.sqnr_budget_db needs exactly the keys {list(ROLES)}, got {sorted(budgets)}"
            )
        self.sqnr_budget_db = {r: float(budgets[r]) for r in ROLES}
        feeder = {**dict.fromkeys(ROLES), **dict(self.logit_feeder_budget_db or {})}
        if set(feeder) != set(ROLES):
            raise ValueError(
                f"probe.logit_feeder_budget_db has unknown roles {sorted(set(feeder) - set(ROLES))}; its keys "
                f"are {list(ROLES)} (None: the site's usual floor)"
            )
        self.logit_feeder_budget_db = {r: None if (v := feeder[r]) is None else float(v) for r in ROLES}
        if not 0.0 <= self.quantile <= 0.5:
            raise ValueError(f"probe.quantile={self.quantile} must be in [0, 0.5] (a low quantile)")
        if self.margin_db < 0:
            raise ValueError(f"probe.margin_db={self.margin_db} must be >= 0")
        if isinstance(self.hysteresis_intervals, bool) or self.hysteresis_intervals < 1:
            raise ValueError(f"probe.hysteresis_intervals={self.hysteresis_intervals} must be >= 1")
        for name in ("max_saturation_fraction", "max_underflow_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"probe.{name}={getattr(self, name)} must be in [0, 1]")

    @property
    def logit_feeder_floors(self) -> dict[str, float]:
        """The roles :attr:`logit_feeder_budget_db` sets a floor for, and their floors."""
        return {r: v for r, v in self.logit_feeder_budget_db.items() if v is not None}
