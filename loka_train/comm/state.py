"""Runtime state of quantized communication: precision per channel, measurements, counters.

One `CommState` per process is shared by the embedding codecs (`make_qcomm_codecs_registry`),
the dense-gradient hook (`DenseGradCompressor`) and the policy (`CommPolicy`). It holds:

* the precision each channel uses now (changed only between steps, on all ranks at once);
* `CommStats`: bytes on the wire per channel per step and in total, calls per precision,
  fallback events and precision switches (the run report);
* the SQNR buffer: on sampled steps each encoder measures, on its own tensors, the error of
  every candidate precision (signal and noise power sums, on device, no host sync).

Example:
    >>> state = CommState(CommConfig(a2a_forward=CommPrecision.FP8), backend="gloo")
    >>> state.begin_step(0)
    >>> ...  # forward/backward: codecs record bytes and measure
    >>> metrics = state.end_step()  # {"comm/a2a_fwd/bytes": ..., ...}
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cache

import torch
import torch.distributed as dist
from packaging.version import Version

from loka_train.comm.config import CommChannel, CommConfig, CommPrecision
from loka_train.comm.formats import WireFormat, check_codec_impl
from loka_train.comm.stats import CommStats, FallbackEvent

logger = logging.getLogger(__name__)

_CHANNELS = tuple(CommChannel)
_PRECISIONS = tuple(CommPrecision)
_CHANNEL_INDEX = {c: i for i, c in enumerate(_CHANNELS)}
_PRECISION_INDEX = {p: i for i, p in enumerate(_PRECISIONS)}
# Rows of the SQNR buffer: summed signal power, summed noise power, number of measurements.
_SIGNAL, _NOISE, _COUNT = 0, 1, 2

# Collectives that sum their payload: only unscaled float formats can travel.
_SUMMING_CHANNELS = (CommChannel.RS_FWD, CommChannel.RS_BWD)
# gloo gained bfloat16 (pytorch#113557, late 2023); bf16 reduce-scatter / all-reduce on gloo
# measured working on torch 2.11 and 2.13. Older versions are treated as unsupported.
_GLOO_BF16_MIN_TORCH = Version("2.3")


class PrecisionSource(Enum):
    """Who asked for a precision: decides between raising and a counted fallback."""

    EXPLICIT = "explicit"
    """Config or user: an unsupported request raises ValueError."""

    POLICY = "policy"
    """The policy: an unsupported request falls back upward, logged and counted."""


@cache
def _gloo_bf16_supported() -> tuple[bool, str]:
    torch_version = Version(torch.__version__.split("+")[0])
    if torch_version >= _GLOO_BF16_MIN_TORCH:
        return True, ""
    return False, (
        f"gloo in torch {torch_version} has no bfloat16 reductions (needs torch >= "
        f"{_GLOO_BF16_MIN_TORCH}); use FP16"
    )


def channel_supports(
    channel: CommChannel, precision: CommPrecision, *, backend: str
) -> tuple[bool, str]:
    """Whether `precision` can travel on `channel` with `backend`, and why not.

    Example:
        >>> channel_supports(CommChannel.RS_FWD, CommPrecision.FP8, backend="nccl")
        (False, 'reduce-scatter sums the encoded payload ...')
    """
    if channel in _SUMMING_CHANNELS and precision.is_rowwise:
        direction = "backward all-gather" if channel is CommChannel.RS_BWD else "forward"
        return False, (
            f"{precision.name} on the pooled-embedding reduce-scatter ({direction}): the "
            "reduce-scatter sums the encoded payload (and TorchRec sizes its buffers by element "
            "count), so a row-wise scaled format cannot travel; use FP32, FP16 or BF16"
        )
    # The replica sync gathers its 16-bit payloads as bytes and sums them in fp32.
    summed_natively = channel in _SUMMING_CHANNELS or (
        channel is CommChannel.DENSE_GRAD and not precision.is_rowwise
    )
    if summed_natively and precision is CommPrecision.BF16 and backend == "gloo":
        return _gloo_bf16_supported()
    return True, ""


@dataclass
class _ChannelState:
    precision: CommPrecision
    ladder: tuple[CommPrecision, ...] = field(default_factory=tuple)


class CommState:
    """Precision per channel, statistics and SQNR measurements of one process.

    Args:
        config: the comm configuration; its initial precisions are explicit requests, so an
            unsupported one raises here.
        backend: "gloo" or "nccl"; None: the default process group's backend if initialized,
            else "nccl" for a CUDA `device` and "gloo" otherwise.
        device: where the SQNR buffer lives (the device collectives run on; an explicit
            `config.codec_impl` must run there); None: the current CUDA device for nccl,
            else CPU.

    Example:
        >>> state = CommState(CommConfig(reduce_scatter_forward=CommPrecision.FP16),
        ...                   backend="gloo")
        >>> state.precision(CommChannel.RS_FWD)
        <CommPrecision.FP16: 'fp16'>
    """

    def __init__(
        self,
        config: CommConfig,
        *,
        backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if device is not None:
            device = torch.device(device)
        if backend is None:
            if dist.is_available() and dist.is_initialized():
                backend = str(dist.get_backend())
            else:
                backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        check_codec_impl(config.codec_impl, device, config.row_dim)
        self.config = config
        self.backend = backend
        self.device = device
        self.stats = CommStats()
        self.step = -1
        self.sampling = False
        """True during a step whose tensors are measured (set by `begin_step`)."""
        self._sampling_before_eval = False
        self.sqnr_sums = torch.zeros(
            len(_CHANNELS), 3, len(_PRECISIONS), dtype=torch.float64, device=device
        )
        """[channel, (signal, noise, count), precision] sums since the last policy update."""
        self._formats: dict[tuple[CommChannel, CommPrecision], WireFormat] = {}
        self._warned: set[object] = set()
        self._channels: dict[CommChannel, _ChannelState] = {}
        for channel in _CHANNELS:
            self._channels[channel] = _ChannelState(precision=CommPrecision.FP32)
            self.set_precision(
                channel, config.initial_precision(channel), source=PrecisionSource.EXPLICIT
            )
            if channel in config.adaptive_channels:
                self._channels[channel].ladder = self._policy_ladder(channel)

    # ------------------------------------------------------------------ precision
    def precision(self, channel: CommChannel) -> CommPrecision:
        """Precision `channel` uses now."""
        return self._channels[channel].precision

    def precisions(self) -> dict[CommChannel, CommPrecision]:
        """Precision of every channel now."""
        return {c: s.precision for c, s in self._channels.items()}

    def ladder(self, channel: CommChannel) -> tuple[CommPrecision, ...]:
        """Precisions the policy may choose on `channel`, most precise first (empty: static)."""
        return self._channels[channel].ladder

    def supports(self, channel: CommChannel, precision: CommPrecision) -> tuple[bool, str]:
        """Whether `precision` can be used on `channel` here, and why not."""
        return channel_supports(channel, precision, backend=self.backend)

    def set_precision(
        self,
        channel: CommChannel,
        precision: CommPrecision,
        *,
        source: PrecisionSource,
    ) -> CommPrecision:
        """Use `precision` on `channel` from now on; returns the precision actually used.

        Call only between steps and identically on every rank (the policy does both).

        Raises:
            ValueError: `precision` is unsupported on `channel` and `source` is EXPLICIT.
        """
        ok, reason = self.supports(channel, precision)
        if not ok:
            if source is PrecisionSource.EXPLICIT:
                raise ValueError(
                    f"comm precision {precision.name} requested for {channel.value} "
                    f"(backend {self.backend}) is not supported: {reason}"
                )
            used = self._nearest_supported_above(channel, precision)
            self._record_fallback(channel, precision, used, reason)
            precision = used
        self._channels[channel].precision = precision
        return precision

    def _nearest_supported_above(
        self, channel: CommChannel, precision: CommPrecision
    ) -> CommPrecision:
        candidates = sorted(
            (p for p in _PRECISIONS if p.order > precision.order), key=lambda p: p.order
        )
        for candidate in candidates:
            if self.supports(channel, candidate)[0]:
                return candidate
        return CommPrecision.FP32

    def _record_fallback(
        self, channel: CommChannel, requested: CommPrecision, used: CommPrecision, reason: str
    ) -> None:
        event = FallbackEvent(
            step=self.step, channel=channel, requested=requested, used=used, reason=reason
        )
        self.stats.fallbacks.append(event)
        logger.warning(
            "comm fallback on %s: %s requested by the policy, %s used instead: %s",
            channel.value,
            requested.name,
            used.name,
            reason,
        )

    def _policy_ladder(self, channel: CommChannel) -> tuple[CommPrecision, ...]:
        cfg = self.config
        in_range = [
            p for p in cfg.ladder if cfg.min_precision.order <= p.order <= cfg.max_precision.order
        ]
        ladder = []
        for p in sorted(in_range, key=lambda p: -p.order):
            ok, reason = self.supports(channel, p)
            if ok:
                ladder.append(p)
            else:
                # The policy could have chosen it: a counted fallback, once, at setup.
                self._record_fallback(channel, p, self._nearest_supported_above(channel, p), reason)
        if not ladder:
            ladder = [self._nearest_supported_above(channel, cfg.min_precision)]
        return tuple(ladder)

    def wire_format(self, channel: CommChannel, precision: CommPrecision) -> WireFormat:
        """The encoder/decoder `channel` uses for `precision` (cached)."""
        key = (channel, precision)
        fmt = self._formats.get(key)
        if fmt is None:
            fmt = WireFormat(
                precision=precision,
                row_dim=self.config.row_dim,
                fp8_format=self.config.fp8_format(channel),
                impl=self.config.codec_impl,
            )
            self._formats[key] = fmt
        return fmt

    # ------------------------------------------------------------------ steps
    def begin_step(self, step: int) -> None:
        """Mark the start of training step `step` (decides whether it is measured)."""
        self.step = step
        every = self.config.sample_every
        self.sampling = every > 0 and step % every == 0

    def begin_eval(self) -> None:
        """An evaluation starts: its collectives are counted apart (`CommStats.eval_bytes`)
        and not measured, so the step's bytes and the policy's SQNR describe training only."""
        self._sampling_before_eval = self.sampling
        self.sampling = False
        self.stats.evaluating = True

    def end_eval(self) -> None:
        """The evaluation ended: training counters and sampling resume."""
        self.stats.evaluating = False
        self.sampling = self._sampling_before_eval

    def end_step(self) -> dict[str, float]:
        """Close the step; returns its metrics (bytes and calls per channel, fallbacks)."""
        step_bytes, step_calls = self.stats.take_step()
        metrics: dict[str, float] = {}
        for channel in _CHANNELS:
            metrics[f"comm/{channel.value}/bytes"] = float(step_bytes[channel])
            metrics[f"comm/{channel.value}/calls"] = float(step_calls[channel])
        metrics["comm/fallbacks"] = float(len(self.stats.fallbacks))
        metrics["comm/switches"] = float(len(self.stats.switches))
        self.sampling = False
        return metrics

    # ------------------------------------------------------------------ measuring
    def candidates(self, channel: CommChannel) -> tuple[CommPrecision, ...]:
        """Lossy precisions measured on `channel`: its policy ladder and its current one."""
        wanted = set(self.ladder(channel)) | {self.precision(channel)}
        return tuple(p for p in _PRECISIONS if p in wanted and not p.is_lossless)

    @torch.no_grad()
    def measure(self, channel: CommChannel, x: torch.Tensor) -> None:
        """Add the error every candidate precision makes on `x` to the SQNR buffer (on device).

        Row-wise candidates need `x.numel()` to be a multiple of `row_dim` (pad first).
        """
        candidates = self.candidates(channel)
        if not candidates:
            return
        x = x.detach().float().reshape(-1)
        # Summed in fp32 (relative error ~1e-6, nothing for a dB figure), then added in fp64: an
        # fp64 reduction would first copy `x` to fp64, and `x` may hold every replicated table
        # (the replica sync measures its whole change).
        signal = x.square().sum().double()
        sums = self.sqnr_sums[_CHANNEL_INDEX[channel]]
        for precision in candidates:
            idx = _PRECISION_INDEX[precision]
            if precision.is_rowwise and x.numel() % self.config.row_dim != 0:
                # This tensor could not travel row-wise at all: rule the precision out.
                self._warn_once(
                    (channel, precision),
                    f"comm: {channel.value} tensor of {x.numel()} values is not a multiple of "
                    f"row_dim={self.config.row_dim}; {precision.name} is measured as unusable",
                )
                sums[_SIGNAL, idx] += signal.to(sums.device)
                sums[_NOISE, idx] += float("inf")
                sums[_COUNT, idx] += 1
                continue
            approx = self.wire_format(channel, precision).roundtrip(x)
            noise = (x - approx).square().sum().double()
            sums[_SIGNAL, idx] += signal.to(sums.device)
            sums[_NOISE, idx] += noise.to(sums.device)
            sums[_COUNT, idx] += 1

    def _warn_once(self, key: object, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def add_measurement(
        self,
        channel: CommChannel,
        precision: CommPrecision,
        *,
        signal_power: torch.Tensor | float,
        noise_power: torch.Tensor | float,
    ) -> None:
        """Feed an external measurement (e.g. from the Probe) into the SQNR buffer."""
        sums = self.sqnr_sums[_CHANNEL_INDEX[channel]]
        idx = _PRECISION_INDEX[precision]
        sums[_SIGNAL, idx] += signal_power
        sums[_NOISE, idx] += noise_power
        sums[_COUNT, idx] += 1

    def take_sqnr_sums(self) -> torch.Tensor:
        """Return a copy of the SQNR buffer and zero it (policy update)."""
        sums = self.sqnr_sums.clone()
        self.sqnr_sums.zero_()
        return sums

    @staticmethod
    def sqnr_db_from_sums(sums: torch.Tensor) -> dict[CommChannel, dict[CommPrecision, float]]:
        """SQNR (dB) per channel and measured precision from a (reduced) SQNR buffer.

        Host sync (one `.tolist()`): call on policy updates only.
        """
        values = sums.tolist()
        result: dict[CommChannel, dict[CommPrecision, float]] = {}
        for channel in _CHANNELS:
            per_precision: dict[CommPrecision, float] = {}
            rows = values[_CHANNEL_INDEX[channel]]
            for precision in _PRECISIONS:
                idx = _PRECISION_INDEX[precision]
                if rows[_COUNT][idx] == 0:
                    continue
                signal, noise = rows[_SIGNAL][idx], rows[_NOISE][idx]
                if math.isnan(signal) or math.isnan(noise):
                    per_precision[precision] = float("nan")
                elif noise == 0:
                    per_precision[precision] = float("inf")
                elif signal == 0 or math.isinf(noise):
                    per_precision[precision] = float("-inf")
                else:
                    per_precision[precision] = 10 * math.log10(signal / noise)
            if per_precision:
                result[channel] = per_precision
        return result

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, object]:
        """What each channel used: precision now, bytes and calls per precision, fallbacks."""
        stats = self.stats
        return {
            "backend": self.backend,
            "channels": {
                c.value: {
                    "precision": self.precision(c).name,
                    "policy_ladder": [p.name for p in self.ladder(c)],
                    "total_bytes": stats.total_bytes[c],
                    "eval_bytes": stats.eval_bytes[c],
                    "bytes_by_precision": {
                        p.name: n for p, n in stats.bytes_by_precision[c].items()
                    },
                    "calls_by_precision": {
                        p.name: n for p, n in stats.calls_by_precision[c].items()
                    },
                }
                for c in _CHANNELS
            },
            "fallbacks": [
                {
                    "step": e.step,
                    "channel": e.channel.value,
                    "requested": e.requested.name,
                    "used": e.used.name,
                    "reason": e.reason,
                }
                for e in stats.fallbacks
            ],
            "switches": [
                {
                    "step": e.step,
                    "channel": e.channel.value,
                    "old": e.old.name,
                    "new": e.new.name,
                    "reason": e.reason,
                }
                for e in stats.switches
            ],
        }

    def state_dict(self) -> dict[str, object]:
        """Checkpointable state: precision per channel, the SQNR sums of the policy interval in
        progress (a resumed run then decides on the same samples as an uninterrupted one) and
        the statistics (bytes, calls, fallbacks, switches) for the run report."""
        return {
            "precisions": {c.value: p.value for c, p in self.precisions().items()},
            "sqnr_sums": self.sqnr_sums.detach().cpu().clone(),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what `state_dict` saved.

        Adaptive channels take the saved precision (the policy's decision so far); a static
        channel keeps its configured precision: the config of the resumed run is the user's
        explicit request, and a change against the checkpoint is logged. Older checkpoints
        without SQNR sums or statistics restore the precisions only.
        """
        precisions = state["precisions"]
        assert isinstance(precisions, dict)
        for name, value in precisions.items():
            channel, saved = CommChannel(name), CommPrecision(value)
            if channel in self.config.adaptive_channels:
                self.set_precision(channel, saved, source=PrecisionSource.EXPLICIT)
            elif saved is not self.precision(channel):
                logger.warning(
                    "comm: %s ran at %s in the checkpoint; the config asks for %s (static "
                    "channel), which is used from now on",
                    channel.value, saved.name, self.precision(channel).name,
                )
        if "sqnr_sums" in state:
            sums = state["sqnr_sums"]
            assert isinstance(sums, torch.Tensor)
            if sums.shape[0] < self.sqnr_sums.shape[0] and sums.shape[1:] == self.sqnr_sums.shape[1:]:
                # Channels only ever append: a shorter buffer holds the leading channels, and
                # missing ones get zero rows: no measurement.
                sums = torch.cat([sums, sums.new_zeros(self.sqnr_sums.shape[0] - sums.shape[0], *sums.shape[1:])])
            if sums.shape != self.sqnr_sums.shape:
                raise ValueError(
                    f"comm: checkpoint SQNR buffer has shape {tuple(sums.shape)}, this version "
                    f"uses {tuple(self.sqnr_sums.shape)}; resume with the loka_train version that "
                    "wrote it, or set trainer.resume=never"
                )
            self.sqnr_sums.copy_(sums.to(self.sqnr_sums.device, self.sqnr_sums.dtype))
        if "stats" in state:
            stats = state["stats"]
            assert isinstance(stats, dict)
            self.stats.load_state_dict(stats)
