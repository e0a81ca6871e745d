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
