"""Preprocessed Criteo 1TB reader (day_{i}_{dense,sparse,labels}.npy): batches, rank slicing,
agreement with TorchRec's own reader, resume and the end of data, malformed files, the preset.

The fixture days are generated into tmp_path by `write_days`. Shape legend: B batch, D dense,
F categorical features, N rows of a day.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe
from torchrec.datasets.utils import Batch

from loka_train.data import DataConfig, make_dataset

NUM_DENSE, NUM_SPARSE, ROWS = 13, 26, 97


def write_days(
    root: Path,
    rows_per_day: dict[int, int],
    *,
    seed: int = 0,
    num_dense: int = NUM_DENSE,
    num_sparse: int = NUM_SPARSE,
    sparse_dtype: type = np.int32,
    pooling: list[int] | None = None,
) -> dict[int, dict[str, np.ndarray]]:
    """Write day_{i}_dense.npy (float32, N x D), day_{i}_sparse.npy (N x F ids, some larger
    than the tables) and day_{i}_labels.npy (int32, N x 1) as TorchRec's preprocessing does;
    with `pooling` (ids per feature), day_{i}_sparse_multi_hot.npz instead of the sparse file,
    as MLPerf's materialize_synthetic_multihot_dataset.py does (arrays "0".."F-1", N x
    pooling[f], int64). Returns the arrays by day and part ("multi_hot": the list)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    days = {}
    for day, n in rows_per_day.items():
        arrays = {
            "dense": rng.standard_normal((n, num_dense)).astype(np.float32),
            "sparse": rng.integers(0, 2**31 - 1, (n, num_sparse)).astype(sparse_dtype),
            "labels": rng.integers(0, 2, (n, 1)).astype(np.int32),
        }
        if pooling is not None:
            del arrays["sparse"]
            multi_hot = [rng.integers(0, 2**40, (n, p)) for p in pooling]
            np.savez(root / f"day_{day}_sparse_multi_hot.npz", **{str(f): a for f, a in enumerate(multi_hot)})
        for part, arr in arrays.items():
            np.save(root / f"day_{day}_{part}.npy", arr)
        if pooling is not None:
            arrays["multi_hot"] = multi_hot  # type: ignore[assignment]
        days[day] = arrays
    return days


def _cfg(root: Path, train_days: list[int] | None = None, eval_day: int = 2, **kw) -> DataConfig:
    return DataConfig(
        kind="criteo_npy", path=str(root), train_days=train_days or [0, 1], eval_day=eval_day,
        num_embeddings=ROWS, **kw,
    )


def _ds(cfg: DataConfig, *, split: str = "train", rank: int = 0, world_size: int = 1, batch_size: int = 8):
    return make_dataset(cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size)


def _rows(days: dict[int, dict[str, np.ndarray]], order: list[int], part: str) -> np.ndarray:
    return np.concatenate([days[d][part] for d in order])


def _assert_batch_is_rows(batch: Batch, days, order: list[int], lo: int, hi: int, rows: int = ROWS) -> None:
    dense, sparse, labels = (_rows(days, order, p)[lo:hi] for p in ("dense", "sparse", "labels"))
    B = hi - lo
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (B, NUM_DENSE)
    assert torch.equal(batch.dense_features, torch.from_numpy(dense))
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{f}" for f in range(NUM_SPARSE)] and kjt.stride() == B
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
    assert torch.equal(kjt.lengths(), torch.ones(NUM_SPARSE * B, dtype=torch.int32))
    for f, key in enumerate(kjt.keys()):
        ids = kjt[key].values()
        assert torch.equal(ids, torch.from_numpy(sparse[:, f].astype(np.int64) % rows)), key
    assert int(kjt.values().max()) < rows and int(kjt.values().min()) >= 0
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (B,)
    assert torch.equal(batch.labels, torch.from_numpy(labels.reshape(-1).astype(np.float32)))


def test_batch_shapes_dtypes_and_hashed_ids(tmp_path: Path) -> None:
    days = write_days(tmp_path, {0: 20, 1: 20, 2: 12})
    ds = _ds(_cfg(tmp_path))
    assert ds.num_steps() == 5 and ds.feature_names == [f"cat_{f}" for f in range(NUM_SPARSE)]
    assert ds.num_embeddings_per_feature == [ROWS] * NUM_SPARSE and ds.num_dense == NUM_DENSE
    for step in range(5):  # step 2 spans the end of day 0 and the start of day 1
        _assert_batch_is_rows(ds.batch(step), days, [0, 1], step * 8, step * 8 + 8)
    evals = list(_ds(_cfg(tmp_path), split="eval").batches())
    assert len(evals) == 1
    _assert_batch_is_rows(evals[0], days, [2], 0, 8)


def test_per_feature_rows_and_int64_ids(tmp_path: Path) -> None:
    rows = list(range(3, 3 + NUM_SPARSE))
    days = write_days(tmp_path, {0: 16, 1: 16, 2: 8}, sparse_dtype=np.int64)
    ds = _ds(_cfg(tmp_path, num_embeddings_per_feature=rows))
    batch = ds.batch(1)
    for f in range(NUM_SPARSE):
        expected = days[0]["sparse"][8:16, f] % rows[f]
        assert torch.equal(batch.sparse_features[f"cat_{f}"].values(), torch.from_numpy(expected))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_concatenate_to_the_single_process_batch(tmp_path: Path, world_size: int) -> None:
    write_days(tmp_path, {0: 23, 1: 31, 2: 8})
    cfg = _cfg(tmp_path)
    single = _ds(cfg, batch_size=4 * world_size)
    ranks = [_ds(cfg, rank=r, world_size=world_size, batch_size=4) for r in range(world_size)]
    assert all(ds.num_steps() == single.num_steps() for ds in ranks)
    for step in range(single.num_steps()):
        whole = single.batch(step)
        parts = [ds.batch(step) for ds in ranks]
        assert torch.equal(whole.dense_features, torch.cat([p.dense_features for p in parts]))
        assert torch.equal(whole.labels, torch.cat([p.labels for p in parts]))
        for key in whole.sparse_features.keys():
            got = torch.cat([p.sparse_features[key].values() for p in parts])
            assert torch.equal(whole.sparse_features[key].values(), got), (step, key)
        assert not torch.equal(parts[0].dense_features, parts[1].dense_features)


@pytest.mark.parametrize("world_size", [1, 2])
def test_same_batches_as_torchrec_reader(tmp_path: Path, world_size: int) -> None:
    """Rank r's batches are those of TorchRec's InMemoryBinaryCriteoIterDataPipe (mmap, drop_last)."""
    write_days(tmp_path, {0: 21, 1: 30, 2: 8})
    cfg = _cfg(tmp_path)
    for rank in range(world_size):
        ours = list(_ds(cfg, rank=rank, world_size=world_size, batch_size=5).batches())
        theirs = list(
            InMemoryBinaryCriteoIterDataPipe(
                "train",
                *([str(tmp_path / f"day_{d}_{p}.npy") for d in (0, 1)] for p in ("dense", "sparse", "labels")),
                batch_size=5, rank=rank, world_size=world_size, drop_last=True, mmap_mode=True,
                hashes=[ROWS] * NUM_SPARSE,
            )
        )
        assert len(ours) == len(theirs) == 51 // (5 * world_size)
        for a, b in zip(ours, theirs):
            assert torch.equal(a.dense_features, b.dense_features)
            assert torch.equal(a.sparse_features.values(), b.sparse_features.values().long())
            assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
            assert torch.equal(a.labels, b.labels.float())


def test_reads_the_files_of_torchrec_tsv_to_npys(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lines = []
    for _ in range(12):
        dense = [str(v) for v in rng.integers(0, 50, NUM_DENSE)]
        cats = [f"{v:08x}" for v in rng.integers(0, 2**32, NUM_SPARSE)]
        lines.append("\t".join([str(rng.integers(0, 2)), *dense, *cats]))
    (tmp_path / "day_0.tsv").write_text("\n".join(lines) + "\n")
    for day in (0, 1):  # day 1 (the eval day) a copy of day 0
        BinaryCriteoUtils.tsv_to_npys(
            str(tmp_path / "day_0.tsv"),
            *(str(tmp_path / f"day_{day}_{p}.npy") for p in ("dense", "sparse", "labels")),
        )
    batch = _ds(_cfg(tmp_path, train_days=[0], eval_day=1), batch_size=12).batch(0)
    assert batch.dense_features.shape == (12, NUM_DENSE)
    assert torch.equal(batch.dense_features, torch.from_numpy(np.load(tmp_path / "day_0_dense.npy")))
    first = lines[0].split("\t")
    assert batch.labels[0].item() == int(first[0])
    assert batch.sparse_features["cat_5"].values()[0].item() == int(first[1 + NUM_DENSE + 5], 16) % ROWS


def test_resume_and_end_of_data(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loka_train.data.criteo_npy")
    write_days(tmp_path, {0: 20, 1: 23, 2: 8})
    ds = _ds(_cfg(tmp_path), rank=1, world_size=2, batch_size=4)
    assert ds.num_steps() == 5  # 43 rows, global batch 8: 3 rows dropped
    resumed = list(ds.batches(start_step=3))
    assert len(resumed) == 2
    for i, batch in enumerate(resumed):
        assert torch.equal(batch.dense_features, ds.batch(3 + i).dense_features)
    assert "dropping the last 3 rows" in caplog.text
    assert len(list(ds.batches(1, 2))) == 2
    with pytest.raises(IndexError, match=r"step 5 is past the end of data.train_days \(43 rows"):
        ds.batch(5)


def _set(root: Path, day: int, part: str, arr: np.ndarray) -> Path:
    path = root / f"day_{day}_{part}.npy"
    np.save(path, arr)
    return path


MALFORMED = {
    # name: (how the fixture is broken, the file named in the error, words of the error)
    "dense_dtype": (
        lambda r, d: _set(r, 1, "dense", d[1]["dense"].astype(np.float64)),
        "day_1_dense.npy", "dense features are float64, expected float32",
    ),
    "dense_columns": (
        lambda r, d: _set(r, 0, "dense", d[0]["dense"][:, :12]),
        "day_0_dense.npy", "shape (20, 12), expected (rows, 13) with data.num_dense=13: set data.num_dense",
    ),
    "sparse_dtype": (
        lambda r, d: _set(r, 1, "sparse", d[1]["sparse"].astype(np.float32)),
        "day_1_sparse.npy", "categorical ids are float32, expected an integer type",
    ),
    "sparse_columns": (
        lambda r, d: _set(r, 1, "sparse", d[1]["sparse"][:, :25]),
        "day_1_sparse.npy", "expected (rows, 26) with data.num_sparse=26",
    ),
    "labels_dtype": (
        lambda r, d: _set(r, 0, "labels", d[0]["labels"].astype(np.float32)),
        "day_0_labels.npy", "labels are float32, expected an integer type",
    ),
    "labels_columns": (
        lambda r, d: _set(r, 0, "labels", np.zeros((20, 2), np.int32)),
        "day_0_labels.npy", "labels have shape (20, 2), expected (rows, 1)",
    ),
    "row_counts": (
        lambda r, d: _set(r, 1, "labels", d[1]["labels"][:-1]),
        "day_1_labels.npy 19", "the files hold different numbers of rows (day_1_dense.npy 20, day_1_sparse.npy 20",
    ),
    "missing_day": (
        lambda r, d: (r / "day_1_sparse.npy").unlink(),
        "has no day_1_sparse.npy (day 1 is in data.train_days)", "leave day 1 out of data.train_days",
    ),
    "not_npy": (
        lambda r, d: (r / "day_0_dense.npy").write_bytes(b"label\tI1\n"),
        "day_0_dense.npy", "not a readable .npy array",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_refused_naming_file_and_fix(tmp_path: Path, case: str) -> None:
    days = write_days(tmp_path, {0: 20, 1: 20, 2: 8})
    breaks, names, message = MALFORMED[case]
    breaks(tmp_path, days)
    error = FileNotFoundError if case == "missing_day" else ValueError
    with pytest.raises(error) as info:
        _ds(_cfg(tmp_path))
    text = str(info.value)
    assert names in text and message in text, text
    if error is ValueError and case not in ("row_counts",):
        assert str(tmp_path / names) in text, text
    assert ("tsv_to_npys" in text) or ("data.train_days" in text), text


def test_missing_eval_day_and_directory(tmp_path: Path) -> None:
    write_days(tmp_path, {0: 20, 1: 20})
    _ds(_cfg(tmp_path))  # the train split alone is there
    with pytest.raises(FileNotFoundError, match=r"has no day_2_dense.npy, day_2_sparse.npy, day_2_labels.npy "
                       r"\(day 2 is in data.eval_day\)"):
        _ds(_cfg(tmp_path), split="eval")
    with pytest.raises(FileNotFoundError, match="data.path=.* is not a directory: set data.path"):
        _ds(_cfg(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": None}, "data.path is required with data.kind='criteo_npy'"),
        ({"train_days": [0, 1], "eval_day": 1}, "data.eval_day=1 is also in data.train_days"),
        ({"train_days": []}, "must be a non-empty list of day numbers"),
        ({"train_days": [0, -1]}, "must be a non-empty list of day numbers"),
        ({"train_days": [3, 3]}, "names a day twice"),
        ({"eval_day": -1}, "data.eval_day=-1 must be a day number"),
    ],
)
def test_invalid_npy_config(kwargs: dict, message: str) -> None:
    fields = {"kind": "criteo_npy", "path": "/data/criteo", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        DataConfig(**fields)


def test_default_days_are_mlperf_split() -> None:
    cfg = DataConfig(kind="criteo_npy", path="/data/criteo")
    assert cfg.train_days == list(range(23)) and cfg.eval_day == 23
    assert DataConfig().train_days is None  # other kinds leave it alone


def test_preset_composes(tmp_path: Path) -> None:
    from tests.unit.test_config import _compose

    data = _compose("data=criteo_npy", f"data.path={tmp_path}").data
    assert isinstance(data, DataConfig) and data.kind == "criteo_npy" and data.path == str(tmp_path)
    assert data.train_days == list(range(23)) and data.eval_day == 23
    days = _compose("data=criteo_npy", f"data.path={tmp_path}", "data.train_days=[0,1]", "data.eval_day=2").data
    assert days.train_days == [0, 1] and days.eval_day == 2


POOLING = [1, 3, 2, 5]


def _multi_hot_cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(
        kind="criteo_npy", path=str(root), train_days=[0, 1], eval_day=2, num_sparse=len(POOLING),
        num_embeddings=ROWS, multi_hot=True, **kw,
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_multi_hot_batches(tmp_path: Path, world_size: int) -> None:
    days = write_days(tmp_path, {0: 14, 1: 19, 2: 8}, num_sparse=len(POOLING), pooling=POOLING)
    assert not (tmp_path / "day_0_sparse.npy").exists()
    cfg = _multi_hot_cfg(tmp_path)
    B = 4
    for rank in range(world_size):
        ds = _ds(cfg, rank=rank, world_size=world_size, batch_size=B)
        assert ds.num_steps() == 33 // (B * world_size)
        for step in range(ds.num_steps()):  # crosses from day 0 into day 1
            batch = ds.batch(step)
            lo = (step * world_size + rank) * B
            kjt = batch.sparse_features
            assert kjt.stride() == B and kjt.values().dtype == torch.int64
            assert kjt.keys() == [f"cat_{f}" for f in range(len(POOLING))]
            for f, p in enumerate(POOLING):
                ids = np.concatenate([days[0]["multi_hot"][f], days[1]["multi_hot"][f]])[lo : lo + B]
                assert torch.equal(kjt[f"cat_{f}"].lengths(), torch.full((B,), p, dtype=torch.int32))
                assert torch.equal(kjt[f"cat_{f}"].values(), torch.from_numpy(ids.reshape(-1) % ROWS))
            dense = np.concatenate([days[0]["dense"], days[1]["dense"]])[lo : lo + B]
            assert torch.equal(batch.dense_features, torch.from_numpy(dense))
            assert batch.labels.dtype == torch.float32 and batch.labels.shape == (B,)


def _save_npz(root: Path, day: int, arrays: list[np.ndarray], compressed: bool = False) -> None:
    save = np.savez_compressed if compressed else np.savez
    save(root / f"day_{day}_sparse_multi_hot.npz", **{str(f): a for f, a in enumerate(arrays)})


MALFORMED_MULTI_HOT = {
    "compressed": (
        lambda r, d: _save_npz(r, 1, d[1]["multi_hot"], compressed=True),
        "array 0 is compressed (np.savez_compressed) and cannot be memory-mapped: write the archive with np.savez",
    ),
    "missing_feature": (
        lambda r, d: _save_npz(r, 1, d[1]["multi_hot"][:3]),
        "has no array(s) 3 of the 4 features",
    ),
    "float_ids": (
        lambda r, d: _save_npz(r, 1, [a.astype(np.float64) for a in d[1]["multi_hot"]]),
        "array 0 is float64 of shape (20, 1), expected integer ids of shape (rows, pooling)",
    ),
    "row_counts": (
        lambda r, d: _save_npz(r, 1, d[1]["multi_hot"][:2] + [d[1]["multi_hot"][2][:-1], d[1]["multi_hot"][3]]),
        "day_1_sparse_multi_hot.npz[2] 19",
    ),
    "not_npz": (
        lambda r, d: (r / "day_1_sparse_multi_hot.npz").write_bytes(b"\x93NUMPY"),
        "not a readable .npz archive",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_MULTI_HOT))
def test_malformed_multi_hot_is_refused(tmp_path: Path, case: str) -> None:
    days = write_days(tmp_path, {0: 20, 1: 20, 2: 8}, num_sparse=len(POOLING), pooling=POOLING)
    breaks, message = MALFORMED_MULTI_HOT[case]
    breaks(tmp_path, days)
    with pytest.raises(ValueError) as info:
        _ds(_multi_hot_cfg(tmp_path))
    assert "day_1_sparse_multi_hot.npz" in str(info.value) and message in str(info.value), str(info.value)


def test_multi_hot_missing_archive_names_the_setting(tmp_path: Path) -> None:
    write_days(tmp_path, {0: 20, 1: 20, 2: 8}, num_sparse=len(POOLING))  # one-hot files only
    with pytest.raises(FileNotFoundError, match="has no day_0_sparse_multi_hot.npz .*day_0_sparse.npy is "
                       "there: set data.multi_hot=false to read it"):
        _ds(_multi_hot_cfg(tmp_path))
    (tmp_path / "day_0_sparse.npy").unlink()
    with pytest.raises(FileNotFoundError, match="leave day 0 out of data.train_days$"):
        _ds(_multi_hot_cfg(tmp_path))
