"""Serving what was trained: a LoKA model's dense towers for inference, and a numerics debugger.

* :func:`serve` (:mod:`.serving`): every site in the precision its plan chose for the forward
  GEMM, FP8 weights quantized once (:class:`ServeConfig`);
* :func:`load_trained` (:mod:`.load`): a run's model and plans from its checkpoint, unsharded;
* :func:`~loka_train.export.run.export_run` (:mod:`.run`, ``launch/export.py``): a run's
  export (served, evaluated against high precision, numerics per site) written to a directory;
* :class:`Monitor` (:mod:`.monitor`): a served model's requests, with each FP8 site's SQNR
  watched on a sampled fraction and a site flagged when it turns unsafe;
* :func:`export_dense` (:mod:`.program`): the served dense submodules as ``torch.export``
  programs (saved, loaded, installed back, or compiled by AOTInductor); :func:`compile_served`
  compiles them in place with ``torch.compile`` instead, and :class:`SkipGuards` calls them
  without re-checking dynamo's guards on the frozen model's state;
* :func:`decide_for_batch` (:mod:`.decide`): the plans re-decided for an inference batch size
  (the fastest of the trained FP8 forward and, with ``TrainedModel.safe_forwards``, every
  forward the Probe judged safe, kept only where it beats bf16 there);
* :func:`hold_ne` (:mod:`.gate`): the served NE held within a budget of high precision's on
  held-out batches: FP8 forwards moved to row-wise scales (:func:`next_rung`) or high
  precision, each move priced by the speed it gives up (:func:`forward_price`): the cheapest
  move that is enough, else the one that lowers the NE most for its price (of those that lower
  it at least half as much as the best);
* :func:`compare_sites` (:mod:`.debugger`): per site, on one batch, the FP8 output against
  fp32 on the same input and against a reference model, and the input's saturation.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from loka_train.kernels.plan import LinearPlan
    >>> from loka_train.mods import ModsConfig, convert
    >>> net = convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
    ...               config=ModsConfig(keep_last_layer_high=True))
    >>> served = serve(net, plans={"0": LinearPlan.fp8(backend="emulated")}, config=ServeConfig(dtype="fp32"))
    >>> served_sites(served)["0"]
    'fp8:e4m3/rowwise@emulated, weight quantized once'
    >>> with torch.no_grad():
    ...     rows = compare_sites(served, lambda m: m(torch.randn(8, 16)))
    >>> rows[0].local_sqnr_db > 20
    True
"""

from loka_train.export.config import ExportConfig, MonitorConfig, ServeConfig
from loka_train.export.debugger import SiteNumerics, compare_sites, format_numerics
from loka_train.export.decide import (
    InferenceDecision,
    SafeForwards,
    decide_for_batch,
    format_decisions,
    forward_ledger,
)
from loka_train.export.gate import (
    ROWWISE_PRICE,
    GateStep,
    format_gate,
    forward_price,
    hold_ne,
    next_rung,
)
from loka_train.export.load import TrainedModel, load_trained
from loka_train.export.monitor import Monitor
from loka_train.export.program import (
    SkipGuards,
    aoti_package,
    compile_served,
    export_dense,
    install_programs,
    load_programs,
    save_programs,
)
from loka_train.export.serving import (
    ServedWeight,
    serve,
    serve_embeddings,
    served_sites,
)

__all__ = [
    "ROWWISE_PRICE", "ExportConfig", "GateStep", "InferenceDecision", "Monitor", "MonitorConfig", "SafeForwards", "ServeConfig",
    "ServedWeight", "SiteNumerics", "SkipGuards", "TrainedModel", "aoti_package", "compare_sites", "compile_served",
    "decide_for_batch", "export_dense", "format_decisions", "format_gate", "format_numerics", "forward_ledger", "forward_price",
    "hold_ne", "install_programs", "load_programs", "load_trained", "next_rung", "save_programs", "serve",
    "serve_embeddings", "served_sites",
]
