"""A reader of the preprocessed Criteo 1TB format of TorchRec and the MLPerf DLRM-DCN reference.

A directory holds three files per day ``i`` (written by TorchRec's
``BinaryCriteoUtils.tsv_to_npys`` / ``scripts/npy_preproc_criteo.py``):

- ``day_{i}_dense.npy``: float32, N x 13, the dense features already transformed (log) by the
  preprocessing, so they are used as they are;
- ``day_{i}_sparse.npy``: an integer type, N x 26, one categorical id per feature (one-hot);
- ``day_{i}_labels.npy``: an integer type, N x 1 (or N), 0/1 clicks;
- with ``data.multi_hot``, ``day_{i}_sparse_multi_hot.npz`` instead of the sparse file: the
  MLPerf DLRM-DCN v2 multi-hot ids (``materialize_synthetic_multihot_dataset.py``), an
  uncompressed ``np.savez`` archive of arrays "0" .. "25", array f of shape N x pooling_f.

Files are memory-mapped (``np.load(mmap_mode="r")``, as TorchRec's
``InMemoryBinaryCriteoIterDataPipe(mmap_mode=True)``; the arrays inside the .npz at their
offsets in the archive, as MLPerf's reader does), so only the rows a rank reads are paged in. Ids are hashed into the tables like TorchRec's ``hashes``: id % rows of the feature's table.

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
import struct
import zipfile
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

_REMAKE_MULTI_HOT = "re-create it with MLPerf's materialize_synthetic_multihot_dataset.py"


def day_paths(root: Path, day: int, *, multi_hot: bool = False) -> dict[str, Path]:
    """The three files of `day` under `root`, by part ("dense", "sparse", "labels").

    Example:
        >>> day_paths(Path("/data/criteo"), 3)["sparse"]
        PosixPath('/data/criteo/day_3_sparse.npy')
        >>> day_paths(Path("/data/criteo"), 3, multi_hot=True)["sparse"]
        PosixPath('/data/criteo/day_3_sparse_multi_hot.npz')
    """
    paths = {part: root / f"day_{day}_{part}.npy" for part in _PARTS}
    if multi_hot:
        paths["sparse"] = root / f"day_{day}_sparse_multi_hot.npz"
    return paths


@dataclass(frozen=True)
class NpyDay:
    """One day's memory-mapped arrays, checked against the config."""

    day: int
    dense_ND: np.ndarray
    sparse_NF: list[np.ndarray]
    """One-hot: one N x F array; multi-hot: F arrays, feature f's of shape N x pooling_f."""
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


def _load_npz(path: Path, num_sparse: int) -> list[np.ndarray]:
    """Memory-map arrays "0" .. "{num_sparse-1}" of an uncompressed .npz archive in place."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{path}: not a readable .npz archive ({err}): {_REMAKE_MULTI_HOT}") from None
    missing = [str(f) for f in range(num_sparse) if str(f) not in members]
    if missing:
        raise ValueError(
            f"{path}: has no array(s) {', '.join(missing[:5])} of the {num_sparse} features "
            f"(it holds {sorted(members)[:5]}...): set data.num_sparse to its feature count or "
            f"{_REMAKE_MULTI_HOT}"
        )
    arrays: list[np.ndarray] = []
    with open(path, "rb") as fh:
        for f in range(num_sparse):
            info = members[str(f)]
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(
                    f"{path}: array {f} is compressed (np.savez_compressed) and cannot be "
                    f"memory-mapped: write the archive with np.savez or {_REMAKE_MULTI_HOT}"
                )
            # The local file header: 30 bytes, then the name and the extra field.
            fh.seek(info.header_offset)
            header = fh.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            fh.seek(info.header_offset + 30 + name_len + extra_len)
            try:
                version = np.lib.format.read_magic(fh)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(fh)
            except ValueError as err:
                raise ValueError(f"{path}: array {f} is not a .npy array ({err}): {_REMAKE_MULTI_HOT}") from None
            arrays.append(
                np.memmap(path, dtype=dtype, mode="r", offset=fh.tell(), shape=shape, order="F" if fortran else "C")
            )
    return arrays


def _check_columns(path: Path, arr: np.ndarray, what: str, width: int, key: str) -> None:
    if arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(
            f"{path}: {what} has shape {tuple(arr.shape)}, expected (rows, {width}) with "
            f"{key}={width}: set {key} to the file's column count or {_REMAKE}"
        )


def open_day(
    root: Path, day: int, *, num_dense: int, num_sparse: int, key: str, multi_hot: bool = False
) -> NpyDay:
    """Memory-map and check the three files of `day`.

    Args:
        root: the directory (data.path).
        day: the day number.
        num_dense: expected dense columns (data.num_dense).
        num_sparse: expected sparse columns (data.num_sparse).
        key: the config key that named the day ("data.train_days" or "data.eval_day").
        multi_hot: read the ids from day_{day}_sparse_multi_hot.npz (data.multi_hot).

    Raises:
        FileNotFoundError: naming the missing files and the settings that fix it.
        ValueError: naming the file when its dtype or column count is wrong, or when the three
            files hold different numbers of rows.
    """
    paths = day_paths(root, day, multi_hot=multi_hot)
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        other = day_paths(root, day, multi_hot=not multi_hot)["sparse"]
        switch = (
            f"; {other.name} is there: set data.multi_hot={str(not multi_hot).lower()} to read it"
            if paths["sparse"].name in missing and other.is_file()
            else ""
        )
        raise FileNotFoundError(
            f"data.path={str(root)!r} has no {', '.join(missing)} (day {day} is in {key}): put "
            f"the day's files there, point data.path at the directory that has them, or leave "
            f"day {day} out of {key}{switch}"
        )
    dense = _load(paths["dense"])
    labels = _load(paths["labels"])
    if dense.dtype != np.float32:
        raise ValueError(
            f"{paths['dense']}: dense features are {dense.dtype}, expected float32 (the "
            f"log-transformed counts): save them with .astype(np.float32) or {_REMAKE}"
        )
    _check_columns(paths["dense"], dense, "the dense array", num_dense, "data.num_dense")
    if multi_hot:
        sparse_F = _load_npz(paths["sparse"], num_sparse)
        for f, ids in enumerate(sparse_F):
            if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[1] < 1:
                raise ValueError(
                    f"{paths['sparse']}: array {f} is {ids.dtype} of shape {tuple(ids.shape)}, "
                    f"expected integer ids of shape (rows, pooling): {_REMAKE_MULTI_HOT}"
                )
    else:
        sparse = _load(paths["sparse"])
        if sparse.dtype.kind not in "iu":
            raise ValueError(
                f"{paths['sparse']}: categorical ids are {sparse.dtype}, expected an integer type "
                f"(int32 or int64): save them with .astype(np.int64) or {_REMAKE}"
            )
        _check_columns(paths["sparse"], sparse, "the sparse array", num_sparse, "data.num_sparse")
        sparse_F = [sparse]
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
    rows = {
        paths["dense"].name: int(dense.shape[0]),
        **{
            paths["sparse"].name + (f"[{f}]" if multi_hot else ""): int(ids.shape[0])
            for f, ids in enumerate(sparse_F)
        },
        paths["labels"].name: int(labels.shape[0]),
    }
    if len(set(rows.values())) != 1:
        counts = ", ".join(f"{name} {n}" for name, n in rows.items())
        raise ValueError(
            f"day {day} in {root}: the files hold different numbers of rows ({counts}); the "
            f"three files of a day must describe the same samples: {_REMAKE}"
        )
    return NpyDay(day=day, dense_ND=dense, sparse_NF=sparse_F, labels_N=labels.reshape(-1))


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
            open_day(
                root, d, num_dense=cfg.num_dense, num_sparse=cfg.num_sparse, key=self.key,
                multi_hot=cfg.multi_hot,
            )
            for d in days
        ]
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.feature_names = [f"cat_{f}" for f in range(cfg.num_sparse)]
        self.num_embeddings_per_feature = cfg.rows_per_feature
        self.num_dense = cfg.num_dense
        self.multi_hot = cfg.multi_hot
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

    def _rows(self, first: int, count: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Rows [first, first+count) of the stream, copied out of the maps (across days)."""
        dense, labels = [], []
        sparse: list[list[np.ndarray]] = [[] for _ in self.days[0].sparse_NF]
        pos, end = first, first + count
        while pos < end:
            i = bisect.bisect_right(self._day_starts, pos) - 1
            day = self.days[i]
            lo = pos - self._day_starts[i]
            hi = min(end - self._day_starts[i], day.num_rows)
            dense.append(day.dense_ND[lo:hi])
            for pieces, ids in zip(sparse, day.sparse_NF):
                pieces.append(ids[lo:hi])
            labels.append(day.labels_N[lo:hi])
            pos += hi - lo
        return (
            np.concatenate(dense),
            [np.concatenate(pieces) for pieces in sparse],
            np.concatenate(labels),
        )

    def _to_batch(self, dense_BD: np.ndarray, sparse: list[np.ndarray], labels_B: np.ndarray) -> Batch:
        # KeyedJaggedTensor values are feature-major: all of cat_0's ids, then cat_1's, ...
        B, F = dense_BD.shape[0], len(self.feature_names)
        if self.multi_hot:
            rows = self.num_embeddings_per_feature
            values = np.concatenate(
                [ids_BP.astype(np.int64).reshape(-1) % rows[f] for f, ids_BP in enumerate(sparse)]
            )
            lengths = np.repeat(np.array([ids_BP.shape[1] for ids_BP in sparse], np.int32), B)
        else:
            ids_BF = sparse[0].astype(np.int64) % self._hashes_1F
            values = np.ascontiguousarray(ids_BF.T).reshape(-1)
            lengths = np.ones(F * B, dtype=np.int32)
        kjt = KeyedJaggedTensor(
            keys=self.feature_names,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths),
            stride=B,
        )
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense_BD, dtype=np.float32)),
            sparse_features=kjt,
            labels=torch.from_numpy(labels_B.astype(np.float32)),
        )
