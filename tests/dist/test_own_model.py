"""Your own TorchRec model in the Trainer: TorchRec's DLRMTrain(DLRM) trains exactly as the
same model built from a ModelConfig, trains with the LoKA callback on 1 and 2 gloo processes, and
a model that lacks what the Trainer needs is refused with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from loka_train.data import DataConfig, make_dataset
from loka_train.models import RecTrainModel
from loka_train.plugin import LokaCallback, LokaConfig
from loka_train.runtime import Trainer, TrainerConfig
from loka_train.runtime.train_model import check_train_output, prepare_model
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import LossRecorder, tiny_data, tiny_model, tiny_trainer

FAST_PROBE = {"every_k_steps": 1, "sites_per_step": None, "interval": 4, "min_samples": 2}
"""Every site sampled every step, an interval every 4 steps: decisions within a few steps."""


def make_dlrm(data: DataConfig, *, embedding_dim: int = 8, device: str = "meta") -> DLRMTrain:
    """TorchRec's DLRM over `data`'s features, as tests/dist/_tiny.tiny_model() configures the
    built-in one (same table names, so the Trainer fills the same tables)."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=embedding_dim, num_embeddings=rows,
            feature_names=[f"cat_{i}"],
        )
        for i, rows in enumerate(data.rows_per_feature)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=data.num_dense,
            dense_arch_layer_sizes=[16, embedding_dim],
            over_arch_layer_sizes=[16, 1],
        )
    )


def _train(rank: int, world_size: int, out: str, own: bool, loka: bool) -> dict[str, Any]:
    data = tiny_data()
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    if loka:
        callbacks.append(LokaCallback(LokaConfig.preset("aggressive", probe=FAST_PROBE)))
    trainer = Trainer(
        model=(lambda: make_dlrm(data)) if own else tiny_model(),
        data=data,
        trainer=tiny_trainer(Path(out), steps=8),
        callbacks=callbacks,
    )
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return {"losses": recorder.losses, "summary": summary}


def test_own_dlrm_trains_exactly_as_the_built_in_one(tmp_path: Path) -> None:
    """Same seed, same RNG use, same tables: the factory route is the ModelConfig route."""
    (built,) = run_multiprocess(_train, world_size=1, args=(str(tmp_path / "built"), False, False))
    (own,) = run_multiprocess(_train, world_size=1, args=(str(tmp_path / "own"), True, False))
    assert own["summary"]["model"] == "DLRMTrain" and built["summary"]["model"] == "dlrm"
    assert len(own["losses"]) == 8
    assert own["losses"] == built["losses"]
    assert own["summary"]["eval/ne"] == built["summary"]["eval/ne"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_own_dlrm_trains_with_loka(world_size: int, tmp_path: Path) -> None:
    results = run_multiprocess(_train, world_size=world_size, args=(str(tmp_path), True, True))
    summary = results[0]["summary"]
    assert summary["steps"] == 8 and summary["world_size"] == world_size
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
    # Emulated FP8 on CPU under the coverage objective: some GEMMs moved to FP8, alike on all ranks.
    assert summary["loka/fp8_coverage"] > 0
    assert {r["summary"]["loka/fp8_coverage"] for r in results} == {summary["loka/fp8_coverage"]}
    assert (tmp_path / "latest" / "loka" / "loka_report.json").exists()
    # Wrapped in DMP (hence DDP), the dense-gradient hook is installed: no fallback for it.
    assert not [f for f in summary["fallbacks"] if "dense-gradient hook" in f]


# ------------------------------------------------------------------------------ refusals
def _dataset(data: DataConfig) -> Any:
    return make_dataset(data, split="train", rank=0, world_size=1, batch_size=16)


class _NoTables(nn.Module):
    def forward(self, batch: Any) -> Any:
        return batch


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda data: make_dlrm(data).model, r"DLRM\.forward\(dense_features, sparse_features\) "
         r"cannot be called as model\(batch\).*torchrec\.models\.dlrm\.DLRMTrain\(model\)"),
        (lambda data: _NoTables(), "_NoTables holds no torchrec EmbeddingBagCollection"),
        (lambda data: make_dlrm(DataConfig(num_sparse=5, num_embeddings=200)),
         r"table 't_cat_4' reads feature 'cat_4', which the data does not have; its features are "
         r"cat_0 \.\. cat_3 \(data.num_sparse=4\)"),
        (lambda data: make_dlrm(DataConfig(num_sparse=4, num_embeddings=100)),
         r"table 't_cat_0' has 100 rows but feature 'cat_0' holds ids up to 199 .*"
         r"num_embeddings >= 200"),
        (lambda data: lambda: "not a module", "the model function returned a str, not an nn.Module"),
        (lambda data: "dlrm", "takes a ModelConfig, an nn.Module or a function"),
    ],
    ids=["dlrm_unwrapped", "no_tables", "unknown_feature", "too_few_rows", "factory_not_module", "a_string"],
)
def test_a_model_that_lacks_what_the_trainer_needs_is_refused_with_the_fix(model: Any, message: str) -> None:
    data = tiny_data()
    with pytest.raises((ValueError, TypeError), match=message):
        prepare_model(model(data), data=_dataset(data), seed=0)


def test_the_wrapped_models_pass_the_check() -> None:
    data = tiny_data()
    own = prepare_model(make_dlrm(data), data=_dataset(data), seed=0)
    assert own.tables == {f"t_cat_{i}": (200, 8) for i in range(4)} and own.name == "DLRMTrain"
    wrapped = prepare_model(RecTrainModel(make_dlrm(data).model), data=_dataset(data), seed=0)
    assert wrapped.name == "RecTrainModel"


def test_a_model_returning_the_wrong_output_is_refused_at_its_first_step() -> None:
    loss = torch.tensor(0.5)
    check_train_output((loss, torch.zeros(4), torch.ones(4)), "M")
    with pytest.raises(ValueError, match=r"M\(batch\) must return \(loss, \(loss, logits, labels\)\); "
                       r"the second element is a tuple of 2: wrap it"):
        check_train_output((torch.zeros(4), torch.ones(4)), "M")
    with pytest.raises(ValueError, match="the second element is a Tensor"):
        check_train_output(torch.zeros(4), "M")


def test_the_user_guide_example(tmp_path: Path) -> None:
    """The snippet of the user guide, as written there."""
    (summary,) = run_multiprocess(_user_guide, world_size=1, args=(str(tmp_path),))
    assert summary["loka/fp8_coverage"] > 0
    assert (tmp_path / "latest" / "loka" / "loka_report.md").exists()


def _user_guide(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    import torch
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from loka_train.data import DataConfig
    from loka_train.plugin import LokaCallback, LokaConfig
    from loka_train.runtime import Trainer, TrainerConfig

    data = DataConfig(num_sparse=8, num_embeddings=1000)  # features cat_0 .. cat_7, 13 dense

    def my_model() -> DLRMTrain:
        tables = [
            EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=16, num_embeddings=1000,
                               feature_names=[f"cat_{i}"])
            for i in range(data.num_sparse)
        ]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=data.num_dense,
                    dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1])
        return DLRMTrain(dlrm)  # model(batch) -> (loss, (loss, logits, labels))

    trainer = Trainer(
        model=my_model,
        data=data,
        trainer=TrainerConfig(steps=20, batch_size=128, device="cpu", out_dir=out_dir),
        # A short CPU run: sample every 2nd step, re-plan every 10 (the preset: 20 and 200).
        callbacks=[LokaCallback(LokaConfig.preset("aggressive", probe={"every_k_steps": 2, "interval": 10}))],
    )
    summary = trainer.fit()
    trainer.close()
    print(summary["eval/ne"], summary["loka/fp8_coverage"])
    return summary
