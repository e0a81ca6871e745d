"""raise_on_all_ranks: every rank stops with the failing rank's message; a user error (config,
data, checkpoint) stays one on the other ranks, anything else arrives there as a RuntimeError
(so the launcher reports a bug with its traceback, not as a user error)."""

from __future__ import annotations

import torch

from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.distributed import raise_on_all_ranks
from tests.dist._multiprocess import run_multiprocess

ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
          "CheckpointError": CheckpointError, "KeyError": KeyError, "RuntimeError": RuntimeError}


def _rank_1_raises(rank: int, world_size: int, kind: str) -> tuple[str, str]:
    error = ERRORS[kind]("boom on rank 1") if rank == 1 else None
    try:
        raise_on_all_ranks(error, world_size=world_size, device=torch.device("cpu"))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


def test_other_ranks_raise_the_user_error_or_a_runtime_error() -> None:
    expected = {"ValueError": "ValueError", "FileNotFoundError": "FileNotFoundError",
                "CheckpointError": "CheckpointError", "KeyError": "RuntimeError", "RuntimeError": "RuntimeError"}
    for kind, on_rank_0 in expected.items():
        (kind_0, message_0), (kind_1, _) = run_multiprocess(_rank_1_raises, 2, kind, timeout=60)
        assert kind_1 == kind
        assert kind_0 == on_rank_0, (kind, kind_0)
        assert message_0.startswith("rank 1 failed:") and "boom on rank 1" in message_0
