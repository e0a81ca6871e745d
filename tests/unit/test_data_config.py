"""DataConfig validation and make_dataset argument checks: errors name the field and the fix."""

from __future__ import annotations

import pytest

from loka_train.data import DataConfig, make_dataset


def test_defaults() -> None:
    cfg = DataConfig()
    assert cfg.kind == "synthetic" and cfg.num_dense == 13 and cfg.num_sparse == 26
    assert cfg.rows_per_feature == [10_000] * 26
    rows = list(range(1, 27))
    assert DataConfig(num_embeddings_per_feature=rows).rows_per_feature == rows


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "parquet"}, "data.kind='parquet' is unknown"),
        ({"kind": "criteo_tsv"}, "data.path is required"),
        ({"num_dense": 0}, "data.num_dense=0 must be a positive integer"),
        ({"num_sparse": -1}, "data.num_sparse"),
        ({"num_embeddings": 0}, "data.num_embeddings"),
        ({"chunk_size": 0}, "data.chunk_size"),
        ({"max_pooling": 0}, "data.max_pooling"),
        ({"num_embeddings_per_feature": [10] * 3}, "data.num_embeddings_per_feature has 3 entries"),
        (
            {"num_embeddings_per_feature": [10] * 25 + [0]},
            "data.num_embeddings_per_feature has invalid",
        ),
        ({"seed": -1}, "data.seed"),
        ({"zipf_exponent": 0.0}, "data.zipf_exponent"),
        ({"teacher_scale": -0.5}, "data.teacher_scale"),
        ({"cache_batches": -1}, "data.cache_batches=-1 must be an integer >= 0"),
        ({"teacher_scale": float("nan")}, "data.teacher_scale"),
    ],
)
def test_invalid_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        DataConfig("synthetic")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "split='test'"),
        ({"rank": 2, "world_size": 2}, "rank=2, world_size=2"),
        ({"world_size": 0}, "world_size=0"),
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_make_dataset_arguments(kwargs: dict, message: str) -> None:
    args = {"split": "train", "rank": 0, "world_size": 1, "batch_size": 64} | kwargs
    with pytest.raises(ValueError, match=message):
        make_dataset(DataConfig(), **args)
