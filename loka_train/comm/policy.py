"""The comm policy: lower or raise each channel's precision from measured SQNR, collectively.

On sampled steps the encoders measure, on the channel's real tensors, the error of every
candidate precision (`CommState.measure`). Every `policy_interval` steps `CommPolicy.update`
all-reduces those sums (one all-reduce of a small float64 buffer) so every rank computes the
same SQNR, then per adaptive channel:

* raise when the current precision's SQNR < raise threshold: to the cheapest more precise
  rung whose SQNR >= lower threshold (else the most precise rung allowed);
* else lower to the cheapest less precise rung whose SQNR >= lower threshold;
* a proposal is applied once it repeated `raise_patience` / `lower_patience` consecutive
  updates (hysteresis in time; the gap between the thresholds is hysteresis in dB).

Every rank holds the same inputs (the reduced sums are identical on all ranks) and the same
history, so every rank switches at the same step; switches take effect from the next step.

Example:
    >>> policy = CommPolicy(comm_state)
    >>> for step in range(num_steps):
    ...     comm_state.begin_step(step)
    ...     train_step()
    ...     metrics = comm_state.end_step()
    ...     policy.maybe_update(step)   # on every rank
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist

from loka_train.comm.config import CommChannel, CommPrecision
from loka_train.comm.state import CommState, PrecisionSource
from loka_train.comm.stats import SwitchEvent

logger = logging.getLogger(__name__)


class Action(Enum):
    """What the policy proposes for a channel at one update."""

    STAY = "stay"
    LOWER = "lower"
    RAISE = "raise"
    NO_DATA = "no_data"


@dataclass(frozen=True)
class Proposal:
    """The policy's proposal for one channel at one update."""

    action: Action
    """Lower, raise, stay, or no measurement."""
    target: CommPrecision
    """Precision proposed (the current one for STAY / NO_DATA)."""
    reason: str
    """The SQNRs and thresholds behind it."""


def _at_least(value: float | None, threshold: float) -> bool:
    return value is not None and value >= threshold  # NaN compares False


def _fmt_db(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}dB"


class CommPolicy:
    """Per-channel precision decisions with hysteresis, identical on all ranks.

    Args:
        state: the process's comm state (its config's adaptive channels are managed).
        process_group: group over which measurements are reduced; None: the default group
            when torch.distributed is initialized (else single process, no reduction).

    Example:
        >>> policy = CommPolicy(state)
        >>> switches = policy.update(step=100)  # collective: call on every rank
    """

    def __init__(self, state: CommState, *, process_group: dist.ProcessGroup | None = None) -> None:
        self._state = state
        self._process_group = process_group
        self._pending: dict[CommChannel, tuple[CommPrecision, int]] = {}
        self.last_sqnr_db: dict[CommChannel, dict[CommPrecision, float]] = {}
        """SQNR (dB) per channel and precision of the last update (reduced over ranks)."""

    @property
    def channels(self) -> tuple[CommChannel, ...]:
        """Channels this policy may change."""
        return self._state.config.adaptive_channels

    def maybe_update(self, step: int) -> list[SwitchEvent]:
        """`update(step)` on steps that end a policy interval; call on every rank every step."""
        interval = self._state.config.policy_interval
        if not self.channels or (step + 1) % interval != 0:
            return []
        return self.update(step)

    def update(self, step: int) -> list[SwitchEvent]:
        """Reduce the measurements over ranks and apply the decisions (collective).

        Args:
            step: the step just finished; switches apply from the next one.

        Returns:
            The switches applied (the same on every rank).
        """
        if not self.channels:
            return []
        sums = self._state.take_sqnr_sums()
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size(self._process_group) > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self._process_group)
        return self.apply(CommState.sqnr_db_from_sums(sums), step=step)

    def propose(self, channel: CommChannel, sqnr_db: dict[CommPrecision, float]) -> Proposal:
        """What to do on `channel` given its measured SQNR per precision (pure).

        Args:
            channel: the channel.
            sqnr_db: measured SQNR (dB) per precision; FP32 is lossless and needs no entry.
        """
        state = self._state
        current = state.precision(channel)
        ladder = state.ladder(channel)
        lower_db, raise_db = state.config.sqnr_thresholds_db(channel)

        def measured(p: CommPrecision) -> float | None:
            return math.inf if p.is_lossless else sqnr_db.get(p)

        current_db = measured(current)
        if current_db is None:
            return Proposal(Action.NO_DATA, current, f"{current.name} not measured")
        summary = ", ".join(f"{p.name}={_fmt_db(measured(p))}" for p in ladder)
        if not current_db >= raise_db:  # NaN raises too
            higher = sorted((p for p in ladder if p.order > current.order), key=lambda p: p.order)
            if not higher:
                return Proposal(
                    Action.STAY,
                    current,
                    f"{current.name} at {_fmt_db(current_db)} < raise {raise_db}dB but no "
                    "more precise rung is allowed",
                )
            target = next((p for p in higher if _at_least(measured(p), lower_db)), None)
            target = target if target is not None else higher[-1]
            return Proposal(
                Action.RAISE,
                target,
                f"{current.name} at {_fmt_db(current_db)} < raise {raise_db}dB ({summary})",
            )
        acceptable = [
            p for p in ladder if p.order < current.order and _at_least(measured(p), lower_db)
        ]
        if acceptable:
            target = min(acceptable, key=lambda p: p.order)
            return Proposal(
                Action.LOWER,
                target,
                f"{target.name} at {_fmt_db(measured(target))} >= lower {lower_db}dB ({summary})",
            )
        return Proposal(Action.STAY, current, summary)

    def apply(
        self, sqnr_db: dict[CommChannel, dict[CommPrecision, float]], *, step: int
    ) -> list[SwitchEvent]:
        """Apply proposals from (already reduced) SQNRs with hysteresis; returns the switches.

        Deterministic given the inputs and the history, so ranks fed the same inputs agree.
        """
        self.last_sqnr_db = sqnr_db
        state, config = self._state, self._state.config
        switches: list[SwitchEvent] = []
        for channel in self.channels:
            proposal = self.propose(channel, sqnr_db.get(channel, {}))
            if proposal.action is Action.NO_DATA:
                continue
            if proposal.action is Action.STAY:
                self._pending.pop(channel, None)
                continue
            previous = self._pending.get(channel)
            count = previous[1] + 1 if previous and previous[0] is proposal.target else 1
            patience = (
                config.raise_patience if proposal.action is Action.RAISE else config.lower_patience
            )
            if count < patience:
                self._pending[channel] = (proposal.target, count)
                continue
            self._pending.pop(channel, None)
            old = state.precision(channel)
            new = state.set_precision(channel, proposal.target, source=PrecisionSource.POLICY)
            if new is old:
                continue
            event = SwitchEvent(
                step=step, channel=channel, old=old, new=new, reason=proposal.reason
            )
            state.stats.switches.append(event)
            switches.append(event)
            logger.info(
                "comm policy after step %d: %s %s -> %s (%s)",
                step,
                channel.value,
                old.name,
                new.name,
                proposal.reason,
            )
        return switches

    def metrics(self) -> dict[str, float]:
        """Last update's SQNR per channel and precision: `comm/<channel>/sqnr_db/<precision>`."""
        return {
            f"comm/{channel.value}/sqnr_db/{precision.value}": value
            for channel, per_precision in self.last_sqnr_db.items()
            for precision, value in per_precision.items()
        }

    def state_dict(self) -> dict[str, object]:
        """Checkpointable state: pending proposals and their repeat counts."""
        return {
            "pending": {c.value: (p.value, n) for c, (p, n) in self._pending.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what `state_dict` saved."""
        pending = state["pending"]
        assert isinstance(pending, dict)
        self._pending = {
            CommChannel(c): (CommPrecision(p), int(n)) for c, (p, n) in pending.items()
        }
