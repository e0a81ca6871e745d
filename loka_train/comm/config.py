"""Configuration of quantized communication: precisions per collective and the switching policy.

Five *channels* carry data between ranks in a sharded DLRM step, each with its own precision:

=============  ==============================================================================
channel        what travels
=============  ==============================================================================
a2a_fwd        pooled (and sequence) embeddings, embedding all-to-all, forward
a2a_bwd        their gradients, embedding all-to-all, backward
rs_fwd         pooled embeddings, reduce-scatter (row-wise / table-row-wise sharding), forward
rs_bwd         their gradients (an all-gather), backward
dense_grad     dense parameter gradients, DDP all-reduce (through a comm hook)
replica_sync   2D sparse parallelism: each replicated embedding shard's change since the last
               sync, averaged over its replica group (`comm.replica.ReplicaSync`)
=============  ==============================================================================

Example:
    >>> cfg = CommConfig(
    ...     a2a_forward=CommPrecision.BF16,
    ...     adaptive_channels=(CommChannel.A2A_FWD, CommChannel.A2A_BWD),
    ... )
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from loka_train.kernels.formats import Fp8Format

# FP8 element formats a comm payload may use (OCP e4m3fn / e5m2).
COMM_FP8_FORMATS = (Fp8Format.E4M3, Fp8Format.E5M2)


class CommPrecision(Enum):
    """Precision of the data a collective carries.

    FP8 and INT8 are row-wise: every `row_dim` consecutive values share one fp32 scale (FP8) or
    one fp32 scale and offset (INT8). FP8 uses e4m3 for forward data and e5m2 for gradients by
    default (see `CommConfig.forward_fp8_format` / `backward_fp8_format`).
    """

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def order(self) -> int:
        """Rank by expected precision (higher is more precise): FP32 > FP16 > BF16 > INT8 > FP8.

        FP16 ranks above BF16 (10 vs 7 mantissa bits) although its range is smaller: the
        policy measures the error on the real tensors, clamping included, so range problems
        show up as low SQNR.
        """
        return _PRECISION_ORDER[self]

    @property
    def is_lossless(self) -> bool:
        """True only for FP32 (the reference: no encoding error)."""
        return self is CommPrecision.FP32

    @property
    def is_rowwise(self) -> bool:
        """True for the scaled row-wise formats (FP8, INT8), whose payload is not summable."""
        return self in (CommPrecision.FP8, CommPrecision.INT8)


_PRECISION_ORDER = {
    CommPrecision.FP32: 4,
    CommPrecision.FP16: 3,
    CommPrecision.BF16: 2,
    CommPrecision.INT8: 1,
    CommPrecision.FP8: 0,
}


class CodecImpl(Enum):
    """Which kernels encode and decode FP8 and 16-bit payloads (see `CommConfig.codec_impl`)."""

    AUTO = "auto"
    """TRITON where the Triton codec runs on the tensor's device (CUDA, sm_89+), else
    REFERENCE. Never FBGEMM: its FP8 payload has another layout."""

    REFERENCE = "reference"
    """Pure PyTorch (several elementwise kernels per call); the numerical oracle."""

    FBGEMM = "fbgemm"
    """FBGEMM's row-wise quantize ops for FP8 and INT8 (CUDA only; FBGEMM's FP8 layout and
    variants, see `comm.formats`); 16-bit payloads as REFERENCE."""

    TRITON = "triton"
    """One fused Triton kernel per FP8 encode, FP8 decode and 16-bit encode
    (`comm.triton_codec`), bit-identical to REFERENCE on the same device; INT8 as REFERENCE.
    Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (tests)."""


class CommChannel(Enum):
    """One direction of one collective; each has its own precision (see module docstring)."""

    A2A_FWD = "a2a_fwd"
    A2A_BWD = "a2a_bwd"
    RS_FWD = "rs_fwd"
    RS_BWD = "rs_bwd"
    DENSE_GRAD = "dense_grad"
    REPLICA_SYNC = "replica_sync"

    @property
    def is_backward(self) -> bool:
        """True for channels that carry gradients (a replica sync carries the sum of the
        updates since the last sync, so it takes the gradient channels' thresholds)."""
        return self in (
            CommChannel.A2A_BWD, CommChannel.RS_BWD, CommChannel.DENSE_GRAD, CommChannel.REPLICA_SYNC,
        )


_E = TypeVar("_E", bound=Enum)


def _coerce_enum(enum_type: type[_E], value: object, field_name: str) -> _E:
    """Accept an enum member, its value ("bf16") or its name ("BF16"); ValueError otherwise."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        for member in enum_type:
            if value in (member.value, member.name):
                return member
    choices = [member.name for member in enum_type]
    raise ValueError(f"comm.{field_name}={value!r}: choose one of {choices}")


@dataclass(kw_only=True)
class CommConfig:
    """Precisions of the embedding collectives and dense gradients, and how the policy moves them.

    The default changes no numerics: every channel is FP32 and the policy changes nothing.

    Example:
        >>> CommConfig(a2a_forward=CommPrecision.FP8, a2a_backward=CommPrecision.BF16)
    """

    a2a_forward: CommPrecision = CommPrecision.FP32
    """Initial precision of the embedding all-to-all, forward (pooled embeddings). Any
    precision is supported: the payload travels as bytes."""

    a2a_backward: CommPrecision = CommPrecision.FP32
    """Initial precision of the embedding all-to-all, backward (embedding gradients)."""

    reduce_scatter_forward: CommPrecision = CommPrecision.FP32
    """Initial precision of the pooled-embedding reduce-scatter, forward. Only FP32, FP16 and
    BF16: the collective sums the encoded payload, so scaled row-wise formats cannot travel."""

    reduce_scatter_backward: CommPrecision = CommPrecision.FP32
    """Initial precision of the reduce-scatter's backward all-gather. Only FP32, FP16, BF16:
    TorchRec sizes its buffers by element count, so the payload must keep one element per
    value."""

    dense_grads: CommPrecision = CommPrecision.FP32
    """Initial precision of the dense-gradient all-reduce (DDP comm hook). FP8/INT8 travel as
    an all-gather of row-wise payloads that every rank decodes and averages in fp32."""

    replica_sync: CommPrecision = CommPrecision.FP32
    """Initial precision of the replica sync of 2D sparse parallelism
    (``trainer.sharding_group_size``): the change of each replicated embedding shard since the
    last sync, averaged over its replicas. FP32 averages the weights themselves (TorchRec's
    ``DMPCollection.sync``); FP16/BF16 all-gather the change (averaged in fp32), FP8/INT8
    all-gather it row-wise.
    Lossy precisions keep an error-feedback residual per tensor (``dense_error_feedback``).

    Memory: a sync through LoKA (this channel lossy or adaptive) keeps on every rank an fp32
    copy of its replicated shards as they were at the last sync (the anchor the changes are
    taken from; an adaptive channel needs it at FP32 too, to measure the candidates), plus,
    while the channel is lossy with error feedback, an fp32 residual of the same size: up to
    twice the rank's replicated tables in fp32 (logged at start). A static FP32 channel keeps
    neither (``DMPCollection``'s own sync runs)."""

    adaptive_channels: tuple[CommChannel, ...] = ()
    """Channels whose precision the policy may change during the run; empty: static."""

    ladder: tuple[CommPrecision, ...] = (CommPrecision.FP32, CommPrecision.BF16, CommPrecision.FP8)
    """Precisions the policy may choose from (any order), further limited by `min_precision`,
    `max_precision` and what each channel supports."""

    min_precision: CommPrecision = CommPrecision.FP8
    """Lowest precision the policy may choose (by `CommPrecision.order`)."""

    max_precision: CommPrecision = CommPrecision.FP32
    """Highest precision the policy may choose."""

    forward_lower_sqnr_db: float = 25.0
    """Forward channels: the policy lowers to the cheapest precision whose measured SQNR (dB)
    on the channel's own tensors is at least this."""

    forward_raise_sqnr_db: float = 20.0
    """Forward channels: the policy raises when the current precision's measured SQNR falls
    below this. Must be below `forward_lower_sqnr_db` (the gap is the hysteresis band)."""

    backward_lower_sqnr_db: float = 20.0
    """Gradient channels (a2a_bwd, rs_bwd, dense_grad, replica_sync): SQNR (dB) needed to lower."""

    backward_raise_sqnr_db: float = 15.0
    """Gradient channels: raise below this SQNR (dB). Must be below `backward_lower_sqnr_db`."""

    lower_patience: int = 3
    """Consecutive policy updates that must propose the same lower precision before it is
    applied (hysteresis in time; lowering is never urgent)."""

    raise_patience: int = 1
    """Consecutive policy updates that must propose the same higher precision before it is
    applied (1: raise at once, accuracy first)."""

    sample_every: int = 10
    """Measure the SQNR of the candidate precisions on every `sample_every`-th step (encode,
    decode, compare on the real tensors, kept on device); the replica sync measures on every
    `sample_every`-th sync instead. 0 disables measuring."""

    policy_interval: int = 100
    """Steps between policy updates: `CommPolicy.maybe_update(step)` updates after steps
    interval-1, 2*interval-1, ...; each update is one small all-reduce."""

    row_dim: int = 32
    """Values per scale for row-wise FP8/INT8: consecutive runs of the flattened tensor. Must
    divide every per-rank slice of the all-to-all (in practice: every embedding dim); a
    mismatch raises with the sizes involved."""

    forward_fp8_format: Fp8Format = Fp8Format.E4M3
    """FP8 element format of forward channels: E4M3 (float8_e4m3fn, max 448, 3 mantissa
    bits) or E5M2 (float8_e5m2, max 57344, 2 mantissa bits)."""

    backward_fp8_format: Fp8Format = Fp8Format.E5M2
    """FP8 element format of the embedding-gradient channels (a2a_bwd)."""

    dense_fp8_format: Fp8Format = Fp8Format.E4M3
    """FP8 element format of the dense-gradient hook and of the replica sync (row-wise scaling
    bounds the range and error feedback carries what is rounded away, so precision beats range
    here)."""

    dense_error_feedback: bool = True
    """Dense gradients: keep, per DDP bucket, the error the lossy encoding made and add it to
    the next step's gradient (error feedback), so no update is lost over time. The replica sync
    (``replica_sync``) keeps one such residual per replicated tensor under the same switch."""

    codec_impl: CodecImpl = CodecImpl.AUTO
    """Kernels of the FP8 / FP16 / BF16 (and INT8) encoders and decoders: AUTO (fused Triton
    kernels where they run on the collective's device, else the pure-PyTorch reference),
    REFERENCE, TRITON (same payload, same numbers as REFERENCE, one kernel per encode and per
    FP8 decode; CUDA sm_89+) or FBGEMM (FBGEMM's row-wise ops, CUDA only: the FP8 payload then
    has FBGEMM's layout, 8 bytes of scale per row, and its FP8 variants, e4m3 bias 15 forward
    and e5m2 bias 31 backward; every rank must use it). An explicit TRITON or FBGEMM that
    cannot run on the device raises when the comm state is built."""

    def __post_init__(self) -> None:
        for name in (
            "a2a_forward",
            "a2a_backward",
            "reduce_scatter_forward",
            "reduce_scatter_backward",
            "dense_grads",
            "replica_sync",
            "min_precision",
            "max_precision",
        ):
            setattr(self, name, _coerce_enum(CommPrecision, getattr(self, name), name))
        for name in ("forward_fp8_format", "backward_fp8_format", "dense_fp8_format"):
            fmt = _coerce_enum(Fp8Format, getattr(self, name), name)
            if fmt not in COMM_FP8_FORMATS:
                raise ValueError(
                    f"comm.{name}={fmt.name}: choose one of {[f.name for f in COMM_FP8_FORMATS]}"
                )
            setattr(self, name, fmt)
        self.codec_impl = _coerce_enum(CodecImpl, self.codec_impl, "codec_impl")
        self.adaptive_channels = tuple(
            _coerce_enum(CommChannel, c, "adaptive_channels") for c in self.adaptive_channels
        )
        self.ladder = tuple(_coerce_enum(CommPrecision, p, "ladder") for p in self.ladder)

        if len(set(self.adaptive_channels)) != len(self.adaptive_channels):
            raise ValueError(f"comm.adaptive_channels={self.adaptive_channels} has duplicates")
        if not self.ladder:
            raise ValueError("comm.ladder is empty: list at least one precision")
        if len(set(self.ladder)) != len(self.ladder):
            raise ValueError(f"comm.ladder={self.ladder} has duplicates")
        if self.min_precision.order > self.max_precision.order:
            raise ValueError(
                f"comm.min_precision={self.min_precision.name} is above "
                f"comm.max_precision={self.max_precision.name}"
            )
        if self.adaptive_channels and not any(
            self.min_precision.order <= p.order <= self.max_precision.order for p in self.ladder
        ):
            raise ValueError(
                f"comm.ladder={[p.name for p in self.ladder]} has no precision between "
                f"min_precision={self.min_precision.name} and max_precision="
                f"{self.max_precision.name}: the policy would have nothing to choose"
            )
        for direction in ("forward", "backward"):
            lower = getattr(self, f"{direction}_lower_sqnr_db")
            raise_ = getattr(self, f"{direction}_raise_sqnr_db")
            if not lower > raise_:
                raise ValueError(
                    f"comm.{direction}_lower_sqnr_db={lower} must be above "
                    f"comm.{direction}_raise_sqnr_db={raise_} (the gap is the hysteresis band)"
                )
        for name in ("lower_patience", "raise_patience", "policy_interval", "row_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"comm.{name}={getattr(self, name)} must be >= 1")
        if self.sample_every < 0:
            raise ValueError(f"comm.sample_every={self.sample_every} must be >= 0")
        if self.adaptive_channels and self.sample_every == 0:
            raise ValueError(
                "comm.adaptive_channels is set but comm.sample_every=0: the policy needs "
                "measurements; set sample_every >= 1"
            )
        if self.codec_impl is CodecImpl.FBGEMM and self.row_dim % 4 != 0:
            raise ValueError(
                f"comm.row_dim={self.row_dim} must be a multiple of 4 with "
                "codec_impl=FBGEMM (FBGEMM aligns each row's payload to 4 bytes)"
            )

    def initial_precision(self, channel: CommChannel) -> CommPrecision:
        """The configured starting precision of `channel`."""
        return {
            CommChannel.A2A_FWD: self.a2a_forward,
            CommChannel.A2A_BWD: self.a2a_backward,
            CommChannel.RS_FWD: self.reduce_scatter_forward,
            CommChannel.RS_BWD: self.reduce_scatter_backward,
            CommChannel.DENSE_GRAD: self.dense_grads,
            CommChannel.REPLICA_SYNC: self.replica_sync,
        }[channel]

    def fp8_format(self, channel: CommChannel) -> Fp8Format:
        """FP8 element format used on `channel`."""
        if channel in (CommChannel.DENSE_GRAD, CommChannel.REPLICA_SYNC):
            return self.dense_fp8_format
        return self.backward_fp8_format if channel.is_backward else self.forward_fp8_format

    def sqnr_thresholds_db(self, channel: CommChannel) -> tuple[float, float]:
        """(lower_db, raise_db) of `channel`'s direction."""
        if channel.is_backward:
            return self.backward_lower_sqnr_db, self.backward_raise_sqnr_db
        return self.forward_lower_sqnr_db, self.forward_raise_sqnr_db
