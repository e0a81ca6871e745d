"""A reader of the preprocessed Criteo 1TB format of TorchRec and the MLPerf DLRM-DCN reference.

A directory holds three files per day ``i`` (written by TorchRec's
``BinaryCriteoUtils.tsv_to_npys`` / ``scripts/npy_preproc_criteo.py``):

- ``day_{i}_dense.npy``: float32, N x 13, the dense features already transformed (log) by the
  preprocessing, so they are used as they are;
- ``day_{i}_sparse.npy``: an integer type, N x 26, one categorical id per feature (one-hot);
- ``day_{i}_labels.npy``: an integer type, N x 1 (or N), 0/1 clicks.

Files are memory-mapped (``np.load(mmap_mode="r")``, as TorchRec's
``InMemoryBinaryCriteoIterDataPipe(mmap_mode=True)``), so only the rows a rank reads are paged
in. Ids are hashed into the tables like TorchRec's ``hashes``: id % rows of the feature's table.

The days of ``data.train_days`` form one stream of rows. Step s uses rows [s*W*B, (s+1)*W*B)
(W ranks, per-rank batch B) and rank r takes its B-row slice: the rows TorchRec's
``InMemoryBinaryCriteoIterDataPipe(drop_last=True)`` gives rank r as its batch s (it hands batch
b of the stream to rank b % W). A trailing partial global batch is dropped. The eval split is
the whole of ``data.eval_day`` (MLPerf's validation and test halves together).

Shape legend:
  B  samples in the batch      D  dense features      F  categorical features
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_train.data.config import DataConfig

logger = logging.getLogger(__name__)

_PARTS = ("dense", "sparse", "labels")

_REMAKE = "re-create the day with torchrec's BinaryCriteoUtils.tsv_to_npys"


def day_paths(root: Path, day: int) -> dict[str, Path]:
    """The three files of `day` under `root`, by part ("dense", "sparse", "labels").

    Example:
        >>> day_paths(Path("/data/criteo"), 3)["sparse"]
        PosixPath('/data/criteo/day_3_sparse.npy')
    """
    return {part: root / f"day_{day}_{part}.npy" for part in _PARTS}


@dataclass(frozen=True)
class NpyDay:
    """One day's memory-mapped arrays, checked against the config."""

    day: int
    dense_ND: np.ndarray
    sparse_NF: np.ndarray
    labels_N: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.dense_ND.shape[0])


def _load(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npy array ({err}): {_REMAKE}") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{path}: holds {type(arr).__name__}, not one array: {_REMAKE}")
    return arr


def _check_columns(path: Path, arr: np.ndarray, what: str, width: int, key: str) -> None:
    if arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(
            f"{path}: {what} has shape {tuple(arr.shape)}, expected (rows, {width}) with "
            f"{key}={width}: set {key} to the file's column count or {_REMAKE}"
        )


def open_day(root: Path, day: int, *, num_dense: int, num_sparse: int, key: str) -> NpyDay:
    """Memory-map and check the three files of `day`.

    Args:
        root: the directory (data.path).
        day: the day number.
        num_dense: expected dense columns (data.num_dense).
        num_sparse: expected sparse columns (data.num_sparse).
        key: the config key that named the day ("data.train_days" or "data.eval_day").

    Raises:
        FileNotFoundError: naming the missing files and the settings that fix it.
        ValueError: naming the file when its dtype or column count is wrong, or when the three
            files hold different numbers of rows.
    """
    paths = day_paths(root, day)
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"data.path={str(root)!r} has no {', '.join(missing)} (day {day} is in {key}): put "
            f"the day's files there, point data.path at the directory that has them, or leave "
            f"day {day} out of {key}"
        )
    dense = _load(paths["dense"])
    sparse = _load(paths["sparse"])
    labels = _load(paths["labels"])
    if dense.dtype != np.float32:
        raise ValueError(
            f"{paths['dense']}: dense features are {dense.dtype}, expected float32 (the "
            f"log-transformed counts): save them with .astype(np.float32) or {_REMAKE}"
        )
    _check_columns(paths["dense"], dense, "the dense array", num_dense, "data.num_dense")
    if sparse.dtype.kind not in "iu":
        raise ValueError(
            f"{paths['sparse']}: categorical ids are {sparse.dtype}, expected an integer type "
            f"(int32 or int64): save them with .astype(np.int64) or {_REMAKE}"
        )
    _check_columns(paths["sparse"], sparse, "the sparse array", num_sparse, "data.num_sparse")
    if labels.dtype.kind not in "iub":
        raise ValueError(
            f"{paths['labels']}: labels are {labels.dtype}, expected an integer type (int32 "
            f"0/1 clicks): save them with .astype(np.int32) or {_REMAKE}"
        )
    if not (labels.ndim == 1 or (labels.ndim == 2 and labels.shape[1] == 1)):
        raise ValueError(
            f"{paths['labels']}: labels have shape {tuple(labels.shape)}, expected (rows, 1) "
            f"or (rows,): {_REMAKE}"
        )
    rows = {part: int(arr.shape[0]) for part, arr in zip(_PARTS, (dense, sparse, labels))}
    if len(set(rows.values())) != 1:
        counts = ", ".join(f"{paths[part].name} {n}" for part, n in rows.items())
        raise ValueError(
            f"day {day} in {root}: the files hold different numbers of rows ({counts}); the "
            f"three files of a day must describe the same samples: {_REMAKE}"
        )
    return NpyDay(day=day, dense_ND=dense, sparse_NF=sparse, labels_N=labels.reshape(-1))


class CriteoNpyDataset:
    """Rank-sliced DLRM batches from preprocessed Criteo day files; see the module docstring.

    Args:
        cfg: the data config (kind "criteo_npy"): path is the directory, train_days the training
            stream, eval_day the eval split.
        split: "train" (reads cfg.train_days) or "eval" (reads cfg.eval_day).
        rank: this process's rank in [0, world_size).
        world_size: number of ranks sharing the global batch.
        batch_size: rows per rank per step.

    Raises:
        FileNotFoundError: when data.path is not a directory or a day's file is missing.
        ValueError: when a file has the wrong dtype or column count, or a day's files disagree
            on the number of rows.

    Example:
        >>> cfg = DataConfig(kind="criteo_npy", path="/data/criteo", train_days=[0, 1], eval_day=23)
        >>> ds = CriteoNpyDataset(cfg, split="train", rank=1, world_size=2, batch_size=512)
        >>> batch = ds.batch(100)  # rows 100*2*512 + 512 .. +512 of days 0, 1
    """

    def __init__(
        self, cfg: DataConfig, *, split: str, rank: int, world_size: int, batch_size: int
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} must be 'train' or 'eval'")
        if not cfg.path or not Path(cfg.path).expanduser().is_dir():
            raise FileNotFoundError(
                f"data.path={cfg.path!r} is not a directory: set data.path to the directory of "
                "the day_{i}_dense.npy / day_{i}_sparse.npy / day_{i}_labels.npy files"
            )
        root = Path(cfg.path).expanduser()
        assert cfg.train_days is not None, "DataConfig fills train_days for criteo_npy"
        self.key = "data.train_days" if split == "train" else "data.eval_day"
        days = list(cfg.train_days) if split == "train" else [cfg.eval_day]
        self.days = [
            open_day(root, d, num_dense=cfg.num_dense, num_sparse=cfg.num_sparse, key=self.key)
            for d in days
        ]
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.feature_names = [f"cat_{f}" for f in range(cfg.num_sparse)]
        self.num_embeddings_per_feature = cfg.rows_per_feature
        self.num_dense = cfg.num_dense
        self._hashes_1F = np.array(self.num_embeddings_per_feature, dtype=np.int64).reshape(1, -1)
        self._day_starts = np.cumsum([0] + [d.num_rows for d in self.days]).tolist()

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.batch_size

    @property
    def num_rows(self) -> int:
        """Rows in all days of the split."""
        return int(self._day_starts[-1])

    def num_steps(self) -> int:
        """Full global batches in the split (from the files' headers, nothing is read)."""
        return self.num_rows // self.global_batch_size

    def batch(self, step: int) -> Batch:
        """The local batch of `step` (this rank's B rows of rows [step*W*B, (step+1)*W*B)).

        Raises:
            IndexError: when the split holds no full global batch for `step`.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if step >= self.num_steps():
            raise IndexError(
                f"step {step} is past the end of {self.key} ({self.num_rows} rows = "
                f"{self.num_steps()} full global batches of {self.global_batch_size})"
            )
        first = step * self.global_batch_size + self.rank * self.batch_size
        return self._to_batch(*self._rows(first, self.batch_size))

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Local batches from start_step on; stops at the end of the split or after num_steps
        batches. A trailing partial global batch is dropped (and logged)."""
        if start_step < 0 or (num_steps is not None and num_steps < 0):
            raise ValueError(f"start_step={start_step} and num_steps={num_steps} must be >= 0")
        end = self.num_steps() if num_steps is None else min(self.num_steps(), start_step + num_steps)
        for step in range(start_step, end):
            yield self.batch(step)
        left = self.num_rows - self.num_steps() * self.global_batch_size
        if left and (num_steps is None or end < start_step + num_steps):
            logger.info(
                "%s: end of data at step %d; dropping the last %d rows (a partial global batch "
                "of %d)", self.key, end, left, self.global_batch_size,
            )

    def _rows(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [first, first+count) of the stream, copied out of the maps (across days)."""
        dense, sparse, labels = [], [], []
        pos, end = first, first + count
        while pos < end:
            i = bisect.bisect_right(self._day_starts, pos) - 1
            day = self.days[i]
            lo = pos - self._day_starts[i]
            hi = min(end - self._day_starts[i], day.num_rows)
            dense.append(day.dense_ND[lo:hi])
            sparse.append(day.sparse_NF[lo:hi])
            labels.append(day.labels_N[lo:hi])
            pos += hi - lo
        return np.concatenate(dense), np.concatenate(sparse), np.concatenate(labels)

    def _to_batch(self, dense_BD: np.ndarray, sparse_BF: np.ndarray, labels_B: np.ndarray) -> Batch:
        B, F = sparse_BF.shape
        ids_BF = sparse_BF.astype(np.int64) % self._hashes_1F
        # KeyedJaggedTensor values are feature-major: all of cat_0's ids, then cat_1's, ...
        values = torch.from_numpy(np.ascontiguousarray(ids_BF.T).reshape(-1))
        kjt = KeyedJaggedTensor(
            keys=self.feature_names,
            values=values,
            lengths=torch.ones(F * B, dtype=torch.int32),
            stride=B,
        )
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense_BD, dtype=np.float32)),
            sparse_features=kjt,
            labels=torch.from_numpy(labels_B.astype(np.float32)),
        )
