"""loka_train.comm: quantized communication, switchable during the run.

* `SwitchableCodec` / `make_qcomm_codecs_registry`: TorchRec `QuantizedCommCodec`s for the
  embedding all-to-all and reduce-scatter (FP32, FP16, BF16, FP8 row-wise, INT8 row-wise).
* `DenseGradCompressor` / `install_dense_grad_hook`: DDP comm hook for dense gradients, with
  error feedback.
* `CommState`: precision per channel and SQNR measurements; its `CommStats`: bytes on the
  wire, fallbacks, switches.
* `WireFormat` / `CodecImpl`: the payload of each precision and the kernels that encode it
  (the PyTorch reference, fused Triton kernels in `comm.triton_codec`, FBGEMM's ops).
* `ReplicaSync`: the replica sync of 2D sparse parallelism (``trainer.sharding_group_size``):
  each replicated embedding shard's change since the last sync, averaged through the codecs.
* `CommPolicy`: lowers/raises each channel's precision from measured SQNR, on all ranks at once.

Example:
    >>> state = CommState(CommConfig(a2a_forward=CommPrecision.FP8,
    ...                              adaptive_channels=(CommChannel.A2A_FWD,)))
    >>> sharder = EmbeddingBagCollectionSharder(
    ...     qcomm_codecs_registry=make_qcomm_codecs_registry(state))
    >>> model = DistributedModelParallel(model, sharders=[sharder])
    >>> install_dense_grad_hook(model, state)
    >>> policy = CommPolicy(state)
"""

from loka_train.comm.codec import CommContext, SwitchableCodec, make_qcomm_codecs_registry
from loka_train.comm.config import CodecImpl, CommChannel, CommConfig, CommPrecision
from loka_train.comm.dense import DenseGradCompressor, dense_grad_comm_hook, install_dense_grad_hook
from loka_train.comm.formats import WireFormat
from loka_train.comm.policy import Action, CommPolicy, Proposal
from loka_train.comm.replica import ReplicaSync
from loka_train.comm.state import CommState, PrecisionSource, channel_supports
from loka_train.comm.stats import CommStats, FallbackEvent, SwitchEvent

__all__ = [
    "Action",
    "CodecImpl",
    "CommChannel",
    "CommConfig",
    "CommContext",
    "CommPolicy",
    "CommPrecision",
    "CommState",
    "CommStats",
    "DenseGradCompressor",
    "FallbackEvent",
    "PrecisionSource",
    "Proposal",
    "ReplicaSync",
    "SwitchEvent",
    "SwitchableCodec",
    "WireFormat",
    "channel_supports",
    "dense_grad_comm_hook",
    "install_dense_grad_hook",
    "make_qcomm_codecs_registry",
]
