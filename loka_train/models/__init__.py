"""The DLRM family used by the launcher and the tests: DLRM, DLRM_DCN, Wukong-style."""

from loka_train.models.build import (
    RecTrainModel,
    build_model,
    full_table,
    init_embedding_tables,
    local_shards,
    table_name,
)
from loka_train.models.config import ModelConfig
from loka_train.models.wukong import Wukong

__all__ = [
    "ModelConfig",
    "RecTrainModel",
    "Wukong",
    "build_model",
    "full_table",
    "init_embedding_tables",
    "local_shards",
    "table_name",
]
