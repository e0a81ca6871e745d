"""Model configuration: which DLRM-family model to build and its dense sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL_KINDS = ("dlrm", "dcn", "wukong")


@dataclass(kw_only=True)
class ModelConfig:
    """Dense-side shape of the model; tables come from the dataset's features.

    Example:
        >>> ModelConfig(kind="dcn", dcn_num_layers=3, dcn_low_rank_dim=64)
    """

    kind: str = "dlrm"
    """One of "dlrm" (TorchRec DLRM, dot interaction), "dcn" (TorchRec DLRM_DCN, low-rank
    cross network) or "wukong" (stacked FM block + linear compression block)."""

    embedding_dim: int = 16
    """Dimension D of every embedding table (and of the bottom MLP's output)."""

    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP widths; the last must equal `embedding_dim`."""

    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 32, 1])
    """Top MLP widths; the last must be 1 (the logit)."""

    dcn_num_layers: int = 3
    """DCN only: number of low-rank cross layers."""

    dcn_low_rank_dim: int = 16
    """DCN only: rank of each cross layer's factorisation W = U V."""

    wukong_num_layers: int = 2
    """Wukong only: number of stacked interaction layers."""

    wukong_num_fm_out: int = 8
    """Wukong only: embeddings produced by each Factorization-Machine block."""

    wukong_fm_rank: int = 8
    """Wukong only: rank k of the FM block's projection (X (X^T Y), Y of shape n x k)."""

    wukong_num_lcb_out: int = 8
    """Wukong only: embeddings produced by each Linear Compression Block."""

    wukong_mlp_hidden: int = 64
    """Wukong only: hidden width of the MLP inside each FM block."""

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model.kind={self.kind!r}: choose one of {MODEL_KINDS}")
        if self.embedding_dim <= 0:
            raise ValueError(f"model.embedding_dim={self.embedding_dim} must be positive")
        if not self.dense_arch_layer_sizes or self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes={self.dense_arch_layer_sizes} must end with "
                f"embedding_dim={self.embedding_dim}"
            )
        if not self.over_arch_layer_sizes or self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(
                f"model.over_arch_layer_sizes={self.over_arch_layer_sizes} must end with 1 (the logit)"
            )
        for name in (
            "dcn_num_layers",
            "dcn_low_rank_dim",
            "wukong_num_layers",
            "wukong_num_fm_out",
            "wukong_fm_rank",
            "wukong_num_lcb_out",
            "wukong_mlp_hidden",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
