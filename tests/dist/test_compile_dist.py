"""``trainer.compile_dense``: the dense submodules run compiled, and train as eager ones do.

The compiled runs use a counting AOTAutograd backend (eager kernels, so this stays cheap on
CPU): it proves that forward and backward graphs of the dense submodules really went through
``torch.compile``, while the loss curve and the held-out NE match the eager run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loka_train.runtime import TrainerConfig
from loka_train.runtime.trainer import Trainer
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, dense_params, tiny_data, tiny_model, tiny_trainer

COUNTING_BACKEND = "loka_test_aot_count"
DENSE = ["model.dense_arch", "model.inter_arch", "model.over_arch"]
# AOTAutograd with eager kernels runs the same ops as eager mode; only the summation order of
# a few decomposed ops may differ.
LOSS_RTOL = 1e-5


def _register_counting_backend() -> dict[str, int]:
    """A torch.compile backend (AOTAutograd, eager kernels) that counts the graphs it gets."""
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.common import aot_autograd

    counts = {"forward": 0, "backward": 0}

    def counted(role: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            counts[role] += 1
            return gm.forward

        return compiler

    if COUNTING_BACKEND not in list_backends(exclude_tags=()):
        register_backend(
            aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward")),
            name=COUNTING_BACKEND,
        )
    return counts


def _train(rank: int, world_size: int, out: str, kind: str, compile_dense: bool) -> dict[str, Any]:
    counts = _register_counting_backend()
    recorder = LossRecorder()
    trainer = Trainer(
        model=tiny_model(kind),
        data=tiny_data(),
        trainer=tiny_trainer(
            Path(out), compile_dense=compile_dense, compile_backend=COUNTING_BACKEND
        ),
        callbacks=[recorder],
    )
    summary = trainer.fit()
    return {
        "losses": recorder.losses,
        "ne": summary["eval/ne"],
        "compiled": summary["compiled"],
        "graphs": dict(counts),
        "params": sorted(dense_params(trainer)),
    }


@pytest.mark.parametrize("kind", ["dlrm", "dcn", "wukong"])
def test_compile_dense_matches_eager(kind: str, tmp_path: Path) -> None:
    eager = run_multiprocess(_train, 1, str(tmp_path / "eager"), kind, False)[0]
    compiled = run_multiprocess(_train, 1, str(tmp_path / "compiled"), kind, True)[0]

    assert eager["compiled"] == [] and eager["graphs"] == {"forward": 0, "backward": 0}
    assert compiled["compiled"] == DENSE
    # Each dense submodule: at least one training forward and backward graph, and the
    # inference forward of the final evaluation.
    assert compiled["graphs"]["forward"] >= 2 * len(DENSE), compiled["graphs"]
    assert compiled["graphs"]["backward"] >= len(DENSE), compiled["graphs"]
    # Compiled in place: parameter names (so checkpoints) do not change.
    assert compiled["params"] == eager["params"]
    assert len(compiled["losses"]) == len(eager["losses"]) == 6
    torch.testing.assert_close(
        torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=LOSS_RTOL, atol=0
    )
    assert compiled["ne"] == pytest.approx(eager["ne"], rel=LOSS_RTOL)


def test_compile_backend_is_validated() -> None:
    with pytest.raises(ValueError, match="compile_backend"):
        TrainerConfig(compile_backend="")
    with pytest.raises(ValueError, match="compile_dense"):
        TrainerConfig(compile_dense="yes")  # type: ignore[arg-type]
