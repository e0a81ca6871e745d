"""Verdicts: whether each GEMM of each site may run with each FP8 candidate, and why.

:func:`judge` is a pure function: from the reduced window statistics, the config and the
previous per-key state to the new verdicts and key states. It makes no collective call and
keeps no state of its own, so every rank, given the bit-identical reduced window, reaches the
same verdicts.

Per (site, role, format, scaling) the verdict is unsafe when the window has non-finite values,
fewer than ``min_samples`` samples, a low quantile (``quantile``) of SQNR below the budget, or
a saturation / underflow fraction (the mirrored upper quantile) above its limit on either
operand. safe -> unsafe is immediate; unsafe -> safe needs ``hysteresis_intervals``
consecutive intervals with new samples that clear ``budget + margin_db`` (and the limits
scaled down by the same ratio). The reason string names the failing bound, its value and its
limit, plus the outlier ratio and row spread.

Shape legend: ``S`` sites, ``R`` roles (3), ``W`` window slots, ``C`` candidates.

Example:
    >>> import torch
    >>> from loka_train.probe.candidates import candidates_of
    >>> cfg = ProbeConfig(formats=("e4m3",), scalings=("rowwise",), min_samples=2, window=4)
    >>> W = 4
    >>> stats = {"valid": torch.ones(1, 3, W, dtype=torch.bool),
    ...          "sqnr_db": torch.full((1, 3, W, 1), 30.0, dtype=torch.float64)}
    >>> for o in ("a", "b"):
    ...     for name in ("saturation", "underflow"):
    ...         stats[f"{name}_{o}"] = torch.zeros(1, 3, W, 1, dtype=torch.float64)
    ...     for name in ("amax", "outlier_ratio", "row_spread"):
    ...         stats[f"{name}_{o}"] = torch.ones(1, 3, W, dtype=torch.float64)
    ...     stats[f"nonfinite_{o}"] = torch.zeros(1, 3, W, dtype=torch.float64)
    >>> update = judge(stats, config=cfg, sites=["s"], budgets={"s": cfg.sqnr_budget_db},
    ...                candidates=candidates_of(cfg), new_data=[[True] * 3], key_states={},
    ...                step=9)
    >>> [v.safe for v in update.verdicts.values()], [s.streak for s in update.key_states.values()]
    ([False, False, False], [1, 1, 1])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import OPERANDS, Candidate, operand_b_format
from loka_train.probe.config import ProbeConfig

__all__ = [
    "KeyState",
    "Verdict",
    "VerdictKey",
    "VerdictUpdate",
    "jsonable",
    "judge",
    "masked_max",
    "masked_quantile",
    "unjudged",
]

VerdictKey = tuple[str, str, Fp8Format, Scaling]
"""(site, role, format of operand a, scaling)."""

_STR_FIELDS = frozenset({"site", "role", "fmt", "fmt_b", "scaling", "reason"})


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
        return {k: jsonable(v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Inverse of :meth:`to_dict`."""
        fields: dict[str, Any] = {
            k: (float(v) if isinstance(v, str) and k not in _STR_FIELDS else v) for k, v in d.items()
        }
        fields["fmt"], fields["fmt_b"] = Fp8Format(d["fmt"]), Fp8Format(d["fmt_b"])
        fields["scaling"] = Scaling(d["scaling"])
        return cls(**fields)


def jsonable(v: Any) -> Any:
    """``v``, with a non-finite float as its string (``"nan"``, ``"inf"``)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@dataclass(frozen=True)
class KeyState:
    """What a verdict carries from one interval to the next."""

    safe: bool = False
    """The current verdict."""
    streak: int = 0
    """Consecutive intervals with new data that cleared the margin-raised bar while unsafe."""


@dataclass(frozen=True)
class VerdictUpdate:
    """What :func:`judge` returns: every judged key, in (site, role, candidate) order."""

    verdicts: dict[VerdictKey, Verdict] = field(default_factory=dict)
    key_states: dict[VerdictKey, KeyState] = field(default_factory=dict)
    changes: list[Verdict] = field(default_factory=list)
    """The verdicts whose ``safe`` differs from the previous key state."""
    series: list[tuple[str, float]] = field(default_factory=list)
    """``(site/role/candidate, SQNR low quantile)`` per judged key."""


def judge(
    stats: Mapping[str, Tensor],
    *,
    config: ProbeConfig,
    sites: Sequence[str],
    budgets: Mapping[str, Mapping[str, float]],
    candidates: Sequence[Candidate],
    new_data: Sequence[Sequence[bool]],
    key_states: Mapping[VerdictKey, KeyState],
    step: int,
) -> VerdictUpdate:
    """The verdicts of every (site, role, candidate) from the reduced window.

    Args:
        stats: per-slot statistics of the reduced window, [S, R, W, ...]
            (:meth:`~loka_train.probe.window.WindowLayout.derive`): ``valid``, ``sqnr_db``
            and per operand ``o``: ``saturation_o``, ``underflow_o``, ``outlier_ratio_o``,
            ``row_spread_o``, ``amax_o``, ``nonfinite_o``.
        config: the bounds, the quantile, the margin, the hysteresis and ``min_samples``.
        sites: the S site names, in window order.
        budgets: SQNR floor per site and role, in dB.
        candidates: the C candidates, in window order.
        new_data: per (site, role), whether the interval brought new samples (only then
            does a hysteresis streak advance).
        key_states: the previous state per key (missing: unsafe, no streak).
        step: the step of this reduction (recorded in the verdicts).

    Returns:
        The new verdicts and key states of every key, the changed verdicts and the SQNR
        series points; ``key_states`` is not modified.
    """
    cfg = config
    relax = 10.0 ** (-cfg.margin_db / 10.0)
    q = cfg.quantile
    # All sites and roles at once ([S, R, W, ...]), then one .tolist() per statistic: the
    # Python loop below only compares numbers and formats strings.
    valid = stats["valid"]
    num_samples_all = valid.sum(-1).tolist()
    lo_all = masked_quantile(stats["sqnr_db"], valid, q, higher=False).tolist()
    med_all = masked_quantile(stats["sqnr_db"], valid, 0.5, higher=False).tolist()
    sat_all = {
        o: masked_quantile(stats[f"saturation_{o}"], valid, 1 - q, higher=True).tolist() for o in OPERANDS
    }
    und_all = {
        o: masked_quantile(stats[f"underflow_{o}"], valid, 1 - q, higher=True).tolist() for o in OPERANDS
    }
    outlier_all = {o: masked_max(stats[f"outlier_ratio_{o}"], valid).tolist() for o in OPERANDS}
    spread_all = {o: masked_max(stats[f"row_spread_{o}"], valid).tolist() for o in OPERANDS}
    amax_all = {o: masked_max(stats[f"amax_{o}"], valid).tolist() for o in OPERANDS}
    nonfinite_all = {
        o: torch.where(valid, stats[f"nonfinite_{o}"], 0.0).sum(-1).tolist() for o in OPERANDS
    }
    out = VerdictUpdate()
    for s, site in enumerate(sites):
        for r, role in enumerate(ROLES):
            num_samples = int(num_samples_all[s][r])
            budget = budgets[site][role]
            outlier = {o: outlier_all[o][s][r] for o in OPERANDS}
            spread = {o: spread_all[o][s][r] for o in OPERANDS}
            nonfinite = {o: int(nonfinite_all[o][s][r]) for o in OPERANDS}
            amax = _nan_max(amax_all["a"][s][r], amax_all["b"][s][r])
            context = (
                f"outlier ratio (max/rms) a {outlier['a']:.3g}, b {outlier['b']:.3g}; "
                f"row amax spread a {spread['a']:.3g}, b {spread['b']:.3g}"
            )
            for c, cand in enumerate(candidates):
                key: VerdictKey = (site, role, cand.fmt, cand.scaling)
                fmt_b = operand_b_format(role, cand.fmt, cfg.backward_fmt_b)
                where = f"{cand.scaling.value} {cand.fmt.value}x{fmt_b.value}"
                lo, med = lo_all[s][r][c], med_all[s][r][c]
                sat_o = {o: sat_all[o][s][r][c] for o in OPERANDS}
                und_o = {o: und_all[o][s][r][c] for o in OPERANDS}
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
                was = key_states.get(key, KeyState())
                safe, streak = was.safe, was.streak
                if failures:
                    safe, streak = False, 0
                    reason = "unsafe: " + "; ".join(failures) + f"; {context}"
                elif safe:
                    reason = f"safe: {measured}; {context}"
                elif clear:
                    if new_data[s][r]:
                        streak += 1
                    if streak >= cfg.hysteresis_intervals:
                        safe, streak = True, 0
                        reason = f"safe: {measured}; {context}"
                    else:
                        reason = (
                            f"unsafe (hysteresis): bounds clear for {streak}/"
                            f"{cfg.hysteresis_intervals} intervals; {measured}; {context}"
                        )
                else:
                    streak = 0
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
                    safe=safe,
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
                    step=step,
                )
                out.key_states[key] = KeyState(safe, streak)
                out.verdicts[key] = verdict
                out.series.append((f"{site}/{role}/{cand.name}", lo))
                if safe != was.safe:
                    out.changes.append(verdict)
    return out


def unjudged(key: VerdictKey, *, budget_db: float, backward_fmt_b: Fp8Format | None) -> Verdict:
    """The verdict of a key that no reduction has judged yet: unsafe, nothing measured.

    Args:
        key: (site, role, format, scaling).
        budget_db: the site's SQNR floor for the role.
        backward_fmt_b: ``ProbeConfig.backward_fmt_b``.
    """
    site, role, fmt, scaling = key
    return Verdict(
        site=site, role=role, fmt=fmt, fmt_b=operand_b_format(role, fmt, backward_fmt_b),
        scaling=scaling, safe=False,
        reason="unsafe: not measured yet (no reduction since the site was registered)",
        sqnr_lo_db=math.nan, sqnr_median_db=math.nan, budget_db=budget_db,
        saturation=math.nan, underflow=math.nan, outlier_ratio=math.nan, row_spread=math.nan,
        amax=math.nan, num_samples=0, num_nonfinite=0, step=-1,
    )


def _worst_operand(values: dict[str, float]) -> str:
    """The operand with the largest value (NaN counts as smallest)."""
    return max(OPERANDS, key=lambda o: _nan_low(values[o]))


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _nan_max(*vals: float) -> float:
    finite = [v for v in vals if not math.isnan(v)]
    return max(finite) if finite else math.nan


def masked_quantile(values: Tensor, valid: Tensor, q: float, *, higher: bool) -> Tensor:
    """Quantile over the window of ``values`` [S, R, W, C] where ``valid`` [S, R, W].

    Same as ``torch.quantile`` on the valid entries with ``interpolation="lower"`` (or
    ``"higher"``): always an observed sample. NaN where no slot is valid. Returns [S, R, C].

    Example:
        >>> v = torch.tensor([[[[1.0], [2.0], [3.0]]]])
        >>> masked_quantile(v, torch.ones(1, 1, 3, dtype=torch.bool), 0.5, higher=False)
        tensor([[[2.]]])
    """
    v = values.movedim(-2, -1)
    mask = valid.unsqueeze(-2).expand_as(v)
    ordered = torch.where(mask, v, math.inf).sort(dim=-1).values
    n = mask.sum(dim=-1, keepdim=True).to(values.dtype)
    pos = q * (n - 1).clamp_min(0)
    idx = (pos.ceil() if higher else pos.floor()).long()
    out = ordered.gather(-1, idx).squeeze(-1)
    return torch.where(n.squeeze(-1) > 0, out, math.nan)


def masked_max(values: Tensor, valid: Tensor) -> Tensor:
    """Max over the window (last dim) of the valid slots; NaN where none is valid."""
    out = torch.where(valid, values, -math.inf).amax(dim=-1)
    return torch.where(valid.any(dim=-1), out, math.nan)
