"""CallbackList: which callbacks a resumed checkpoint must know."""

from __future__ import annotations

from typing import Any

import pytest

from loka_train.runtime import Callback
from loka_train.runtime.callbacks import CallbackList


class _Timer(Callback):
    """Stateless: keeps nothing across a resume."""


class _Counter(Callback):
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def test_a_stateless_callback_may_join_a_resumed_run_a_stateful_one_may_not() -> None:
    assert not _Timer().stateful and _Counter().stateful
    saved = CallbackList([_Counter()]).state_dict() | {"_Counter": {"count": 7}}
    restored = CallbackList([counter := _Counter(), _Timer()])
    assert restored.load_state_dict(saved) == []  # the timer needs nothing: not refused
    assert counter.count == 7
    with pytest.raises(ValueError, match=r"no state for callbacks \['_Counter'\].*resume_new_callbacks"):
        CallbackList([_Counter(), _Timer()]).load_state_dict({})
    assert CallbackList([_Counter(), _Timer()]).load_state_dict({}, allow_missing=True) == ["_Counter"]


def test_requests_are_replayable_only_when_every_requesting_callback_allows_it() -> None:
    from torch import nn

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)

    class Asks(Callback):
        def __init__(self, module: nn.Module | None, replayable: bool) -> None:
            self.module, self.replayable_requests = module, replayable

        @property
        def name(self) -> str:
            return f"asks{id(self)}"

        def eager_modules(self, trainer: Any, step: int) -> list[nn.Module]:
            return [self.module] if self.module is not None and step % 2 == 0 else []

    both = CallbackList([Asks(a, True), Asks(b, True)])
    assert both.requests(None, 0) == ([a, b], True)
    assert both.requests(None, 1) == ([], True)
    mixed = CallbackList([Asks(a, True), Asks(b, False)])
    assert mixed.requests(None, 0) == ([a, b], False) and mixed.eager_modules(None, 0) == [a, b]
    # A callback that asks for nothing this step does not veto the others.
    assert CallbackList([Asks(a, True), Asks(None, False)]).requests(None, 0) == ([a], True)
