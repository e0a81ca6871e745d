"""loka_train.data: synthetic Criteo-like data with a hidden teacher, readers of Criteo TSV
files and of the preprocessed Criteo 1TB .npy day files (TorchRec / MLPerf), and the
evaluation metrics (normalized entropy, AUC, calibration).

Every dataset obeys one determinism contract: the global batch of step s is the
concatenation over ranks of the local batches, so runs on different numbers of ranks with
the same global batch see the same samples.

Example:
    >>> from loka_train.data import DataConfig, make_dataset, normalized_entropy
    >>> ds = make_dataset(DataConfig(seed=1), split="train", rank=0, world_size=1, batch_size=256)
    >>> batch = ds.batch(0)
"""

from loka_train.data.config import DataConfig
from loka_train.data.factory import make_dataset
from loka_train.data.metrics import auc, calibration, normalized_entropy
from loka_train.data.protocol import RecDataset

__all__ = ["DataConfig", "RecDataset", "auc", "calibration", "make_dataset", "normalized_entropy"]
