"""A Wukong-style interaction model (Zhang et al., 2024) on a TorchRec sparse side.

Each interaction layer maps n embeddings to n' = num_fm_out + num_lcb_out embeddings:
  * Factorization-Machine block (FMB): X (X^T Y) with a learned projection Y (n x k), then
    LayerNorm and a small MLP that emits num_fm_out embeddings;
  * Linear Compression Block (LCB): a learned linear mix of the n embeddings into
    num_lcb_out embeddings;
then LayerNorm over the concatenation plus a (projected) residual. This is the "small GEMM
followed by normalization" shape that LoKA targets; every GEMM is an nn.Linear or a bmm so
`mods.convert` can reach it.

Shape legend: B batch, N embeddings entering a layer, D embedding dim, K FM rank,
F FM outputs, L LCB outputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, OverArch, SparseArch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class FactorizationMachineBlock(nn.Module):
    """FM block: pairwise interactions X X^T compressed through a rank-k projection.

    Args:
        num_in: N, embeddings entering the block.
        dim: D, embedding dimension.
        rank: K, columns of the projection Y.
        num_out: F, embeddings the block emits.
        hidden: width of the block's MLP.
    """

    def __init__(self, *, num_in: int, dim: int, rank: int, num_out: int, hidden: int) -> None:
        super().__init__()
        self.num_out = num_out
        self.dim = dim
        # Y applied as a Linear over the embedding axis: (X^T)_{BDN} Y_{NK}.
        self.proj = nn.Linear(num_in, rank, bias=False)
        self.norm = nn.LayerNorm(num_in * rank)
        self.mlp = nn.Sequential(
            nn.Linear(num_in * rank, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_out * dim),
        )

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        xt_BDN = x_BND.transpose(1, 2)
        proj_BDK = self.proj(xt_BDN)
        fm_BNK = torch.bmm(x_BND, proj_BDK)
        out = self.mlp(self.norm(fm_BNK.flatten(1)))
        return out.view(-1, self.num_out, self.dim)


class LinearCompressionBlock(nn.Module):
    """LCB: a learned linear recombination of the N embeddings into L embeddings."""

    def __init__(self, *, num_in: int, num_out: int) -> None:
        super().__init__()
        self.mix = nn.Linear(num_in, num_out, bias=False)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        return self.mix(x_BND.transpose(1, 2)).transpose(1, 2)


class WukongLayer(nn.Module):
    """One interaction layer: LayerNorm(concat(FMB(X), LCB(X)) + residual(X))."""

    def __init__(
        self, *, num_in: int, dim: int, rank: int, num_fm_out: int, num_lcb_out: int, hidden: int
    ) -> None:
        super().__init__()
        num_out = num_fm_out + num_lcb_out
        self.fmb = FactorizationMachineBlock(
            num_in=num_in, dim=dim, rank=rank, num_out=num_fm_out, hidden=hidden
        )
        self.lcb = LinearCompressionBlock(num_in=num_in, num_out=num_lcb_out)
        self.residual = (
            nn.Linear(num_in, num_out, bias=False) if num_in != num_out else nn.Identity()
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        out_BND = torch.cat([self.fmb(x_BND), self.lcb(x_BND)], dim=1)
        if isinstance(self.residual, nn.Identity):
            res_BND = x_BND
        else:
            res_BND = self.residual(x_BND.transpose(1, 2)).transpose(1, 2)
        return self.norm(out_BND + res_BND)


class Wukong(nn.Module):
    """Wukong-style model: TorchRec sparse arch, bottom MLP, stacked layers, top MLP.

    Args:
        embedding_bag_collection: the sparse side (sharded by DistributedModelParallel).
        dense_in_features: number of dense features.
        dense_arch_layer_sizes: bottom MLP widths, ending at the embedding dim.
        over_arch_layer_sizes: top MLP widths, ending at 1.
        num_layers, num_fm_out, fm_rank, num_lcb_out, mlp_hidden: see ModelConfig.

    Example:
        >>> model = Wukong(embedding_bag_collection=ebc, dense_in_features=13,
        ...                dense_arch_layer_sizes=[32, 16], over_arch_layer_sizes=[32, 1])
        >>> logits = model(dense_features, sparse_features)
    """

    def __init__(
        self,
        *,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        num_layers: int = 2,
        num_fm_out: int = 8,
        fm_rank: int = 8,
        num_lcb_out: int = 8,
        mlp_hidden: int = 64,
    ) -> None:
        super().__init__()
        dim = embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(
            in_features=dense_in_features, layer_sizes=dense_arch_layer_sizes
        )
        num_in = len(self.sparse_arch.sparse_feature_names) + 1
        layers = []
        for _ in range(num_layers):
            layers.append(
                WukongLayer(
                    num_in=num_in,
                    dim=dim,
                    rank=fm_rank,
                    num_fm_out=num_fm_out,
                    num_lcb_out=num_lcb_out,
                    hidden=mlp_hidden,
                )
            )
            num_in = num_fm_out + num_lcb_out
        self.inter_arch = nn.Sequential(*layers)
        self.over_arch = OverArch(in_features=num_in * dim, layer_sizes=over_arch_layer_sizes)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        dense_BD = self.dense_arch(dense_features)
        sparse_BFD = self.sparse_arch(sparse_features)
        x_BND = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        return self.over_arch(self.inter_arch(x_BND).flatten(1))
