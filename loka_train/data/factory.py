"""The one entry point that builds a dataset from a DataConfig."""

from __future__ import annotations

from loka_train.data.config import DataConfig
from loka_train.data.protocol import RecDataset


def make_dataset(
    cfg: DataConfig, *, split: str, rank: int, world_size: int, batch_size: int
) -> RecDataset:
    """Build the rank-local view of the train or eval split.

    Args:
        cfg: the data config.
        split: "train" or "eval".
        rank: this process's rank in [0, world_size).
        world_size: number of ranks sharing each global batch.
        batch_size: samples PER RANK per step (the global batch is batch_size * world_size).

    Raises:
        ValueError: on a bad split/rank/world_size/batch_size, a chunk_size that does not divide
            the batch (synthetic), or an eval split without data.eval_path or whose files
            overlap data.path (criteo_tsv), or a malformed day file (criteo_npy).
        FileNotFoundError: when the criteo_tsv path of the split does not exist, or a day file
            of criteo_npy is missing.

    Example:
        >>> ds = make_dataset(DataConfig(), split="train", rank=0, world_size=2, batch_size=256)
        >>> for batch in ds.batches(start_step=10, num_steps=5):
        ...     batch.dense_features.shape  # (256, 13)
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1 (it is per rank)")
    if cfg.kind == "synthetic":
        from loka_train.data.synthetic import SyntheticDataset

        return SyntheticDataset(
            cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size
        )
    if cfg.kind == "criteo_tsv":
        if split == "eval" and not cfg.eval_path:
            raise ValueError(
                "data.eval_path is required to evaluate with data.kind='criteo_tsv': set it to "
                "a held-out .tsv file or directory (it must not overlap data.path)"
            )
        from loka_train.data.criteo_tsv import CriteoTsvDataset

        return CriteoTsvDataset(
            cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size
        )
    if cfg.kind == "criteo_npy":
        from loka_train.data.criteo_npy import CriteoNpyDataset

        return CriteoNpyDataset(
            cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size
        )
    raise AssertionError(f"DataConfig accepted an unknown kind {cfg.kind!r}")
