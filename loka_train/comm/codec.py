"""TorchRec quantized-comm codecs whose precision can change between steps without re-sharding.

TorchRec reads a codec's `quantized_dtype` only when planning (to estimate comm cost); the
collectives themselves size their buffers with `calc_quantized_size` and allocate them with
the dtype of the tensor `encode` returned, every call. So a codec may change precision
between steps as long as, within one collective, every rank agrees (the policy switches all
ranks at the same step) and encode, size and decode agree (the precision is frozen into the
`QuantizationContext` when TorchRec creates it, and decode reads it from there).

* All-to-all channels (pooled and sequence embeddings) carry a uint8 byte payload for every
  precision, so the wire dtype never changes; `quantized_dtype` is always uint8. The planner
  therefore estimates 1 byte per value whatever the precision (its cost model only).
* Reduce-scatter channels sum the payload, so it is a native fp32/fp16/bf16 tensor (FP8 and
  INT8 are refused, see `channel_supports`); `decode` goes by the payload's dtype.

Example:
    >>> state = CommState(CommConfig(a2a_forward=CommPrecision.FP8), backend="gloo")
    >>> sharder = EmbeddingBagCollectionSharder(
    ...     qcomm_codecs_registry=make_qcomm_codecs_registry(state))
    >>> # later, between steps, on every rank:
    >>> state.set_precision(CommChannel.A2A_FWD, CommPrecision.BF16,
    ...                     source=PrecisionSource.EXPLICIT)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from fbgemm_gpu.quantize_comm import QuantizationContext
from torchrec.distributed.types import CommOp, QuantizedCommCodecs

from loka_train.comm.config import CommChannel, CommPrecision
from loka_train.comm.formats import WireFormat, native_dtype
from loka_train.comm.state import CommState
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

_BYTES_CHANNELS = (CommChannel.A2A_FWD, CommChannel.A2A_BWD)
_NATIVE_CHANNELS = (CommChannel.RS_FWD, CommChannel.RS_BWD)


@dataclass
class CommContext(QuantizationContext):
    """FBGEMM's `QuantizationContext` (TorchRec reads `padded_dim_sum_per_rank` from it) plus
    the precision frozen when the collective started."""

    precision: CommPrecision | None = None
    """Precision of this collective call; encode, sizes and decode all use it."""


class SwitchableCodec:
    """A `QuantizedCommCodec` of one channel whose precision is `state.precision(channel)`.

    Args:
        state: the process's comm state (precision, statistics, measurements).
        channel: which channel this codec encodes (an all-to-all or reduce-scatter one).

    Example:
        >>> codec = SwitchableCodec(state, CommChannel.A2A_FWD)
        >>> ctx = codec.create_context()
        >>> payload = codec.encode(torch.randn(8, 32), ctx)
        >>> assert payload.numel() == codec.calc_quantized_size(256, ctx)
        >>> values = codec.decode(payload, ctx)
    """

    def __init__(self, state: CommState, channel: CommChannel) -> None:
        if channel not in _BYTES_CHANNELS + _NATIVE_CHANNELS:
            raise ValueError(
                f"SwitchableCodec serves the embedding collectives, not {channel.value} "
                "(dense gradients go through DenseGradCompressor)"
            )
        self._state = state
        self._channel = channel
        self._bytes_payload = channel in _BYTES_CHANNELS

    def __repr__(self) -> str:
        wire = "bytes" if self._bytes_payload else "native"
        return f"SwitchableCodec({self._channel.value}, {self.precision.name}, wire={wire})"

    @property
    def channel(self) -> CommChannel:
        """The channel this codec encodes."""
        return self._channel

    @property
    def precision(self) -> CommPrecision:
        """Precision a collective started now would use."""
        return self._state.precision(self._channel)

    def _precision(self, ctx: QuantizationContext | None) -> CommPrecision:
        if ctx is None and self._bytes_payload:
            # A uint8 payload has another element count than its values; a collective that
            # does not create a context does not size its buffers with calc_quantized_size.
            raise ValueError(
                f"SwitchableCodec({self._channel.value}) was called without a "
                "QuantizationContext: this TorchRec collective does not size its buffers with "
                "calc_quantized_size, so a byte payload cannot travel on it. Register the codec "
                "only for POOLED/SEQUENCE_EMBEDDINGS_ALL_TO_ALL."
            )
        if isinstance(ctx, CommContext):
            if ctx.precision is None:
                ctx.precision = self.precision
            return ctx.precision
        return self.precision

    def _format(self, ctx: QuantizationContext | None) -> WireFormat:
        return self._state.wire_format(self._channel, self._precision(ctx))

    # ------------------------------------------------------- QuantizedCommCodec API
    @property
    def quantized_dtype(self) -> torch.dtype:
        """Wire dtype: uint8 for all-to-all channels; the current precision's dtype otherwise."""
        if self._bytes_payload:
            return torch.uint8
        return native_dtype(self.precision)

    def create_context(self) -> CommContext:
        """A context that freezes the current precision for one collective call."""
        return CommContext(row_dim=self._state.config.row_dim, precision=self.precision)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        """Payload elements (bytes for all-to-all channels) for `input_len` values."""
        if not self._bytes_payload:
            return input_len
        return self._format(ctx).encoded_bytes(input_len)

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: QuantizationContext,
    ) -> tuple[int, int]:
        """(dim_sum, 0): no padding; `row_dim` must divide the per-rank slices instead."""
        dim_sum = input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]
        return dim_sum, 0

    def encode(
        self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Encode fp32 values; counts the payload bytes; measures SQNR on sampled steps."""
        precision = self._precision(ctx)
        fmt = self._state.wire_format(self._channel, precision)
        with profiled(f"loka/comm/encode/{self._channel.value}/{precision.value}"):
            if self._bytes_payload:
                payload = fmt.encode_bytes(input_tensor)
            else:
                payload = fmt.encode_native(input_tensor)
            self._state.stats.record(
                self._channel, precision, payload.numel() * payload.element_size()
            )
            if self._state.sampling:
                self._state.measure(self._channel, input_tensor)
        return payload

    def decode(
        self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Decode a received payload into fp32 values (flat for all-to-all channels)."""
        if not self._bytes_payload:
            return WireFormat.decode_native(input_grad)
        precision = self._precision(ctx)
        with profiled(f"loka/comm/decode/{self._channel.value}/{precision.value}"):
            return self._state.wire_format(self._channel, precision).decode_bytes(input_grad)


def make_qcomm_codecs_registry(comm_state: CommState) -> dict[str, QuantizedCommCodecs]:
    """Codecs for `EmbeddingBagCollectionSharder(qcomm_codecs_registry=...)`.

    Keyed like TorchRec's `get_qcomm_codecs_registry` (`CommOp` names). Every collective gets a
    codec, FP32 ones included, so the policy can lower any of them later without re-sharding.
    Pooled and sequence all-to-alls share the a2a channels (same precision, same counters).

    Args:
        comm_state: the process's comm state, shared with the policy and the dense hook.

    Example:
        >>> registry = make_qcomm_codecs_registry(CommState(CommConfig(), backend="gloo"))
        >>> sorted(registry)
        ['POOLED_EMBEDDINGS_ALL_TO_ALL', 'POOLED_EMBEDDINGS_REDUCE_SCATTER',
         'SEQUENCE_EMBEDDINGS_ALL_TO_ALL']
    """
    a2a = QuantizedCommCodecs(
        forward=SwitchableCodec(comm_state, CommChannel.A2A_FWD),
        backward=SwitchableCodec(comm_state, CommChannel.A2A_BWD),
    )
    reduce_scatter = QuantizedCommCodecs(
        forward=SwitchableCodec(comm_state, CommChannel.RS_FWD),
        backward=SwitchableCodec(comm_state, CommChannel.RS_BWD),
    )
    return {
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: a2a,
        CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name: reduce_scatter,
        CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name: a2a,
    }
