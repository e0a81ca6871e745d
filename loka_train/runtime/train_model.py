"""The model a `Trainer` trains: one of the DLRM family built from a `ModelConfig`, or your own.

Your own model is an unsharded ``nn.Module`` (or a function that builds one, called once per
process under ``trainer.seed``) that provides what the Trainer needs from it:

* **The loss**: ``model(batch) -> (loss, (loss, logits, labels))``, TorchRec's train-pipeline
  contract, where `batch` is a ``torchrec.datasets.utils.Batch`` (``dense_features``,
  ``sparse_features`` as a KeyedJaggedTensor, ``labels``). ``loss`` is backpropagated;
  ``logits`` and ``labels`` (shape ``(B,)``) give the evaluation's NE and AUC. TorchRec's
  ``DLRMTrain`` wraps a ``DLRM`` / ``DLRM_DCN`` so; ``loka_train.models.RecTrainModel`` wraps
  any module called as ``model(dense_features, sparse_features) -> logits``.
* **The embedding tables**, in TorchRec ``EmbeddingBagCollection`` modules, which the Trainer shards
  (``trainer.sharding``) with fused Adagrad (``trainer.sparse_optimizer``). Every table's
  features must be features of the data (``cat_0`` .. ``cat_{F-1}``, ``F = data.num_sparse``)
  and it must have a row for every id the data holds (``data.num_embeddings`` or
  ``data.num_embeddings_per_feature``). The Trainer fills every table from ``trainer.seed``
  after sharding, whatever it held, so build them on the meta device
  (``EmbeddingBagCollection(..., device=torch.device("meta"))``) to allocate nothing twice.
* **The dense input width**: ``data.num_dense`` features per sample (13 by default).
* For ``trainer.compile_dense`` / ``trainer.cuda_graphs``: the dense parts as submodules named
  ``dense_arch``, ``inter_arch``, ``over_arch`` (as TorchRec's DLRM names them).

Everything else (dense parameters, the dense optimizer, DDP) the Trainer sets up as for the
built-in models. A model that lacks one of these is refused before anything runs, with an
error that names the fix.

Example:
    >>> from torchrec.models.dlrm import DLRM, DLRMTrain
    >>> trainer = Trainer(model=lambda: DLRMTrain(DLRM(embedding_bag_collection=ebc, ...)),
    ...                   data=DataConfig(), trainer=TrainerConfig(steps=100))
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import DistributedModelParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from loka_train.data.protocol import RecDataset
from loka_train.models import ModelConfig, build_model, table_name

logger = logging.getLogger(__name__)

__all__ = ["ModelSpec", "TrainModel", "check_own_model", "check_train_output", "prepare_model"]

ModelSpec = ModelConfig | nn.Module | Callable[[], nn.Module]
"""What `Trainer(model=...)` takes: a `ModelConfig`, your own model, or a function building it."""

_WRAP_HINT = (
    "wrap it: torchrec.models.dlrm.DLRMTrain(model) for a TorchRec DLRM / DLRM_DCN, or "
    "loka_train.models.RecTrainModel(model) for a model called as "
    "model(dense_features, sparse_features) -> logits"
)


@dataclass(frozen=True)
class TrainModel:
    """The unsharded model the Trainer trains, and what it needs to know of it."""

    module: nn.Module
    """Called as ``module(batch) -> (loss, (loss, logits, labels))``."""

    tables: dict[str, tuple[int, int]]
    """Embedding table name -> (rows, dim), every table of every EmbeddingBagCollection."""

    name: str
    """The model's name in the run summary and checkpoints (``ModelConfig.kind`` or the class)."""


def prepare_model(model: ModelSpec, *, data: RecDataset, seed: int) -> TrainModel:
    """Build or take the model the Trainer trains, and check it against `data`.

    Args:
        model: a `ModelConfig` (built here for `data`), your own unsharded model, or a function
            that builds it (called with the RNG seeded from `seed`, so every rank builds the
            same dense parameters).
        data: the train split the model will read.
        seed: ``trainer.seed``.

    Raises:
        ValueError: your model lacks what the Trainer needs (see the module docstring).
        TypeError: `model` is none of the three.
    """
    module: nn.Module
    if isinstance(model, ModelConfig):
        module = build_model(
            model,
            feature_names=data.feature_names,
            num_embeddings_per_feature=data.num_embeddings_per_feature,
            num_dense=data.num_dense,
            seed=seed,
        )
        tables = {
            table_name(f): (rows, model.embedding_dim)
            for f, rows in zip(data.feature_names, data.num_embeddings_per_feature)
        }
        return TrainModel(module=module, tables=tables, name=model.kind)
    if isinstance(model, nn.Module):
        module = model
    elif callable(model):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = model()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Trainer(model=...): the model function returned a {type(module).__name__}, "
                "not an nn.Module"
            )
    else:
        raise TypeError(
            "Trainer(model=...) takes a ModelConfig, an nn.Module or a function that returns "
            f"one, got a {type(model).__name__}"
        )
    return TrainModel(module=module, tables=check_own_model(module, data), name=type(module).__name__)


def check_own_model(module: nn.Module, data: RecDataset) -> dict[str, tuple[int, int]]:
    """Check that `module` provides what the Trainer needs (module docstring) for `data`.

    Returns:
        Its embedding tables: name -> (rows, dim).

    Raises:
        ValueError: naming what is missing and the fix.
    """
    name = type(module).__name__
    if isinstance(module, DistributedModelParallel | DistributedDataParallel):
        raise ValueError(
            f"Trainer(model=...) got a {name}: pass the unsharded model, the Trainer wraps it in "
            "DistributedModelParallel itself"
        )
    try:
        inspect.signature(module.forward).bind(None)
    except TypeError:
        params = ", ".join(inspect.signature(module.forward).parameters)
        raise ValueError(
            f"Trainer(model=...): {name}.forward({params}) cannot be called as model(batch); the "
            "Trainer needs model(batch) -> (loss, (loss, logits, labels)) (TorchRec's train "
            f"pipeline contract): {_WRAP_HINT}"
        ) from None
    collections = [m for m in module.modules() if isinstance(m, EmbeddingBagCollection)]
    if not collections:
        raise ValueError(
            f"Trainer(model=...): {name} holds no torchrec EmbeddingBagCollection; the Trainer "
            "shards the embedding tables of EmbeddingBagCollections: build the sparse side as one"
        )
    rows_of = dict(zip(data.feature_names, data.num_embeddings_per_feature))
    tables: dict[str, tuple[int, int]] = {}
    for ebc in collections:
        for cfg in ebc.embedding_bag_configs():
            if cfg.name in tables:
                raise ValueError(
                    f"Trainer(model=...): two embedding tables are named {cfg.name!r}; give "
                    "every table of the model its own name"
                )
            tables[cfg.name] = (cfg.num_embeddings, cfg.embedding_dim)
            for feature in cfg.feature_names:
                if feature not in rows_of:
                    raise ValueError(
                        f"Trainer(model=...): table {cfg.name!r} reads feature {feature!r}, which "
                        f"the data does not have; its features are {data.feature_names[0]} .. "
                        f"{data.feature_names[-1]} (data.num_sparse={len(rows_of)}): name the "
                        "tables' features after them"
                    )
                if cfg.num_embeddings < rows_of[feature]:
                    raise ValueError(
                        f"Trainer(model=...): table {cfg.name!r} has {cfg.num_embeddings} rows but "
                        f"feature {feature!r} holds ids up to {rows_of[feature] - 1} "
                        "(data.num_embeddings / data.num_embeddings_per_feature): give the table "
                        f"num_embeddings >= {rows_of[feature]}, or the data fewer"
                    )
    used = {f for ebc in collections for cfg in ebc.embedding_bag_configs() for f in cfg.feature_names}
    if len(used) < len(rows_of):
        logger.info(
            "%s reads %d of the data's %d sparse features (%s unused)",
            name, len(used), len(rows_of), ", ".join(f for f in data.feature_names if f not in used),
        )
    return tables


def check_train_output(output: object, name: str) -> None:
    """Check the second element of the model's first training output: ``(loss, logits, labels)``
    (the first element, the loss, was backpropagated by the train pipeline).

    Raises:
        ValueError: naming the contract and the fix.
    """
    if isinstance(output, tuple | list) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output):
        return
    got = (
        f"a {type(output).__name__} of {len(output)}" if isinstance(output, tuple | list)
        else f"a {type(output).__name__}"
    )
    raise ValueError(
        f"Trainer(model=...): {name}(batch) must return (loss, (loss, logits, labels)); the "
        f"second element is {got}: {_WRAP_HINT}"
    )
