"""Which steps, sites and rows the Probe measures.

* **Steps and sites.** :meth:`Sampler.should_sample` is a pure function of the step and the
  site (every ``every_k_steps``-th step, optionally a rotating subset of ``sites_per_step``
  sites; the first sampled step a process begins samples every site, ``prime_all_sites``), so
  every rank samples the same (site, role, step) and window slots line up across ranks.
* **Rows.** A sample measures at most ``max_rows`` rows of an activation or gradient (evenly
  strided, plus the row holding the largest |value|, so on finite inputs the tensor-wise scale
  is the full tensor's; a row holding a non-finite value is not picked). Non-finite values are
  counted on the full tensors. Those two reductions are all that reads the full operands: the
  statistics, and the CUDA graphs that compute them, see only the selected rows
  (:func:`select`).

Example:
    >>> from loka_train.probe.config import ProbeConfig
    >>> sampler = Sampler(ProbeConfig(every_k_steps=10, sites_per_step=1, prime_all_sites=False))
    >>> [sampler.should_sample(20, i, num_sites=2) for i in range(2)]
    [True, False]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from loka_train.probe.config import ProbeConfig
from loka_train.probe.measurement import count_nonfinite

__all__ = ["Sampler", "Selection", "row_subsample", "select"]


class Sampler:
    """The step schedule of the Probe: the current step, which sites it samples, and when the
    window is reduced. Host-only and identical on every rank.

    Args:
        config: the Probe's configuration (``enabled``, ``every_k_steps``,
            ``sites_per_step``, ``prime_all_sites``, ``interval``).
    """

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.step = 0
        """The current step (see :meth:`begin_step`)."""
        self.prime_step: int | None = None
        """The first sampled step this process began (``prime_all_sites``): every site samples."""

    def begin_step(self, step: int) -> None:
        """Set the current training step (call at the start of every step)."""
        self.step = int(step)
        cfg = self.config
        if self.prime_step is None and cfg.prime_all_sites and self.step % cfg.every_k_steps == 0:
            self.prime_step = self.step

    def should_sample(self, step: int, site_index: int, *, num_sites: int) -> bool:
        """Whether the site at ``site_index`` (of ``num_sites``, registration order) is
        measured on ``step``."""
        cfg = self.config
        if not cfg.enabled or step % cfg.every_k_steps != 0:
            return False
        n = cfg.sites_per_step
        if n is None or n >= num_sites or step == self.prime_step:
            return True
        offset = ((step // cfg.every_k_steps) * n) % num_sites
        return (site_index - offset) % num_sites < n

    def should_reduce(self, step: int) -> bool:
        """Whether the window is reduced (and verdicts updated) after ``step``."""
        return (step + 1) % self.config.interval == 0


class Selection(NamedTuple):
    """The operands of one sample cut to the measured rows, and their non-finite counts."""

    a: Tensor
    """Operand a, cut to the selected rows."""
    b: Tensor
    """Operand b (cut to the same rows for grad-weight, whose operands share M)."""
    nf_a: Tensor
    """Non-finite values in the full operand a (an int64 device scalar)."""
    nf_b: Tensor
    """Non-finite values in the full operand b."""
    out_ref: Tensor | None
    """The high-precision result cut to the selected rows, or None."""


def select(role: str, a: Tensor, b: Tensor, out_ref: Tensor | None, max_rows: int | None) -> Selection:
    """The work of a sample on the full operands: their non-finite counts, and the rows to
    measure.

    The full operands are read by the counts (:func:`count_nonfinite`) and, when rows are
    subsampled, by the peak search (one reduction each over ``a``, and ``b`` for grad-weight);
    the statistics then read only the selected rows.

    Args:
        role: the GEMM role.
        a: operand a, 2-D (rows first).
        b: operand b, 2-D.
        out_ref: optional bias-free high-precision result (dropped for a subsampled
            grad-weight, whose result has no rows).
        max_rows: ``ProbeConfig.max_rows``.

    Returns:
        ``(a, b, nf_a, nf_b, out_ref)`` with ``a`` (and ``b`` for grad-weight, ``out_ref`` for
        the other roles) cut to the selected rows.
    """
    # Non-finite values are counted on the full operands: none may slip past a subsample.
    nf_a, nf_b = count_nonfinite(a), count_nonfinite(b)
    rows = row_subsample(role, a, b, max_rows)
    if rows is not None:
        a = a.index_select(0, rows)
        if role == "grad_weight":
            b = b.index_select(0, rows)
        if out_ref is not None and role != "grad_weight":
            out_ref = out_ref.reshape(-1, out_ref.shape[-1]).index_select(0, rows)
        else:
            out_ref = None
    return Selection(a, b, nf_a, nf_b, out_ref)


def row_subsample(role: str, a: Tensor, b: Tensor, max_rows: int | None) -> Tensor | None:
    """Indices of at most ``max_rows`` rows (M) to measure on, or None for all rows.

    Evenly strided rows plus the row holding the largest |value| of ``a`` (and of ``b`` for
    grad-weight, whose operands share M), so the tensor-wise amax, and with it the tensor-wise
    scale, is the full tensor's on finite inputs. Each row's peak is one reduction over the
    operand (no full-size temporary); a row holding a non-finite value is not picked
    (non-finite values are counted on the full tensor anyway). Device ops only (argmax stays on
    the device).
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
