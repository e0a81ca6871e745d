"""DDP communication hook for dense gradients: FP32 / FP16 / BF16 / FP8 / INT8, switchable.

* FP32, FP16, BF16: the bucket, divided by the world size, is cast and all-reduced in that
  dtype (like torch's `fp16_compress_hook` / `bf16_compress_hook`).
* FP8, INT8 (row-wise, `row_dim` values per scale): a scaled payload cannot be summed, so every
  rank all-gathers the uint8 payloads (plus their scales, inside the payload), decodes them
  and averages in fp32. This works on gloo (which has no fp8 dtype) and NCCL alike; it moves
  world_size x payload bytes into each rank instead of a ring all-reduce's 2 x payload, so
  it pays off for small worlds or where the all-reduce is latency-bound.
* Error feedback (`CommConfig.dense_error_feedback`): per DDP bucket, the encoding error of
  this rank's contribution is kept in an fp32 residual and added to the next step's gradient,
  so what rounding drops is delayed, not lost. Switching to FP32 flushes the residual.

The precision is `comm_state.precision(CommChannel.DENSE_GRAD)`, so `CommPolicy` changes it
between steps like the embedding channels. Bytes sent are counted in `comm_state.stats`.

Example:
    >>> ddp = DistributedDataParallel(dense_module)
    >>> compressors = install_dense_grad_hook(ddp, comm_state)
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook inspects the hook's
# annotations and needs the real `dist.GradBucket` / `Future[Tensor]` objects, not strings.
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loka_train.comm.config import CommChannel, CommPrecision
from loka_train.comm.state import CommState
from loka_train.utils.profiling import profiled

logger = logging.getLogger(__name__)

_CHANNEL = CommChannel.DENSE_GRAD


class DenseGradCompressor:
    """State of the dense-gradient comm hook of one DDP module (residuals per bucket).

    Args:
        comm_state: the process's comm state (precision, statistics, measurements).
        process_group: group the gradients are averaged over; None: the default group.
        param_names: ``id(parameter) -> name`` of the DDP module's parameters. Checkpoints keep
            the error-feedback residuals per parameter name, because DDP lays its buckets out
            differently on the first iteration (registration order) and after it (gradient
            order): a residual kept per bucket would land on other parameters after a resume.

    Example:
        >>> compressor = DenseGradCompressor(comm_state, param_names=names)
        >>> ddp.register_comm_hook(compressor, dense_grad_comm_hook)
    """

    def __init__(
        self,
        comm_state: CommState,
        *,
        process_group: dist.ProcessGroup | None = None,
        param_names: Mapping[int, str] | None = None,
    ) -> None:
        self._state = comm_state
        self._process_group = process_group
        self._param_names = dict(param_names or {})
        # bucket index -> (ids of the bucket's parameters or None, residual)
        self._residuals: dict[int, tuple[tuple[int, ...] | None, torch.Tensor]] = {}
        # bucket index -> numel of each parameter, in bucket order (to split a residual)
        self._numels: dict[int, tuple[int, ...]] = {}
        # parameter name -> residual restored from a checkpoint, not yet taken by a bucket
        self._restored: dict[str, torch.Tensor] = {}
        self.num_dropped_residuals = 0
        """Restored error-feedback residuals that could not be used (an older checkpoint
        format, or a parameter whose size changed): each logged, counted in the run report."""
        # bucket index -> the comm step it last reduced at: a bucket index that DDP's rebuild
        # dropped keeps an old residual that no later step will use, and must not be saved
        self._seen_step: dict[int, int] = {}

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        """Error-feedback residual (fp32, flat) per bucket index."""
        return {index: residual for index, (_, residual) in self._residuals.items()}

    def reset_residuals(self) -> None:
        """Drop all error-feedback residuals."""
        self._residuals.clear()
        self._restored.clear()

    def state_dict(self) -> dict[str, object]:
        """Checkpointable state: the residuals (an unflushed part of past gradients), per
        parameter name.

        Raises:
            ValueError: a residual exists but the compressor does not know its parameters'
                names (construct it with ``param_names``, as ``install_dense_grad_hook`` does).
        """
        by_param = {name: r.clone() for name, r in self._restored.items()}
        latest = max(self._seen_step.values(), default=None)
        for index, (owner, residual_N) in self._residuals.items():
            if self._seen_step.get(index) != latest:
                continue  # a bucket of an older layout (DDP rebuilt its buckets since)
            numels = self._numels.get(index)
            names = None if owner is None else [self._param_names.get(i) for i in owner]
            if names is None or numels is None or None in names or sum(numels) != residual_N.numel():
                raise ValueError(
                    f"dense grad hook: cannot checkpoint the residual of bucket {index}: its "
                    "parameters' names are unknown; build DenseGradCompressor with param_names "
                    "(install_dense_grad_hook does)"
                )
            for name, part in zip(names, residual_N.split(list(numels))):
                by_param[str(name)] = part.clone()
        return {"residuals_by_param": by_param}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore residuals saved by `state_dict`; each bucket takes its parameters' parts
        (on its gradients' device) the first time it reduces."""
        self._residuals.clear()
        if "residuals_by_param" not in state:
            residuals = state["residuals"] if "residuals" in state else {}  # older checkpoints
            assert isinstance(residuals, dict)
            if residuals:
                logger.warning(
                    "dense grad hook: the checkpoint keeps error-feedback residuals per DDP "
                    "bucket (older format), whose layout changes after DDP's first iteration; "
                    "dropping %d residual(s): up to one step of rounding error is not fed back",
                    len(residuals),
                )
                self.num_dropped_residuals += len(residuals)
            self._restored = {}
            return
        by_param = state["residuals_by_param"]
        assert isinstance(by_param, dict)
        self._restored = {str(k): v.detach().clone() for k, v in by_param.items()}

    def _take_residual(
        self,
        bucket_index: int,
        param_key: tuple[int, ...] | None,
        grad_N: torch.Tensor,
        param_numels: tuple[int, ...] | None,
    ) -> torch.Tensor | None:
        if self._restored and param_key is not None and param_numels is not None:
            names = [self._param_names.get(i) for i in param_key]
            if any(n in self._restored for n in names):
                parts = []
                for name, numel in zip(names, param_numels):
                    part = self._restored.pop(name, None) if name is not None else None
                    if part is not None and part.numel() != numel:
                        logger.warning(
                            "dense grad hook: the restored residual of %s has %d values, the "
                            "parameter now %d; dropped (starts from zero)", name, part.numel(), numel,
                        )
                        self.num_dropped_residuals += 1
                        part = None
                    if part is None:
                        part = grad_N.new_zeros(numel, dtype=torch.float32)
                    parts.append(part.to(device=grad_N.device, dtype=torch.float32).reshape(-1))
                return torch.cat(parts)
        entry = self._residuals.pop(bucket_index, None)
        if entry is None:
            return None
        owner, residual_N = entry
        same_params = owner is None or param_key is None or owner == param_key
        if not same_params or residual_N.numel() != grad_N.numel():
            # DDP rebuilds its buckets once after the first iteration.
            logger.info(
                "dense grad hook: bucket %d now holds other parameters (%d -> %d values); "
                "dropping its error-feedback residual",
                bucket_index,
                residual_N.numel(),
                grad_N.numel(),
            )
            return None
        return residual_N

    def reduce(
        self,
        grad_N: torch.Tensor,
        bucket_index: int,
        param_key: tuple[int, ...] | None = None,
        param_numels: tuple[int, ...] | None = None,
    ) -> torch.futures.Future:
        """Average flat gradient `grad_N` over the group with the current precision.

        Args:
            grad_N: the bucket's flat gradient buffer (overwritten with the average).
            bucket_index: DDP bucket index (keys the error-feedback residual).
            param_key: identity of the bucket's parameters; a residual is only reused for
                the same parameters (DDP re-buckets after the first iteration).
            param_numels: numel of each of those parameters, in bucket order (to split the
                residual per parameter for checkpoints).

        Returns a future whose value is `grad_N`, overwritten with the average (DDP's
        contract for a comm hook).
        """
        state = self._state
        precision = state.precision(_CHANNEL)
        group = self._process_group
        world_size = dist.get_world_size(group)
        fmt = state.wire_format(_CHANNEL, precision)
        use_feedback = state.config.dense_error_feedback and not precision.is_lossless

        with profiled(f"loka/comm/dense_grad/{precision.value}"):
            send_N = grad_N.detach().float()
            if param_numels is not None:
                self._numels[bucket_index] = param_numels
            self._seen_step[bucket_index] = state.step
            residual_N = self._take_residual(bucket_index, param_key, grad_N, param_numels)
            if residual_N is not None:
                # Added even at FP32: that step sends it exactly, flushing the residual.
                send_N = send_N + residual_N

            row_dim = state.config.row_dim
            num_values = send_N.numel()
            padded_N = None
            if precision.is_rowwise or state.sampling:
                padded_N = torch.nn.functional.pad(send_N, (0, (-num_values) % row_dim))
            if padded_N is not None and state.sampling:
                # Every candidate of the ladder, whatever this step sends (also at FP32, or the
                # policy could never lower the channel), on the bucket zero-padded to whole
                # rows as the row-wise path sends it (zeros add neither signal nor noise).
                state.measure(_CHANNEL, padded_N)
            if precision.is_rowwise:
                assert padded_N is not None
                payload = fmt.encode_bytes(padded_N)
                if use_feedback:
                    sent_N = fmt.decode_bytes(payload)[:num_values]
                    self._residuals[bucket_index] = (param_key, send_N - sent_N)
                state.stats.record(_CHANNEL, precision, payload.numel())
                gathered = [torch.empty_like(payload) for _ in range(world_size)]
                work = dist.all_gather(gathered, payload, group=group, async_op=True)

                def average_payloads(fut: torch.futures.Future) -> torch.Tensor:
                    fut.wait()
                    decoded_WN = fmt.decode_bytes(torch.cat(gathered)).view(world_size, -1)
                    mean_N = decoded_WN.sum(dim=0)[:num_values] / world_size
                    grad_N.copy_(mean_N)
                    return grad_N

                return work.get_future().then(average_payloads)

            # Divide first (like torch's compress hooks) so the low-precision sum cannot overflow.
            scaled_N = send_N / world_size
            payload = fmt.encode_native(scaled_N)
            if use_feedback:
                self._residuals[bucket_index] = (
                    param_key,
                    (scaled_N - payload.float()) * world_size,
                )
            state.stats.record(_CHANNEL, precision, payload.numel() * payload.element_size())
            work = dist.all_reduce(payload, group=group, async_op=True)

            def copy_back(fut: torch.futures.Future) -> torch.Tensor:
                grad_N.copy_(fut.value()[0])
                return grad_N

            return work.get_future().then(copy_back)


def dense_grad_comm_hook(
    state: DenseGradCompressor, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: `ddp.register_comm_hook(compressor, dense_grad_comm_hook)`."""
    params = bucket.parameters()
    return state.reduce(
        bucket.buffer(),
        bucket.index(),
        tuple(id(p) for p in params),
        tuple(p.numel() for p in params),
    )


def install_dense_grad_hook(module: nn.Module, comm_state: CommState) -> list[DenseGradCompressor]:
    """Register the dense-gradient hook on every DDP module in `module` (itself included).

    With TorchRec's `DistributedModelParallel` the dense part is wrapped in one DDP; pass the
    DMP module.

    Args:
        module: a DDP module, or a module containing DDP modules.
        comm_state: the process's comm state.

    Returns:
        One compressor per DDP module found (hold it to read or checkpoint residuals).

    Raises:
        ValueError: no DDP module found (nothing would be compressed).

    Example:
        >>> install_dense_grad_hook(dmp_model, comm_state)
    """
    ddps = [m for m in module.modules() if isinstance(m, DistributedDataParallel)]
    if not ddps:
        raise ValueError(
            f"install_dense_grad_hook: no DistributedDataParallel inside {type(module).__name__}; "
            "wrap the dense part in DDP (DistributedModelParallel does when world_size > 1)"
        )
    compressors = []
    for ddp in ddps:
        names = {id(p): name for name, p in ddp.module.named_parameters()}
        compressor = DenseGradCompressor(
            comm_state, process_group=ddp.process_group, param_names=names
        )
        ddp.register_comm_hook(compressor, dense_grad_comm_hook)
        compressors.append(compressor)
    if comm_state.precision(_CHANNEL) is not CommPrecision.FP32:
        logger.info(
            "dense grad hook installed on %d DDP module(s), precision %s",
            len(ddps),
            comm_state.precision(_CHANNEL).name,
        )
    return compressors
