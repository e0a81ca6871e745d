"""The callback seam: hooks the Trainer calls, and that plug-ins (the LoKA callback) implement.

A callback subclasses `Callback` and overrides the hooks it needs; every hook has a no-op
default. Its `state_dict()` is saved in every checkpoint under `callback.name` and handed
back to `load_state_dict()` on resume, before `on_train_start`; a resume on another number of
processes first hands every saved rank's state to `merge_rank_states()`.

Order within a run:
    on_before_shard -> (resume) load_state_dict -> on_train_start ->
    [on_step_start -> eager_modules -> forward/backward -> on_after_backward ->
     optimizer.step -> on_step_end]* -> on_eval_end (whenever an evaluation ran) -> on_train_end

(`on_eval_start` / `on_eval_end` bracket every evaluation, which runs between a step's
optimizer update and its `on_step_end`.)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from loka_train.runtime.context import LoopState as Trainer


class Callback:
    """Base class of trainer callbacks.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_step_end(self, trainer, step, metrics):
        ...         if "train/loss" in metrics:
        ...             print(step, metrics["train/loss"])
    """

    @property
    def name(self) -> str:
        """Key of this callback's state in checkpoints; unique within a Trainer."""
        return type(self).__name__

    def on_before_shard(self, trainer: Trainer) -> None:
        """The unsharded model is built (`trainer.model`), nothing is sharded yet.

        `trainer` is the `Trainer`, or a `RunContext` in a user's own loop (same attributes).

        A callback may replace `trainer.model` (e.g. convert dense modules), append to
        `trainer.sharders`, or set `trainer.data_parallel_wrapper` here.
        """

    def on_train_start(self, trainer: Trainer) -> None:
        """The model is sharded, the optimizer built and any checkpoint restored."""

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        """Step `step` (0-based) is about to run."""

    def eager_modules(self, trainer: Trainer, step: int) -> Collection[nn.Module]:
        """Modules that must run eagerly on step `step` (asked right after `on_step_start`).

        A callback names the modules inside which it does host work on that step that compiled
        code or a CUDA graph replay would skip (the LoKA callback: the FP8 sites its Probe
        samples). A loop that compiles or graphs its dense submodules runs each one that holds
        a named module uncompiled and unreplayed on that step (`runtime.eager.EagerSteps`); a
        plain eager loop may ignore the answer. Default: none.
        """
        return ()

    replayable_requests: bool = False
    """Whether the host work this callback does inside the modules of `eager_modules` goes
    through :func:`loka_train.utils.capture.after_replay` (and does nothing a CUDA graph capture
    forbids), so that a loop with ``trainer.cuda_graphs`` may capture those modules' uncompiled
    forwards and replay them on the requested steps instead of running them eagerly. Default:
    False."""

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        """Gradients of step `step` are ready; the dense optimizer has not stepped yet.

        (Embedding tables use TorchRec's fused optimizer, which updates during backward.)
        """

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """Step `step` finished; `metrics` holds what was logged at this step (maybe empty)."""

    def on_eval_start(self, trainer: Trainer, step: int) -> None:
        """An evaluation after step `step` (0-based, as in `on_step_end`) is about to run (its
        forwards are not training)."""

    def on_eval_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """An evaluation after step `step` (0-based, as in `on_step_end`) finished with `metrics`
        (eval/ne, eval/auc, ...)."""

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        """Training ended (also when stopped by `stop_after_step`); `summary` is final."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint; must be torch.save-able."""
        return {}

    @property
    def stateful(self) -> bool:
        """Whether the callback keeps state across a resume: true when its class overrides
        `state_dict`. A stateless callback (a logger, a timer) may join a resumed run whose
        checkpoint does not know it."""
        return type(self).state_dict is not Callback.state_dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def merge_rank_states(self, states: list[dict[str, Any]], *, rank: int, world_size: int) -> dict[str, Any]:
        """The state this rank loads from a checkpoint written by another number of processes.

        Args:
            states: what `state_dict` returned on each rank that wrote the checkpoint (rank order).
            rank: this process's rank in the resumed run.
            world_size: the resumed run's number of processes.

        Default: rank 0's state, right for state that is the same on every rank. A callback
        with rank-local state merges it here, or resets it and logs why.

        Example:
            >>> class Counter(Callback):
            ...     def merge_rank_states(self, states, *, rank, world_size):
            ...         return {"seen": sum(s["seen"] for s in states) if rank == 0 else 0}
        """
        return states[0]


class CallbackList:
    """Calls each hook on every callback in order; names must be unique."""

    def __init__(self, callbacks: list[Callback]) -> None:
        names = [cb.name for cb in callbacks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"callback names must be unique, got duplicates {dupes}")
        self.callbacks = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def eager_modules(self, trainer: Trainer, step: int) -> list[nn.Module]:
        """Every callback's `eager_modules` for `step`, together."""
        return self.requests(trainer, step)[0]

    def requests(self, trainer: Trainer, step: int) -> tuple[list[nn.Module], bool]:
        """Every callback's `eager_modules` for `step`, and whether all of them may be replayed
        (every callback that named a module has `replayable_requests`)."""
        modules: list[nn.Module] = []
        replayable = True
        for cb in self.callbacks:
            named = list(cb.eager_modules(trainer, step))
            if named:
                modules.extend(named)
                replayable = replayable and cb.replayable_requests
        return modules, replayable

    def state_dict(self) -> dict[str, Any]:
        return {cb.name: cb.state_dict() for cb in self.callbacks}

    def merge_rank_states(self, states: list[dict[str, Any]], *, rank: int, world_size: int) -> dict[str, Any]:
        """Each callback's `Callback.merge_rank_states` of `states` (every saved rank's
        `state_dict()`, rank order) for this `rank` of a run with `world_size` processes."""
        return {
            cb.name: cb.merge_rank_states([s[cb.name] for s in states], rank=rank, world_size=world_size)
            for cb in self.callbacks
            if all(cb.name in s for s in states)
        }

    def load_state_dict(self, state: dict[str, Any], *, allow_missing: bool = False) -> list[str]:
        """Restore each callback's state; returns the stateful callbacks `state` had nothing
        for, which keep their own state (only with `allow_missing`; otherwise they raise)."""
        missing = [cb.name for cb in self.callbacks if cb.name not in state and cb.stateful]
        if missing and not allow_missing:
            raise ValueError(
                f"checkpoint has no state for callbacks {missing}; it was written by a run "
                "without them. Resume with the same callbacks, start fresh (trainer.resume=never), "
                "or let those callbacks start fresh (trainer.resume_new_callbacks=true)."
            )
        for cb in self.callbacks:
            if cb.name in state:
                cb.load_state_dict(state[cb.name])
        return missing
