"""Replica sync of 2D sparse parallelism through LoKA's wire formats, at the policy's precision.

With ``trainer.sharding_group_size`` the embedding tables are sharded within a group of ranks
and replicated across the groups; each replica trains on its own data between syncs, and a
sync averages the replicas. TorchRec's ``DMPCollection.sync`` all-reduces the weights in
fp32. `ReplicaSync` sends instead each replicated tensor's change since the last sync,
``delta = w - w_at_last_sync``, at the precision `CommState` holds for the ``replica_sync``
channel (set by ``CommConfig.replica_sync``, moved by `CommPolicy` from measured SQNR like
the other channels), then sets ``w = w_at_last_sync + mean(delta)``:

* FP32: the weights themselves are averaged (sum over the replicas, divided by their number):
  the plain mean of the replicas, as TorchRec's sync computes it;
* FP16 / BF16: the replicas all-gather ``delta`` in that dtype and average in fp32 (a sum in
  the 16-bit dtype would round once more, beyond what error feedback can see);
* FP8 / INT8 (row-wise, ``row_dim`` values per scale): a scaled payload cannot be summed, so
  the replicas all-gather the payloads, decode them and average in fp32.

Where the codec runs its Triton kernels (CUDA), the FP8 and BF16 syncs take two fused passes
over each tensor (`comm.triton_replica`: the change, its payload and the new residual in one;
the mean applied to the anchor and the tensor in the other) instead of about a dozen, bit for
bit the same. The lossy syncs average by summing the replicas' decoded changes in replica order and
multiplying by ``1/R``, on every path.

Every replica computes the new weights from the same reduced values and the same anchor
(``w_at_last_sync``), so the replicas hold identical weights after every sync. The first sync
is always FP32: it makes the anchors identical whatever the replicas started from. With
error feedback (``CommConfig.dense_error_feedback``), a lossy sync keeps per tensor what its
encoding dropped and adds it to the next delta: rounding delays a change, never loses it;
an FP32 sync sends the residual with the weights and so flushes it. Optimizer state tensors
(row-wise Adagrad keeps one value per row, D times less than the weights) are averaged in fp32.

Memory: the anchors are an fp32 copy of the replicated tensors, kept at every precision (an
FP32 sync measures the candidates on the change from them); the residuals, one more fp32 copy,
exist only between a lossy sync and the next FP32 one.

This is built from public pieces (the tensors come from the sharded model's ``state_dict``,
the group from ``torch.distributed``); it does not hook into ``DMPCollection``'s own sync.

Shape legend: N values of one tensor (flattened), R replicas.

Example:
    >>> sync = ReplicaSync(comm_state, group=replica_group)
    >>> for step in range(num_steps):
    ...     comm_state.begin_step(step)
    ...     train_step()
    ...     sync.sync(weights, states)   # on every rank, every sharding_sync_every steps
    ...     comm_state.end_step()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from loka_train.comm.config import CodecImpl, CommChannel, CommPrecision
from loka_train.comm.formats import WireFormat
from loka_train.comm.state import CommState
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

__all__ = ["ReplicaSync"]

_CHANNEL = CommChannel.REPLICA_SYNC


class ReplicaSync:
    """Averages replicated tensors over a replica group, sending their change since the last sync.

    Args:
        comm_state: the process's comm state (precision of the ``replica_sync`` channel,
            statistics, SQNR measurements).
        group: the replica group of this rank (every rank that holds the same shards); None:
            the default group.

    Example:
        >>> sync = ReplicaSync(comm_state, group=replica_group)
        >>> sync.sync({"t0@0,0": shard_RD}, states=[momentum_R])
    """

    def __init__(self, comm_state: CommState, *, group: dist.ProcessGroup | None = None) -> None:
        self._state = comm_state
        self._group = group
        self._anchors: dict[str, torch.Tensor] = {}
        """name -> the tensor's value at the last sync (fp32), identical on every replica."""
        self._residuals: dict[str, torch.Tensor] = {}
        """name -> what lossy encodings dropped of that tensor's changes so far (fp32, flat)."""
        self.num_syncs = 0
        """Syncs done (the first is FP32 whatever the channel's precision)."""
        self._sampling = False
        """Whether the sync under way measures its changes (`_samples`)."""

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """Error-feedback residual (fp32, flat) per tensor name."""
        return dict(self._residuals)

    def precision(self) -> CommPrecision:
        """The precision the next sync uses: the channel's, FP32 for the first sync."""
        return CommPrecision.FP32 if not self._anchors else self._state.precision(_CHANNEL)

    @torch.no_grad()
    def sync(self, weights: Mapping[str, torch.Tensor], states: Sequence[torch.Tensor] = ()) -> None:
        """Average `weights` (in place, through the codec) and `states` (fp32) over the group.

        Collective over the replica group: every replica calls it with the same names, in the
        same order, with tensors of the same shapes.

        Args:
            weights: name -> a replicated tensor (an embedding shard), changed in place.
            states: optimizer state tensors, averaged in fp32 in place.
        """
        precision = self.precision()
        self._sampling = self._samples()
        with profiled(f"loka/comm/replica_sync/{precision.value}"):
            num_replicas = dist.get_world_size(self._group)
            for name, tensor in weights.items():
                if precision.is_lossless:
                    self._sync_exact(name, tensor, num_replicas)
                else:
                    self._sync_delta(name, tensor, num_replicas, precision)
            for state in states:
                mean = state.float() / num_replicas
                self._state.stats.record(_CHANNEL, CommPrecision.FP32, mean.numel() * 4)
                dist.all_reduce(mean, group=self._group)
                state.copy_(mean)
        self.num_syncs += 1

    def _sync_exact(self, name: str, tensor: torch.Tensor, num_replicas: int) -> None:
        send_N = tensor.detach().float().reshape(-1)
        residual_N = self._residuals.pop(name, None)
        if residual_N is not None:
            send_N = send_N + residual_N  # an exact sync flushes what lossy ones delayed
        elif send_N.data_ptr() == tensor.data_ptr():
            send_N = send_N.clone()  # an fp32 tensor: do not reduce into it before dividing
        if self._sampling and name in self._anchors:
            self._measure(send_N - self._anchors[name])
        self._state.stats.record(_CHANNEL, CommPrecision.FP32, send_N.numel() * 4)
        dist.all_reduce(send_N, group=self._group)
        mean_N = send_N / num_replicas
        tensor.copy_(mean_N.view_as(tensor))
        self._anchors[name] = mean_N

    def _sync_delta(self, name: str, tensor: torch.Tensor, num_replicas: int, precision: CommPrecision) -> None:
        state = self._state
        fmt = state.wire_format(_CHANNEL, precision)
        if precision in (CommPrecision.FP8, CommPrecision.BF16) and fmt.impl_for(tensor.device) is CodecImpl.TRITON:
            self._sync_fused(name, tensor, num_replicas, fmt)
            return
        anchor_N = self._anchors[name]
        delta_N = tensor.detach().float().reshape(-1) - anchor_N
        residual_N = self._residuals.pop(name, None)
        if residual_N is not None:
            delta_N = delta_N + residual_N
        if self._sampling:
            self._measure(delta_N)
        feedback = state.config.dense_error_feedback
        num_values = delta_N.numel()
        if precision.is_rowwise:
            padded_N = torch.nn.functional.pad(delta_N, (0, (-num_values) % state.config.row_dim))
            payload = fmt.encode_bytes(padded_N)
            if feedback:
                self._residuals[name] = delta_N - fmt.decode_bytes(payload)[:num_values]
            state.stats.record(_CHANNEL, precision, payload.numel())
            gathered = [torch.empty_like(payload) for _ in range(num_replicas)]
            dist.all_gather(gathered, payload, group=self._group)
            decoded_RN = fmt.decode_bytes(torch.cat(gathered)).view(num_replicas, -1)[:, :num_values]
        else:
            # Gathered and summed in fp32: a sum in the payload's dtype would round again, and
            # that rounding is no replica's to feed back.
            payload = fmt.encode_native(delta_N)
            if feedback:
                self._residuals[name] = delta_N - payload.float()
            state.stats.record(_CHANNEL, precision, payload.numel() * payload.element_size())
            bits = payload.view(torch.uint8)  # gathered as raw bytes, which every backend moves
            gathered = [torch.empty_like(bits) for _ in range(num_replicas)]
            dist.all_gather(gathered, bits, group=self._group)
            decoded_RN = torch.stack(gathered).view(payload.dtype).float()
        # Summed in replica order and scaled by 1/R, as the fused kernels do.
        total_N = decoded_RN[0]
        for r in range(1, num_replicas):
            total_N = total_N + decoded_RN[r]
        new_N = anchor_N + total_N * (1.0 / num_replicas)
        tensor.copy_(new_N.view_as(tensor))
        self._anchors[name] = new_N

    def _sync_fused(self, name: str, tensor: torch.Tensor, num_replicas: int, fmt: WireFormat) -> None:
        """The FP8 or BF16 sync of `_sync_delta` in two fused passes (`comm.triton_replica`), bit
        for bit the same: the change's payload and new residual in one, the mean applied to the
        anchor and the tensor in the other."""
        # Imported on first use, as formats.py imports the codec: it imports triton.
        from loka_train.comm import triton_replica

        state = self._state
        anchor_N = self._anchors[name]
        residual_N = self._residuals.pop(name, None)
        if self._sampling:  # the change itself, only on a measured sync
            delta_N = tensor.detach().float().reshape(-1) - anchor_N
            self._measure(delta_N if residual_N is None else delta_N + residual_N)
        feedback = state.config.dense_error_feedback
        fp8 = fmt.precision is CommPrecision.FP8
        if fp8:
            payload, new_residual_N = triton_replica.delta_encode(
                tensor.detach(), anchor_N, residual_N, row_dim=fmt.row_dim, fmt=fmt.fp8_format, feedback=feedback
            )
        else:
            payload, new_residual_N = triton_replica.delta_encode_bf16(
                tensor.detach(), anchor_N, residual_N, feedback=feedback
            )
            payload = payload.view(torch.uint8)  # gathered as raw bytes, as the reference path does
        if new_residual_N is not None:
            self._residuals[name] = new_residual_N
        state.stats.record(_CHANNEL, fmt.precision, payload.numel())
        gathered = [torch.empty_like(payload) for _ in range(num_replicas)]
        dist.all_gather(gathered, payload, group=self._group)
        # In place: the anchor becomes the new value (a tensor of this sync's own).
        if fp8:
            triton_replica.mean_apply(torch.cat(gathered), anchor_N, tensor.detach(), num_replicas=num_replicas,
                                      row_dim=fmt.row_dim, fmt=fmt.fp8_format)
        else:
            triton_replica.mean_apply_bf16(torch.cat(gathered), anchor_N, tensor.detach(), num_replicas=num_replicas)

    @property
    def next_sync_measures(self) -> bool:
        """Whether the next sync measures its change (every ``comm.sample_every``-th sync)."""
        return self._samples()

    def _samples(self) -> bool:
        """Whether the next sync measures its changes: every ``comm.sample_every``-th sync from
        the second on (the first has no change to measure). Counted in syncs, not steps: the
        steps that sync (every ``trainer.sharding_sync_every``) may never be sampled steps."""
        every = self._state.config.sample_every
        return every > 0 and self.num_syncs >= 1 and (self.num_syncs - 1) % every == 0

    def _measure(self, delta_N: torch.Tensor) -> None:
        """The error of every candidate precision on this change (row-wise ones on it padded
        to whole rows, as they send it)."""
        row_dim = self._state.config.row_dim
        self._state.measure(_CHANNEL, torch.nn.functional.pad(delta_N, (0, (-delta_N.numel()) % row_dim)))
