"""What went over the wire: bytes and calls per channel and precision, fallbacks, switches.

`CommStats` is the counter half of `CommState` (which owns one): the codecs and the dense
hook `record` every encoded payload; `CommState.end_step` turns a step's counters into
metrics; the run report and the checkpoint carry the totals and the events.

Example:
    >>> stats = CommStats()
    >>> stats.record(CommChannel.A2A_FWD, CommPrecision.FP8, 4096)
    >>> stats.take_step()[0][CommChannel.A2A_FWD]
    4096
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from loka_train.comm.config import CommChannel, CommPrecision

_CHANNELS = tuple(CommChannel)


@dataclass(frozen=True)
class FallbackEvent:
    """A precision that was asked for but could not be used."""

    step: int
    """Training step (-1: at setup)."""
    channel: CommChannel
    """Where."""
    requested: CommPrecision
    """What was asked for."""
    used: CommPrecision
    """What is used instead."""
    reason: str
    """Why the request could not be honoured."""


@dataclass(frozen=True)
class SwitchEvent:
    """A precision change applied by the policy (same step on every rank)."""

    step: int
    """Step after which it was applied (the new precision is used from the next step)."""
    channel: CommChannel
    """Which channel."""
    old: CommPrecision
    """Precision before."""
    new: CommPrecision
    """Precision after."""
    reason: str
    """Measured SQNRs that motivated it."""


class CommStats:
    """Counters of what went over the wire: the metrics and the run report.

    Bytes are payload bytes this rank handed to a collective (for an all-to-all this includes
    the slice it sends to itself), counted in the encoder from the payload's size, so no
    device sync is needed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_bytes: dict[CommChannel, int] = dict.fromkeys(_CHANNELS, 0)
        """Bytes per channel in the current step (reset by `end_step`)."""
        self.step_calls: dict[CommChannel, int] = dict.fromkeys(_CHANNELS, 0)
        """Encoder calls per channel in the current step."""
        self.total_bytes: dict[CommChannel, int] = dict.fromkeys(_CHANNELS, 0)
        """Bytes per channel since the start."""
        self.bytes_by_precision: dict[CommChannel, dict[CommPrecision, int]] = {
            c: {} for c in _CHANNELS
        }
        """Bytes per channel and precision actually used."""
        self.calls_by_precision: dict[CommChannel, dict[CommPrecision, int]] = {
            c: {} for c in _CHANNELS
        }
        """Encoder calls per channel and precision actually used."""
        self.eval_bytes: dict[CommChannel, int] = dict.fromkeys(_CHANNELS, 0)
        """Bytes per channel moved by evaluation forwards (kept out of the training counters)."""
        self.evaluating = False
        """True while an evaluation runs: `record` counts into `eval_bytes` only."""
        self.fallbacks: list[FallbackEvent] = []
        """Every fallback, in order."""
        self.switches: list[SwitchEvent] = []
        """Every policy switch, in order."""

    def record(self, channel: CommChannel, precision: CommPrecision, num_bytes: int) -> None:
        """Count one encoded payload of `num_bytes` on `channel`."""
        with self._lock:
            if self.evaluating:
                self.eval_bytes[channel] += num_bytes
                return
            self.step_bytes[channel] += num_bytes
            self.step_calls[channel] += 1
            self.total_bytes[channel] += num_bytes
            by_precision = self.bytes_by_precision[channel]
            by_precision[precision] = by_precision.get(precision, 0) + num_bytes
            calls = self.calls_by_precision[channel]
            calls[precision] = calls.get(precision, 0) + 1

    def state_dict(self) -> dict[str, object]:
        """Totals and events since the start (the current step's counters are not kept)."""
        with self._lock:
            return {
                "total_bytes": {c.value: n for c, n in self.total_bytes.items()},
                "eval_bytes": {c.value: n for c, n in self.eval_bytes.items()},
                "bytes_by_precision": {
                    c.value: {p.value: n for p, n in d.items()} for c, d in self.bytes_by_precision.items()
                },
                "calls_by_precision": {
                    c.value: {p.value: n for p, n in d.items()} for c, d in self.calls_by_precision.items()
                },
                "fallbacks": [
                    [e.step, e.channel.value, e.requested.value, e.used.value, e.reason]
                    for e in self.fallbacks
                ],
                "switches": [
                    [e.step, e.channel.value, e.old.value, e.new.value, e.reason] for e in self.switches
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (the run report of a resumed run covers it all)."""
        with self._lock:
            for name, n in state["total_bytes"].items():
                self.total_bytes[CommChannel(name)] = int(n)
            for name, n in state["eval_bytes"].items():
                self.eval_bytes[CommChannel(name)] = int(n)
            for key, target in (
                ("bytes_by_precision", self.bytes_by_precision),
                ("calls_by_precision", self.calls_by_precision),
            ):
                for name, per in state[key].items():
                    target[CommChannel(name)] = {CommPrecision(p): int(n) for p, n in per.items()}
            self.fallbacks = [
                FallbackEvent(
                    step=int(st), channel=CommChannel(c), requested=CommPrecision(r),
                    used=CommPrecision(u), reason=str(why),
                )
                for st, c, r, u, why in state["fallbacks"]
            ]
            self.switches = [
                SwitchEvent(
                    step=int(st), channel=CommChannel(c), old=CommPrecision(o),
                    new=CommPrecision(n), reason=str(why),
                )
                for st, c, o, n, why in state["switches"]
            ]

    def take_step(self) -> tuple[dict[CommChannel, int], dict[CommChannel, int]]:
        """Return (bytes, calls) per channel of the step and start a new one."""
        with self._lock:
            step_bytes, step_calls = self.step_bytes, self.step_calls
            self.step_bytes = dict.fromkeys(_CHANNELS, 0)
            self.step_calls = dict.fromkeys(_CHANNELS, 0)
        return step_bytes, step_calls
