"""The Probe's rolling window: ring buffers on the device, their cross-rank reduction, and the
events counted at each reduction (misaligned windows, non-finite values).

Shape legend: ``S`` sites, ``R`` roles (3), ``W`` window slots, ``C`` candidates.

* **Ring buffers.** Each (site, role) keeps ``W`` slots; a slot is one sample, a row of SUM
  fields and a row of MAX fields (:class:`WindowLayout`). A sample overwrites the oldest slot.
  Energies and counts are stored rather than dB values and fractions, because they add across
  ranks: the per-slot SQNR after the reduction is *exactly* the SQNR of the FP8 result over all
  ranks' rows together, and the quantile over the window is exact and identical on every rank
  without gathering anything.
* **Reduction.** :meth:`Window.reduce` packs all sums (every site, role, slot and the
  cumulative non-finite counters) into one tensor for one ``all_reduce(SUM)`` and all maxima
  (amax, negated minimum row amax, observation counts) into one for one ``all_reduce(MAX)``:
  two collectives per interval, whatever the number of sites. All ranks then hold
  bit-identical reduced tensors, so the verdicts computed from them agree.
* **Exactness.** The reduced statistics equal a single process observing the rows of all ranks
  concatenated whenever the scaling groups do not span ranks: the forward and grad-input GEMMs
  with row-wise, block or MX scaling (their groups lie along K or N, within one rank's rows).
  Tensor-wise scales and the grad-weight GEMM (contraction over the rows themselves) are
  measured per rank, as each rank's FP8 kernel would compute them, and pooled by energy.
  With a row subsample (``M > max_rows``) the statistics are estimates from those rows.

Example:
    >>> import torch
    >>> window = Window(size=4, num_candidates=2, device=torch.device("cpu"))
    >>> window.add_site()
    >>> tuple(window.local_sum.shape) == (1, 3, 4, window.layout.num_sum)
    True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loka_train.kernels.formats import SQNR_CAP_DB
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import OPERANDS

logger = logging.getLogger(__name__)

__all__ = ["Window", "WindowLayout", "merge_window_states"]


class WindowLayout:
    """Field indices of one window slot: a SUM part and a MAX part.

    Args:
        num_candidates: C, the number of candidates (per-candidate fields take C entries).

    Example:
        >>> layout = WindowLayout(2)
        >>> layout.count, layout.error, layout.num_max
        (0, 10, 4)
    """

    def __init__(self, num_candidates: int) -> None:
        self.num_candidates = num_candidates
        idx = 0

        def take(n: int = 1) -> int:
            nonlocal idx
            start, idx = idx, idx + n
            return start

        self.count = take()
        self.numel = {o: take() for o in OPERANDS}
        self.nnz = {o: take() for o in OPERANDS}
        self.sumsq = {o: take() for o in OPERANDS}
        self.nonfinite = {o: take() for o in OPERANDS}
        self.signal = take()
        self.error = take(num_candidates)
        self.saturated = {o: take(num_candidates) for o in OPERANDS}
        self.underflow = {o: take(num_candidates) for o in OPERANDS}
        self.num_sum = idx
        idx = 0
        self.amax = {o: take() for o in OPERANDS}  # also the largest row amax
        self.neg_row_min = {o: take() for o in OPERANDS}
        self.num_max = idx

    def derive(self, gs: Tensor, gm: Tensor) -> dict[str, Tensor]:
        """Per-slot statistics from slots ``gs`` [..., W, num_sum] and ``gm`` [..., W, num_max].

        Keys: ``count`` and ``valid`` [..., W], ``sqnr_db`` [..., W, C], and per operand ``o``
        in (a, b): ``saturation_o`` / ``underflow_o`` [..., W, C], ``amax_o``,
        ``outlier_ratio_o``, ``row_spread_o``, ``nonfinite_o`` [..., W].
        """
        C = self.num_candidates
        out: dict[str, Tensor] = {}
        out["count"] = gs[..., self.count]
        out["valid"] = gs[..., self.count] > 0
        signal = gs[..., self.signal : self.signal + 1]
        error = gs[..., self.error : self.error + C]
        sqnr = 10.0 * (torch.log10(signal) - torch.log10(error))
        sqnr = sqnr.clamp(-SQNR_CAP_DB, SQNR_CAP_DB)
        out["sqnr_db"] = torch.where(error == 0, torch.full_like(sqnr, SQNR_CAP_DB), sqnr)
        for o in OPERANDS:
            numel = gs[..., self.numel[o]].clamp_min(1.0)
            nnz = gs[..., self.nnz[o]].clamp_min(1.0)
            out[f"saturation_{o}"] = gs[..., self.saturated[o] : self.saturated[o] + C] / numel[..., None]
            out[f"underflow_{o}"] = gs[..., self.underflow[o] : self.underflow[o] + C] / nnz[..., None]
            amax = gm[..., self.amax[o]]
            rms = (gs[..., self.sumsq[o]] / numel).sqrt()
            out[f"amax_{o}"] = amax
            out[f"outlier_ratio_{o}"] = torch.where(rms > 0, amax / rms, torch.ones_like(amax))
            row_max, row_min = amax, -gm[..., self.neg_row_min[o]]
            ok = torch.isfinite(row_min) & (row_min > 0)
            out[f"row_spread_{o}"] = torch.where(ok, row_max / torch.where(ok, row_min, 1.0), 1.0)
            out[f"nonfinite_{o}"] = gs[..., self.nonfinite[o]]
        return out


class Window:
    """Ring buffers of samples per (site, role) on the device, and their reduced host copies.

    Sites are indexed in the order of :meth:`add_site`; every rank must add the same sites in
    the same order (the packed tensors of :meth:`reduce` must have the same layout).

    Args:
        size: W, slots per (site, role).
        num_candidates: C, candidates measured per sample.
        device: where the local buffers live (the device of the measured tensors).
    """

    def __init__(self, *, size: int, num_candidates: int, device: torch.device) -> None:
        self.size = size
        self.layout = WindowLayout(num_candidates)
        self.device = device
        L, R = self.layout, len(ROLES)
        self.local_sum = torch.zeros(0, R, size, L.num_sum, dtype=torch.float64, device=device)
        """This rank's slots, SUM fields [S, R, W, num_sum]."""
        self.local_max = torch.full((0, R, size, L.num_max), -math.inf, dtype=torch.float64, device=device)
        """This rank's slots, MAX fields [S, R, W, num_max]."""
        self.local_nonfinite_total = torch.zeros(0, R, dtype=torch.float64, device=device)
        """Non-finite values this rank has seen per (site, role), cumulative [S, R]."""
        self.num_obs: list[list[int]] = []
        """Samples this rank has recorded per (site, role) (the next slot is ``num_obs % W``)."""
        self.slot_steps: list[list[list[int]]] = []
        """Step of the sample in each slot, -1 when empty [S][R][W]."""
        self.global_sum: Tensor | None = None
        """Reduced (global) copy of ``local_sum`` on the host, refreshed by :meth:`reduce`."""
        self.global_max: Tensor | None = None
        """Reduced (global) copy of ``local_max`` on the host."""
        self.global_nonfinite_total: Tensor | None = None
        """Reduced (global) copy of ``local_nonfinite_total`` on the host."""
        self.num_obs_at_last_reduce: list[list[int]] = []
        """Reduced (MAX over ranks) observation counts at the previous reduction."""
        self.nonfinite_seen: list[list[float]] = []
        """Reduced non-finite totals already reported as events."""
        self.events: list[dict[str, Any]] = []
        """Logged, counted events (non-finite values, misaligned windows)."""
        self.num_nonfinite_events = 0
        self.num_misaligned_events = 0

    def add_site(self) -> None:
        """Allocate the buffers of one more site (never on the hot path)."""
        W, L, R = self.size, self.layout, len(ROLES)
        new_sum = torch.zeros(1, R, W, L.num_sum, dtype=torch.float64, device=self.device)
        new_max = torch.full((1, R, W, L.num_max), -math.inf, dtype=torch.float64, device=self.device)
        self.local_sum = torch.cat([self.local_sum, new_sum])
        self.local_max = torch.cat([self.local_max, new_max])
        self.local_nonfinite_total = torch.cat(
            [self.local_nonfinite_total, torch.zeros(1, R, dtype=torch.float64, device=self.device)]
        )
        self.num_obs.append([0] * R)
        self.slot_steps.append([[-1] * W for _ in range(R)])
        self.num_obs_at_last_reduce.append([0] * R)
        self.nonfinite_seen.append([0.0] * R)
        # Reduced copies must be recomputed with the new shape.
        self.global_sum = self.global_max = self.global_nonfinite_total = None

    def record(self, site_index: int, role_index: int, vec_sum: Tensor, vec_max: Tensor, step: int) -> None:
        """Write one sample into the oldest slot of (site, role); device copies only.

        Args:
            site_index: the site's index (order of :meth:`add_site`).
            role_index: the role's index in ``ROLES``.
            vec_sum: the sample's SUM fields [num_sum] (float64, on the device).
            vec_max: the sample's MAX fields [num_max].
            step: the training step of the sample.
        """
        s, r = site_index, role_index
        n = self.num_obs[s][r]
        slot = n % self.size
        self.local_sum[s, r, slot].copy_(vec_sum)
        self.local_max[s, r, slot].copy_(vec_max)
        L = self.layout
        self.local_nonfinite_total[s, r] += vec_sum[L.nonfinite["a"]] + vec_sum[L.nonfinite["b"]]
        self.num_obs[s][r] = n + 1
        self.slot_steps[s][r][slot] = step

    def reduce(self, process_group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
        """All-reduce the buffers across ranks into the host copies ``global_*``.

        Two collectives (one SUM, one MAX) for all sites together, then two small
        device-to-host copies.

        Args:
            process_group: the group to reduce over; None = the default group when
                ``torch.distributed`` is initialized, else this process alone.

        Returns:
            The largest and the smallest observation count over ranks, [S, R] each.
        """
        S, R = len(self.num_obs), len(ROLES)
        obs = torch.tensor(self.num_obs, dtype=torch.float64).reshape(S, R).to(self.device)
        sum_pack = torch.cat([self.local_sum.flatten(), self.local_nonfinite_total.flatten()])
        max_pack = torch.cat([self.local_max.flatten(), obs.flatten(), -obs.flatten()])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            dist.all_reduce(sum_pack, op=dist.ReduceOp.SUM, group=process_group)
            dist.all_reduce(max_pack, op=dist.ReduceOp.MAX, group=process_group)
        sum_pack, max_pack = sum_pack.cpu(), max_pack.cpu()
        n_sum, n_max = self.local_sum.numel(), self.local_max.numel()
        self.global_sum = sum_pack[:n_sum].reshape(self.local_sum.shape)
        self.global_nonfinite_total = sum_pack[n_sum:].reshape(S, R)
        self.global_max = max_pack[:n_max].reshape(self.local_max.shape)
        obs_max = max_pack[n_max : n_max + S * R].reshape(S, R)
        obs_min = -max_pack[n_max + S * R :].reshape(S, R)
        return obs_max, obs_min

    def check_alignment(self, obs_max: Tensor, obs_min: Tensor, sites: Sequence[str], step: int) -> None:
        """Log and count every (site, role) whose ranks recorded different numbers of samples."""
        mismatch = (obs_max != obs_min).nonzero().tolist()
        for s, r in mismatch:
            self.num_misaligned_events += 1
            event = {
                "kind": "misaligned",
                "step": step,
                "site": sites[s],
                "role": ROLES[r],
                "min_observations": int(obs_min[s, r]),
                "max_observations": int(obs_max[s, r]),
            }
            self.events.append(event)
            logger.warning(
                "probe: ranks observed %s/%s %d..%d times; window slots of different steps "
                "are being pooled (every rank must run the same sampled GEMMs)",
                sites[s], ROLES[r], event["min_observations"], event["max_observations"],
            )

    def count_nonfinite_events(self, sites: Sequence[str], step: int) -> None:
        """Log and count every (site, role) with non-finite values since the last reduction."""
        assert self.global_nonfinite_total is not None
        for s, site in enumerate(sites):
            for r, role in enumerate(ROLES):
                total = float(self.global_nonfinite_total[s, r])
                new = total - self.nonfinite_seen[s][r]
                if new > 0:
                    self.num_nonfinite_events += 1
                    self.events.append(
                        {"kind": "nonfinite", "step": step, "site": site, "role": role, "count": int(new)}
                    )
                    logger.warning(
                        "probe: %d non-finite values (Inf/NaN) in %s/%s operands since the last "
                        "reduction (step %d); its FP8 verdicts are unsafe until they leave the "
                        "window (event %d)",
                        int(new), site, role, step, self.num_nonfinite_events,
                    )
                self.nonfinite_seen[s][r] = total

    def new_data(self, num_obs_reduced: list[list[int]]) -> list[list[bool]]:
        """Whether each (site, role) brought new samples since the previous call, from the
        reduced (MAX over ranks) counts, so a rank that sampled nothing in an interval (an
        empty operand) still agrees with the others; remembers the counts for the next call."""
        out = [
            [n != last for n, last in zip(row, last_row, strict=True)]
            for row, last_row in zip(num_obs_reduced, self.num_obs_at_last_reduce, strict=True)
        ]
        self.num_obs_at_last_reduce = [list(row) for row in num_obs_reduced]
        return out

    def reduced_stats(self) -> dict[str, Tensor]:
        """Per-slot statistics of every reduced window, [S, R, W, ...] (see
        :meth:`WindowLayout.derive`).

        Raises:
            ValueError: before the first :meth:`reduce` since the last :meth:`add_site`.
        """
        if self.global_sum is None or self.global_max is None:
            raise ValueError("no reduced window yet: call reduce() first")
        return self.layout.derive(self.global_sum, self.global_max)

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore the buffers, counts and events from a Probe state dict (same keys as
        ``Probe.state_dict``); the sites must already be added."""
        self.local_sum = state["local_sum"].to(self.device, torch.float64).clone()
        self.local_max = state["local_max"].to(self.device, torch.float64).clone()
        self.local_nonfinite_total = state["local_nonfinite_total"].to(self.device, torch.float64).clone()
        self.num_obs = [list(x) for x in state["num_obs"]]
        self.slot_steps = [[list(r) for r in s] for s in state["slot_steps"]]
        for name in ("global_sum", "global_max", "global_nonfinite_total"):
            value = state[name]
            setattr(self, name, None if value is None else value.clone())
        self.num_obs_at_last_reduce = [list(x) for x in state["num_obs_at_last_reduce"]]
        self.nonfinite_seen = [list(x) for x in state["nonfinite_seen"]]
        self.events = [dict(e) for e in state["events"]]
        counters = state["counters"]
        self.num_nonfinite_events = int(counters["num_nonfinite_events"])
        self.num_misaligned_events = int(counters["num_misaligned_events"])


def merge_window_states(states: Sequence[Mapping[str, Any]], *, rank: int) -> dict[str, Any]:
    """The Probe state (``Probe.state_dict``) that `rank` of a run with another number of
    processes loads, from the states every saved rank wrote (rank order).

    The window's local buffers are what :meth:`Window.reduce` sums (SUM fields, non-finite
    totals) and maxes (MAX fields) over ranks: rank 0 takes the sum and the max of all saved
    ranks' buffers, every other rank empty ones (zeros, -inf), so the next reduction yields
    the same global window as it would have in the run that wrote them. Counts, slot steps,
    reduced copies, verdicts and history are the same on every rank: rank 0's.

    Example:
        >>> merged = merge_window_states([state_rank0, state_rank1], rank=0)
    """
    merged = dict(states[0])
    if rank == 0:
        merged["local_sum"] = torch.stack([s["local_sum"] for s in states]).sum(0)
        merged["local_max"] = torch.stack([s["local_max"] for s in states]).amax(0)
        merged["local_nonfinite_total"] = torch.stack([s["local_nonfinite_total"] for s in states]).sum(0)
    else:
        merged["local_sum"] = torch.zeros_like(states[0]["local_sum"])
        merged["local_max"] = torch.full_like(states[0]["local_max"], -math.inf)
        merged["local_nonfinite_total"] = torch.zeros_like(states[0]["local_nonfinite_total"])
    return merged
