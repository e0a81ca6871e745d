"""A numerics monitor for a served model: the Probe's question, asked of live requests.

Traffic drifts after training: an activation that fit its FP8 format on the training data may
not on next month's requests. :class:`Monitor` runs a served model's requests and, on a sampled
fraction of them, measures every FP8 site's forward as the numerics debugger does (its output
against the same GEMM in fp32 on the same input, :mod:`loka_train.export.debugger`): the low
quantile of its SQNR over the request's samples. Per site it keeps a rolling window of those,
and compares the window's low quantile to the site's floor (a quantile of per-request
quantiles, where the Probe takes one over its window's samples): a site whose quantile falls below its floor is
flagged unsafe (logged, counted, listed in :meth:`Monitor.report` with its drift from the
first full window), and cleared once it is back above the floor by ``margin_db``.

A sampled request costs, per FP8 site, the fp32 reference GEMM and its row norms, and one host
read for all sites; the others run the model as it is. The monitor wraps the
sites' methods during a sampled request: give it the eager served model (a ``torch.compile``'d
one would recompile on those requests), and one thread of requests (the wrapping is not
thread-safe).

Example::

    monitor = Monitor(served, MonitorConfig(every=100, floor_db=18.0))
    with torch.no_grad():
        logits = monitor(lambda m: m.model(dense, sparse))
    monitor.flagged          # site -> why, for the sites whose numerics turned unsafe
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from loka_train.export.config import MonitorConfig
from loka_train.export.debugger import _capturing, row_sqnr_db
from loka_train.mods.convert import sites as find_sites

logger = logging.getLogger(__name__)

__all__ = ["Monitor"]

T = TypeVar("T")


class Monitor:
    """Runs a served model's requests and watches its FP8 sites' numerics (module docstring).

    Args:
        model: the served model (its FP8 sites are watched; high-precision ones are not).
        config: sampling, window, quantile and floors (:class:`~loka_train.export.config.MonitorConfig`).
        floors: site name -> SQNR floor in dB, overriding ``config.floor_db`` (e.g. the
            training run's forward budgets).

    Raises:
        ValueError: where the model has no FP8 site, or `floors` names a site it does not watch.
    """

    def __init__(self, model: nn.Module, config: MonitorConfig | None = None, *,
                 floors: Mapping[str, float] | None = None) -> None:
        self.model = model
        self.config = config or MonitorConfig()
        self.sites = {name: site for name, site in find_sites(model).items() if site.plan.forward.is_fp8}
        if not self.sites:
            raise ValueError("Monitor: the model has no site with an FP8 forward: nothing to watch")
        unknown = sorted(set(floors or {}) - set(self.sites))
        if unknown:
            raise ValueError(f"Monitor: floors name sites without an FP8 forward: {unknown}")
        self.floors = {name: float((floors or {}).get(name, self.config.floor_db)) for name in self.sites}
        self.windows: dict[str, deque[float]] = {name: deque(maxlen=self.config.window) for name in self.sites}
        self.baselines: dict[str, float] = {}
        """Site -> the median SQNR of its first full window (what drift is measured from)."""
        self.flagged: dict[str, str] = {}
        """Site -> why, for the sites judged unsafe now."""
        self.num_calls = 0
        self.num_samples = 0
        self.num_flags = 0
        """Times a site turned unsafe (a site flagged, cleared and flagged again counts twice)."""

    def __call__(self, run: Callable[[nn.Module], T]) -> T:
        """``run(model)``; on a sampled call, every FP8 site's numerics are measured as well."""
        self.num_calls += 1
        if (self.num_calls - 1) % self.config.every:
            return run(self.model)
        with _capturing(self.sites, fractions=False) as calls:
            out = run(self.model)
        self.num_samples += 1
        # The request's low quantile over its samples, per site (a few samples whose inputs the
        # cast flushes show there, where the whole output's SQNR hides them): one host read.
        names = list(calls)
        lows = torch.stack([
            _low_on_device(row_sqnr_db(calls[n].reference_fp32, calls[n].output), self.config.quantile)
            for n in names
        ]).tolist() if names else []
        for name, low in zip(names, lows, strict=True):
            self.windows[name].append(float(low))
        self._judge()
        return out

    def _low(self, name: str) -> float:
        values = sorted(self.windows[name])
        return values[min(len(values) - 1, int(self.config.quantile * len(values)))]

    def _judge(self) -> None:
        cfg = self.config
        for name, window in self.windows.items():
            if len(window) < cfg.min_samples:
                continue
            if name not in self.baselines and len(window) == cfg.window:
                self.baselines[name] = statistics.median(window)
            low, floor = self._low(name), self.floors[name]
            if name not in self.flagged and low < floor:
                self.flagged[name] = (
                    f"SQNR q{cfg.quantile:g} {low:.1f} dB < floor {floor:.1f} dB over the last {len(window)} "
                    f"sampled requests"
                )
                self.num_flags += 1
                logger.warning("monitor: %s turned unsafe: %s", name, self.flagged[name])
            elif name in self.flagged and low >= floor + cfg.margin_db:
                logger.warning("monitor: %s is safe again (SQNR q%g %.1f dB)", name, cfg.quantile, low)
                del self.flagged[name]

    def report(self) -> dict[str, Any]:
        """Per watched site: samples, the window's low quantile and median SQNR, its floor, its
        drift (median against the first full window's), whether it is flagged; and the counts."""
        sites: dict[str, Any] = {}
        for name, window in self.windows.items():
            median = statistics.median(window) if window else None
            base = self.baselines.get(name)
            sites[name] = {
                "samples": len(window),
                "sqnr_low_db": self._low(name) if window else None,
                "sqnr_median_db": median,
                "floor_db": self.floors[name],
                "drift_db": None if base is None or median is None else median - base,
                "unsafe": name in self.flagged,
                "why": self.flagged.get(name),
            }
        return {"calls": self.num_calls, "samples": self.num_samples, "flags": self.num_flags, "sites": sites}


def _low_on_device(values: Tensor, q: float) -> Tensor:
    """The `q` quantile of `values` (the lower of two neighbours), as a 0-dim tensor on their device."""
    if values.numel() == 0:
        return torch.full((), float("nan"), device=values.device)
    ordered = values.flatten().sort().values
    return ordered[min(ordered.numel() - 1, int(q * ordered.numel()))]
