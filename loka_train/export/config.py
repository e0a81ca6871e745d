"""Configuration of :func:`loka_train.export.serve`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loka_train.runtime.config import TORCH_DTYPES as DTYPES

EMBEDDINGS: dict[str, torch.dtype | None] = {"trained": None, "fp16": torch.float16, "int8": torch.qint8}
"""``ServeConfig.embeddings``: the table dtype of TorchRec's inference modules (None: the
trained tables as they are)."""

__all__ = ["ExportConfig", "MonitorConfig", "ServeConfig"]


@dataclass(kw_only=True)
class ServeConfig:
    """How :func:`~loka_train.export.serve` prepares a trained model for inference.

    Example:
        >>> ServeConfig(dtype="bf16").torch_dtype
        torch.bfloat16
    """

    dtype: str = "bf16"
    """Compute dtype the served model runs its dense GEMMs in ("bf16": bf16 inputs or bf16
    autocast, as the DLRM family trains; "fp32"). An FP8 weight is quantized once from the
    weight rounded to it, as the training forward quantizes it at every step; a call in
    another compute dtype raises (it would take other codes)."""

    quantize_weights_once: bool = True
    """Quantize each FP8 ``Fp8Linear`` weight once, when the model is served, and only the
    input at every call. False keeps the training forward's per-call weight quantization
    (what serving would cost without it, for comparisons)."""

    fast_accum: bool = False
    """Serve each FP8 forward with its backend's fast accumulation (cuBLASLt's
    ``use_fast_accum``, the Triton kernel's: partial sums kept in the tensor cores' narrower
    accumulator: faster FP8 GEMMs, less exact sums), where the backend has one for the plan's
    scaling (``GemmPlan.with_fast_accum``); the others keep exact sums. Hold the NE with
    ``ExportConfig.ne_budget`` (the gate serves the same accumulation); what it gave on Wukong
    is in ``docs/performance.md`` ("Serving")."""

    embeddings: str = "trained"
    """How the embedding tables are served: "trained" (the trained tables in TorchRec's training
    modules, as they are), or TorchRec's inference modules
    (``torchrec.inference.modules.quantize_embeddings``) with the tables in "fp16" or in "int8"
    (row-wise: a scale and bias per row), which read 2x or about 4x fewer bytes per lookup than
    fp32 tables (:func:`~loka_train.export.serve_embeddings`)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"serve dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"serve embeddings={self.embeddings!r}: choose one of {sorted(EMBEDDINGS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        return DTYPES[self.dtype]


@dataclass(kw_only=True)
class ExportConfig:
    """An export of a trained run (``launch/export.py``, conf/export.yaml): the run's model and
    plans from its checkpoint, served, evaluated against the same weights in high precision,
    and its numerics per site.

    Example:
        >>> ExportConfig(run="runs/latest", dtype="fp32").dtype
        'fp32'
    """

    run: str = "runs/latest"
    """A run directory (its latest checkpoint), its ``checkpoints/`` or one ``step_*`` directory."""

    out: str | None = None
    """Where the export writes; None: ``<run directory>/export/step_<N>``."""

    device: str | None = None
    """Where the model is loaded and evaluated ("cpu", "cuda"); None: the device the run trained
    on (its ``trainer.device``), where its plans' backends run."""

    dtype: str | None = None
    """The served compute dtype ("bf16", "fp32"); None: the run's ``trainer.dense_dtype``."""

    quantize_weights_once: bool = True
    """:attr:`ServeConfig.quantize_weights_once`."""

    eval_batches: int | None = None
    """Held-out batches evaluated (NE, AUC of the served model and of the high-precision one);
    None: the run's ``trainer.eval_batches``. The first one is the numerics debugger's."""

    programs: bool = True
    """Also write the served dense submodules as ``torch.export`` programs (``dense/<name>.pt2``,
    :func:`~loka_train.export.program.export_dense`)."""

    dynamic_batch: bool = True
    """The programs take any batch size (else only the export's evaluation batch size)."""

    fast_accum: bool = False
    """:attr:`ServeConfig.fast_accum` (the plans re-decided with ``decide_batch`` are timed with it)."""

    embeddings: str = "trained"
    """:attr:`ServeConfig.embeddings`: the tables as trained, or in TorchRec's inference modules
    in "fp16" or "int8" (the high-precision model the export compares with serves the same)."""

    decide_batch: int | None = None
    """Re-decide the plans for serving at this batch size
    (:func:`~loka_train.export.decide_for_batch`: the fastest of each site's trained FP8 forward
    and the forwards the Probe judged safe, where it beats bf16 there), timed on this device;
    None: serve the trained plans. With programs for any batch size (``programs``,
    ``dynamic_batch``), block-scaled forwards are not candidates (their padding depends on the
    rows)."""

    ne_budget: float | None = None
    """Hold the served NE within this relative increase over the high-precision model's (2e-4:
    0.02%) on held-out batches other than the evaluated ones (as many, the next ones): while it
    is over, one FP8 forward moves per step, to high precision or (a tensor-wise one the Probe
    judged safe row-wise) to row-wise scales, each move priced by the speed it gives up: the
    cheapest move that brings the NE within the budget, else the one that lowers the NE most
    for its price (of those that lower it at least half as much as the best); it stops where
    no move lowers the NE
    (:func:`~loka_train.export.gate.hold_ne`; the steps in ``export.json`` and ``gate.md``);
    None: the plans as trained (or re-decided)."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"export dtype={self.dtype!r}: choose one of {sorted(DTYPES)} (or null: the run's)")
        if self.ne_budget is not None and not self.ne_budget >= 0:
            raise ValueError(f"export ne_budget={self.ne_budget} must be >= 0 (a relative NE increase, 2e-4 for "
                             "0.02%), or null: no budget")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"export eval_batches={self.eval_batches} must be >= 1")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"export embeddings={self.embeddings!r}: choose one of {sorted(EMBEDDINGS)}")
        if self.decide_batch is not None and self.decide_batch < 1:
            raise ValueError(f"export decide_batch={self.decide_batch} must be >= 1 (or null: the trained plans)")


@dataclass(kw_only=True)
class MonitorConfig:
    """How :class:`~loka_train.export.monitor.Monitor` watches a served model.

    Example:
        >>> MonitorConfig(every=1000, floor_db=24.0).quantile
        0.1
    """

    every: int = 100
    """Measure one request in `every` (1: every request)."""

    window: int = 16
    """Sampled requests per site in the rolling window."""

    min_samples: int = 4
    """Samples a site needs before it is judged."""

    quantile: float = 0.1
    """The window's low quantile compared to the floor (as ``probe.quantile``)."""

    floor_db: float = 18.0
    """SQNR floor of a served FP8 forward (the aggressive preset's forward budget; safe's is 24)."""

    margin_db: float = 1.0
    """A flagged site is cleared only at ``floor + margin_db`` (hysteresis, as ``probe.margin_db``)."""

    def __post_init__(self) -> None:
        if self.every < 1 or self.window < 1:
            raise ValueError(f"monitor every={self.every} and window={self.window} must be >= 1")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(f"monitor min_samples={self.min_samples} must be in [1, window={self.window}]")
        if not 0.0 <= self.quantile <= 0.5:
            raise ValueError(f"monitor quantile={self.quantile} must be in [0, 0.5] (a low quantile)")
        if self.margin_db < 0:
            raise ValueError(f"monitor margin_db={self.margin_db} must be >= 0")
