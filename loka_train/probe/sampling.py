"""Which steps, sites and rows the Probe measures.

* **Steps and sites.** :meth:`Sampler.should_sample` is a pure function of the step and the
  site (every ``every_k_steps``-th step, optionally a rotating subset of ``sites_per_step``
  sites; the first sampled step a process begins samples every site, ``prime_all_sites``), so
  every rank samples the same (site, role, step) and window slots line up across ranks.
* **Rows.** A sample measures at most ``max_rows`` rows of an activation or gradient (evenly
  spread, plus the row holding the largest |value|, so on finite inputs the tensor-wise scale
  is the full tensor's; a row holding a non-finite value is not picked). Non-finite values are
  counted on the full tensors. Those two reductions (one kernel on CUDA) are all that reads
  the full operands, once a step for an operand two roles share (:class:`FullPasses`): the
  statistics, and the CUDA graphs that compute them, see only the selected rows
  (:func:`select`).

Example:
    >>> from loka_train.probe.config import ProbeConfig
    >>> sampler = Sampler(ProbeConfig(every_k_steps=10, sites_per_step=1, prime_all_sites=False))
    >>> [sampler.should_sample(20, i, num_sites=2) for i in range(2)]
    [True, False]
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from loka_train.kernels.triton_kernels import triton_runnable
from loka_train.kernels.triton_rowstats import SUPPORTED_DTYPES, row_stats
from loka_train.probe.config import ProbeConfig
from loka_train.probe.measurement import count_nonfinite

__all__ = ["FullPasses", "Sampler", "Selection", "cut_columns", "select"]


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


class FullPasses:
    """The full-operand reads of one step, so that an operand two roles of a site share is read
    once: ``X`` (the forward's a, the grad-weight's b) and ``dY`` (the grad-input's a, the
    grad-weight's a). Per site, the forward's read of ``X`` and the grad-input's of ``dY`` are
    kept; the site's grad-weight takes them over (and drops them). A kept read is taken only by
    a tensor on the same storage object (held weakly: an entry keeps nothing alive, and while
    that storage lives no other tensor can have its address) with the same offset, shape,
    strides, dtype and version counter. Inference tensors (no version counter) are read every
    time. At most two entries a site; call :meth:`clear` at every step start (what a site whose
    backward never came left). ``share=False`` reads every operand of every role (the A/B of
    ``bench.probe_cost``)."""

    KEEP = {"forward": ("x", None), "grad_input": ("dy", None), "grad_weight": (None, None)}
    """Per role, under which name the reads of a and b are kept for the site's later roles."""

    TAKE = {"forward": (None, None), "grad_input": (None, None), "grad_weight": ("dy", "x")}
    """Per role, which kept reads a and b take over (when they are the same tensor)."""

    def __init__(self, share: bool = True) -> None:
        self.share = share
        self._kept: dict[tuple[str, str], tuple[weakref.ref[Any], tuple[Any, ...] | None, Tensor, Tensor | None]] = {}
        self.reads = 0
        """Full passes run."""
        self.reused = 0
        """Full passes taken over from an earlier role."""

    def clear(self) -> None:
        self._kept.clear()

    def __getstate__(self) -> dict[str, Any]:
        # The kept passes belong to their step.
        return {"share": self.share, "reads": self.reads, "reused": self.reused}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self._kept)

    def __call__(
        self, x: Tensor, *, site: str, peaks: bool, kernel: bool, keep: str | None, take: str | None
    ) -> tuple[Tensor, Tensor | None]:
        tracked = not x.is_inference()
        meta = (x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version) if tracked else None
        if take is not None and tracked and self.share:
            hit = self._kept.pop((site, take), None)
            if (hit is not None and hit[0]() is x.untyped_storage() and hit[1] == meta
                    and (hit[3] is not None or not peaks)):
                self.reused += 1
                return hit[2], hit[3] if peaks else None
        self.reads += 1
        nf, peak = _full_pass(x, peaks=peaks, kernel=kernel)
        if keep is not None and tracked:
            self._kept[(site, keep)] = (weakref.ref(x.untyped_storage()), meta, nf, peak)
        return nf, peak


def select(
    role: str,
    a: Tensor,
    b: Tensor,
    out_ref: Tensor | None,
    max_rows: int | None,
    *,
    max_cols: int | None = None,
    kernel: bool | None = None,
    passes: FullPasses | None = None,
    site: str = "",
) -> Selection:
    """The work of a sample on the full operands: their non-finite counts, and the rows to
    measure.

    The full operands are read by the counts and, when rows are subsampled, by the peak search
    (``a``, and ``b`` for grad-weight, whose operands share M); the statistics then read only
    the selected rows. On CUDA one kernel does both in one read of each large operand
    (:func:`~loka_train.kernels.triton_rowstats.row_stats`); elsewhere PyTorch ops compute the
    same counts and the same rows.

    Args:
        role: the GEMM role.
        a: operand a, 2-D (rows first).
        b: operand b, 2-D.
        out_ref: optional bias-free high-precision result (dropped for a subsampled
            grad-weight, whose result has no rows).
        max_rows: ``ProbeConfig.max_rows``.
        max_cols: ``ProbeConfig.max_cols`` (None where block or MX candidates are measured).
        kernel: use the row-statistics kernel (default: on CUDA where Triton runs).
        passes: the step's :class:`FullPasses` (an operand an earlier role of the site read is
            not read again), or None: every operand is read.
        site: the site measured (what `passes` keys its reads by).

    Returns:
        ``(a, b, nf_a, nf_b, out_ref)`` with ``a`` (and ``b`` for grad-weight, ``out_ref`` for
        the other roles) cut to the selected rows, and the output features cut to `max_cols`
        (:func:`cut_columns`).
    """
    if kernel is None:
        kernel = a.device.type == "cuda" and triton_runnable(a.device)[0]
    if passes is not None and not site:
        raise ValueError("select: passes given without the site whose reads they keep")
    subsample = max_rows is not None and a.shape[0] > max_rows
    # Non-finite values are counted on the full operands: none may slip past a subsample.
    if passes is None:
        full_a = full_b = _full_pass
    else:
        (keep_a, keep_b), (take_a, take_b) = passes.KEEP[role], passes.TAKE[role]
        full_a = partial(passes, site=site, keep=keep_a, take=take_a)
        full_b = partial(passes, site=site, keep=keep_b, take=take_b)
    nf_a, peak_a = full_a(a, peaks=subsample, kernel=kernel)
    # For grad-weight, b (X) is an activation as large as a; elsewhere it is the weight, whose
    # count in PyTorch ops (a full-size product, a comparison and a sum) reads and writes it
    # several times where the kernel reads it once.
    # The forward's weight rows are its output features: their peaks pick the rows `max_cols`
    # keeps, from the same read.
    cut_rows_b = role == "forward" and max_cols is not None and b.shape[0] > max_cols
    nf_b, peak_b = full_b(b, peaks=(subsample and role == "grad_weight") or cut_rows_b, kernel=kernel)
    if subsample:
        assert max_rows is not None and peak_a is not None
        rows = _spread(a.shape[0], max_rows, [p for p in (peak_a, peak_b) if p is not None])
        a = a.index_select(0, rows)
        if role == "grad_weight":
            b = b.index_select(0, rows)
        if out_ref is not None and role != "grad_weight":
            out_ref = out_ref.reshape(-1, out_ref.shape[-1]).index_select(0, rows)
        else:
            out_ref = None
    if max_cols is not None:
        a, b, out_ref = cut_columns(role, a, b, out_ref, max_cols, b_row_peaks=peak_b if cut_rows_b else None)
    return Selection(a, b, nf_a, nf_b, out_ref)


def cut_columns(
    role: str, a: Tensor, b: Tensor, out_ref: Tensor | None, max_cols: int, *, b_row_peaks: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The operands cut to at most `max_cols` output features: the forward's weight rows
    (``y``'s columns), the grad-input's weight columns (``dX``'s columns), the grad-weight's
    columns of ``dY`` and of ``X`` (``dW``'s rows and columns). Evenly spread slices plus the
    one holding the largest finite |value|; the contraction axis is untouched, so every kept
    slice keeps its row-wise scale and the tensor-wise amax is the operand's (on finite values).
    `out_ref` (the high-precision result) is cut along the same features. `b_row_peaks`: the
    forward weight's row peaks (:func:`_slice_peaks` ``(b, dim=1)``), when already computed."""
    ref = None if out_ref is None else out_ref.reshape(-1, out_ref.shape[-1])
    if role == "forward" and b.shape[0] > max_cols:
        peaks = _slice_peaks(b, dim=1) if b_row_peaks is None else b_row_peaks
        keep = _spread(b.shape[0], max_cols, [peaks])
        b = b.index_select(0, keep)
        ref = None if ref is None else ref.index_select(1, keep)
    elif role == "grad_input" and b.shape[1] > max_cols:
        keep = _spread(b.shape[1], max_cols, [_slice_peaks(b, dim=0)])
        b = b.index_select(1, keep)
        ref = None if ref is None else ref.index_select(1, keep)
    elif role == "grad_weight":  # dW = dY^T X: its rows are dY's columns, its columns X's
        if a.shape[1] > max_cols:
            keep = _spread(a.shape[1], max_cols, [_slice_peaks(a, dim=0)])
            a = a.index_select(1, keep)
            ref = None if ref is None else ref.index_select(0, keep)
        if b.shape[1] > max_cols:
            keep = _spread(b.shape[1], max_cols, [_slice_peaks(b, dim=0)])
            b = b.index_select(1, keep)
            ref = None if ref is None else ref.index_select(1, keep)
    return a, b, ref if out_ref is not None else None


def _spread(num: int, count: int, peaks: list[Tensor]) -> Tensor:
    """`count` indices of ``range(num)``: evenly spread ones, then the index of each tensor of
    `peaks`' largest value (device ops: argmax stays there)."""
    spread = torch.linspace(0, num - 1, steps=count - len(peaks), device=peaks[0].device).round().long()
    return torch.cat([spread, *(p.argmax().reshape(1) for p in peaks)])


def _slice_peaks(x: Tensor, *, dim: int) -> Tensor:
    """The largest |value| of each slice of `x` reduced over `dim` (one pass, no full-size
    temporary), 0 for a slice holding a non-finite value."""
    lo, hi = torch.aminmax(x.detach(), dim=dim)
    return torch.nan_to_num(torch.maximum(hi.float(), -lo.float()), nan=0.0, posinf=0.0)


def _full_pass(x: Tensor, *, peaks: bool, kernel: bool) -> tuple[Tensor, Tensor | None]:
    """The non-finite count of `x` (int64 device scalar) and, with `peaks`, each row's largest
    finite magnitude (0 for a row holding a non-finite value)."""
    if kernel and x.dtype in SUPPORTED_DTYPES:
        peak, bad = row_stats(x.detach())
        return bad.sum(dtype=torch.int64), peak if peaks else None
    return count_nonfinite(x), _slice_peaks(x, dim=1) if peaks else None
