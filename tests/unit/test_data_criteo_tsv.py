"""Criteo TSV reader: parsing (missing values), rank slicing, resume, the end of data, errors.

The fixture files are generated into tmp_path by the tests. Shape legend: B batch, D dense.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch
from torchrec.datasets.utils import Batch

from loka_train.data import DataConfig, make_dataset
from loka_train.data import criteo_tsv as criteo_tsv_module

NUM_DENSE, NUM_SPARSE, ROWS = 13, 26, 1000


def _random_line(rng: random.Random) -> str:
    label = str(rng.randint(0, 1))
    dense = []
    for _ in range(NUM_DENSE):
        r = rng.random()
        dense.append(
            ""
            if r < 0.2
            else str(rng.randint(-3, -1))
            if r < 0.25
            else str(int(rng.paretovariate(1.0)))
        )
    cats = ["" if rng.random() < 0.15 else f"{rng.getrandbits(32):08x}" for _ in range(NUM_SPARSE)]
    return "\t".join([label, *dense, *cats])


def _write_fixture(
    directory: Path, sizes: tuple[int, ...] = (150, 100), seed: int = 0
) -> list[str]:
    """Files part_0.tsv, part_1.tsv, ... with the given line counts; the last one has no final
    line break. Returns all lines in stream order."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    all_lines: list[str] = []
    for i, n in enumerate(sizes):
        lines = [_random_line(rng) for _ in range(n)]
        tail = "" if i == len(sizes) - 1 else "\n"
        (directory / f"part_{i}.tsv").write_text("\n".join(lines) + tail)
        all_lines += lines
    return all_lines


def _expected(
    lines: list[str],
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[list[int]]]:
    """Reference parse, written independently of the reader: dense_BD, labels_B, ids and lengths per feature."""
    dense, labels = [], []
    ids: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    lengths: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    for line in lines:
        fields = line.split("\t")
        labels.append(float(fields[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]])
        for f, c in enumerate(fields[1 + NUM_DENSE :]):
            lengths[f].append(1 if c else 0)
            if c:
                ids[f].append(int(c, 16) % ROWS)
    return torch.tensor(dense, dtype=torch.float32), torch.tensor(labels), ids, lengths


def _assert_matches(batch: Batch, lines: list[str]) -> None:
    dense_BD, labels_B, ids, lengths = _expected(lines)
    torch.testing.assert_close(batch.dense_features, dense_BD)
    assert torch.equal(batch.labels, labels_B)
    kjt = batch.sparse_features.to_dict()
    for f in range(NUM_SPARSE):
        jt = kjt[f"cat_{f}"]
        assert jt.lengths().tolist() == lengths[f]
        assert jt.values().tolist() == ids[f]


def _cfg(path: Path, eval_path: Path | None = None) -> DataConfig:
    return DataConfig(
        kind="criteo_tsv",
        path=str(path),
        eval_path=str(eval_path) if eval_path else None,
        num_embeddings=ROWS,
    )


def _ds(
    cfg: DataConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 16,
    split: str = "train",
):
    return make_dataset(cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size)


def test_parses_missing_and_negative_values(tmp_path: Path) -> None:
    dense_a = ["1", "", "-2", "30", "", "0", "5", "", "", "7", "", "", "123456789"]
    dense_b = [""] * NUM_DENSE
    cats_a = ["68fd1e64"] + [""] * 24 + ["ffffffff"]
    cats_b = [""] * NUM_SPARSE
    line_a = "\t".join(["1", *dense_a, *cats_a])
    line_b = "\t".join(["0", *dense_b, *cats_b])
    (tmp_path / "day.tsv").write_text(line_a + "\n" + line_b + "\n")
    batch = _ds(_cfg(tmp_path / "day.tsv"), batch_size=2).batch(0)
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (2, 13)
    want_a = [math.log1p(v) for v in (1, 0, 0, 30, 0, 0, 5, 0, 0, 7, 0, 0, 123456789)]
    torch.testing.assert_close(batch.dense_features[0], torch.tensor(want_a, dtype=torch.float32))
    assert batch.dense_features[1].abs().sum() == 0
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{f}" for f in range(NUM_SPARSE)]
    assert kjt.lengths().dtype == torch.int32 and kjt.values().dtype == torch.int64
    d = kjt.to_dict()
    assert d["cat_0"].lengths().tolist() == [1, 0]
    assert d["cat_0"].values().tolist() == [0x68FD1E64 % ROWS]
    assert d["cat_25"].values().tolist() == [0xFFFFFFFF % ROWS]
    for f in range(1, 25):
        assert d[f"cat_{f}"].lengths().tolist() == [0, 0]
    assert kjt.values().numel() == 2


def test_per_feature_rows_and_crlf(tmp_path: Path) -> None:
    rows = list(range(2, 2 + NUM_SPARSE))
    cats = [f"{0xABCDEF + f:x}" for f in range(NUM_SPARSE)]
    line = "\t".join(["1", *(["3"] * NUM_DENSE), *cats])
    (tmp_path / "d.tsv").write_bytes((line + "\r\n").encode() * 2)
    cfg = DataConfig(
        kind="criteo_tsv", path=str(tmp_path / "d.tsv"), num_embeddings_per_feature=rows
    )
    batch = _ds(cfg, batch_size=2).batch(0)
    d = batch.sparse_features.to_dict()
    for f in range(NUM_SPARSE):
        assert d[f"cat_{f}"].values().tolist() == [(0xABCDEF + f) % rows[f]] * 2
    torch.testing.assert_close(batch.dense_features, torch.full((2, 13), math.log1p(3)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_concatenate_to_the_single_process_batch(tmp_path: Path, world_size: int) -> None:
    lines = _write_fixture(tmp_path / "train")
    cfg = _cfg(tmp_path / "train")
    B = 8
    G = world_size * B
    single = _ds(cfg, batch_size=G)
    ranks = [_ds(cfg, rank=r, world_size=world_size, batch_size=B) for r in range(world_size)]
    num_steps = len(lines) // G
    single_batches = list(single.batches())
    rank_batches = [list(ds.batches()) for ds in ranks]
    assert len(single_batches) == num_steps and all(len(rb) == num_steps for rb in rank_batches)
    for step in range(num_steps):
        _assert_matches(single_batches[step], lines[step * G : (step + 1) * G])
        for r in range(world_size):
            _assert_matches(rank_batches[r][step], lines[step * G + r * B : step * G + (r + 1) * B])
            # Random access agrees with the sequential stream.
            random_access = ranks[r].batch(step)
            assert torch.equal(random_access.dense_features, rank_batches[r][step].dense_features)
            assert torch.equal(
                random_access.sparse_features.values(),
                rank_batches[r][step].sparse_features.values(),
            )


def test_batches_cross_file_boundaries(tmp_path: Path) -> None:
    lines = _write_fixture(tmp_path / "train", sizes=(10, 7, 12))
    ds = _ds(
        _cfg(tmp_path / "train"), batch_size=6
    )  # step 1 spans part_0/part_1, step 2 part_1/part_2
    got = list(ds.batches())
    assert len(got) == len(lines) // 6 == 4
    for step, batch in enumerate(got):
        _assert_matches(batch, lines[step * 6 : (step + 1) * 6])


def test_resume_and_end_of_data(tmp_path: Path) -> None:
    lines = _write_fixture(tmp_path / "train")  # 250 lines, global batch 32 -> 7 steps
    ds = _ds(_cfg(tmp_path / "train"), rank=1, world_size=2, batch_size=16)
    full = list(ds.batches())
    assert len(full) == 7 == ds.num_steps()
    resumed = list(ds.batches(start_step=4))
    assert len(resumed) == 3
    for a, b in zip(resumed, full[4:]):
        assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
    assert len(list(ds.batches(start_step=2, num_steps=2))) == 2
    assert list(ds.batches(start_step=7)) == []
    assert list(ds.batches(start_step=1000)) == []
    _assert_matches(ds.batch(6), lines[6 * 32 + 16 : 7 * 32])
    # Step 7 would need lines [224, 256) but only 250 exist: the partial global batch is dropped.
    with pytest.raises(IndexError, match="past the end of data.path"):
        ds.batch(7)
    with pytest.raises(IndexError):
        _ds(_cfg(tmp_path / "train"), rank=0, world_size=2, batch_size=16).batch(7)


def test_line_index_random_access_with_tiny_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seek logic at block boundaries: every line found by random access equals the file's line."""
    monkeypatch.setattr(criteo_tsv_module, "_BLOCK_BYTES", 37)
    files = []
    for i, text in enumerate(["a\nbb\n\nccc\nd", "e\n", "", "ffff\ng\n"]):
        path = tmp_path / f"{i}.tsv"
        path.write_text(text)
        files.append(path)
    want = ["a", "bb", "", "ccc", "d", "e", "ffff", "g"]
    index = criteo_tsv_module._LineIndex(files)
    for n in [7, 0, 3, 5, 4, 1, 6, 2]:
        got = list(index.iter_lines(n))
        assert [line[2].decode() for line in got] == want[n:]
    assert index.locate(8) is None
    assert index.total_lines() == 8
    assert index.locate(6)[:2] == (3, 0)


def test_eval_split_reads_eval_path(tmp_path: Path) -> None:
    _write_fixture(tmp_path / "train", seed=0)
    eval_lines = _write_fixture(tmp_path / "eval", sizes=(40,), seed=1)
    cfg = _cfg(tmp_path / "train", eval_path=tmp_path / "eval" / "part_0.tsv")
    ev = _ds(cfg, split="eval", batch_size=20)
    _assert_matches(ev.batch(1), eval_lines[20:40])
    with pytest.raises(ValueError, match="data.eval_path"):
        _ds(_cfg(tmp_path / "train"), split="eval")
    with pytest.raises(FileNotFoundError, match="data.eval_path"):
        _ds(_cfg(tmp_path / "train", eval_path=tmp_path / "nope.tsv"), split="eval")


def test_missing_path_names_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.path.*does not exist.*set data.path"):
        _ds(_cfg(tmp_path / "missing.tsv"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="data.path.*without \\*.tsv"):
        _ds(_cfg(tmp_path / "empty_dir"))


@pytest.mark.parametrize(
    ("bad_fields", "message"),
    [
        (lambda f: f[:-1], "expected 40 tab-separated fields.*found 39"),
        (lambda f: ["2", *f[1:]], "label b?'2' is not 0 or 1"),
        (lambda f: [f[0], "1.5", *f[2:]], "dense field I1 = b?'1.5' is not an integer"),
        (lambda f: [*f[:14], "xyz", *f[15:]], "categorical field C1 = b?'xyz' is not hexadecimal"),
    ],
)
def test_malformed_line_reports_file_and_line(tmp_path: Path, bad_fields, message: str) -> None:
    rng = random.Random(3)
    lines = [_random_line(rng) for _ in range(6)]
    lines[4] = "\t".join(bad_fields(lines[4].split("\t")))
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    ds = _ds(_cfg(path), batch_size=3)
    ds.batch(0)  # lines 1-3 are fine
    with pytest.raises(ValueError, match=f"bad.tsv:5: {message}"):
        ds.batch(1)
    with pytest.raises(ValueError, match="bad.tsv:5"):
        list(ds.batches())


def _overlapping_eval_paths(tmp_path: Path) -> list[tuple[str, Path]]:
    """(what, eval_path) pairs that each reach train/part_0.tsv by another route."""
    train_file = tmp_path / "train" / "part_0.tsv"
    (tmp_path / "link.tsv").symlink_to(train_file)
    (tmp_path / "mixed").mkdir()
    _write_fixture(tmp_path / "mixed", sizes=(40,), seed=2)  # mixed/part_0.tsv is held out
    (tmp_path / "mixed" / "part_1.tsv").hardlink_to(train_file)
    return [
        ("the same file", train_file),
        ("another spelling", tmp_path / "train" / ".." / "train" / "part_0.tsv"),
        ("the train directory", tmp_path / "train"),
        ("a symlink", tmp_path / "link.tsv"),
        ("a directory with a hard link among held-out files", tmp_path / "mixed"),
    ]


def test_eval_path_overlapping_data_path_is_refused(tmp_path: Path) -> None:
    _write_fixture(tmp_path / "train", sizes=(40, 40))
    for what, eval_path in _overlapping_eval_paths(tmp_path):
        for path in (tmp_path / "train", tmp_path / "train" / "part_0.tsv"):
            cfg = _cfg(path, eval_path=eval_path)
            _ds(cfg)  # the train split alone is fine
            with pytest.raises(ValueError, match="data.eval_path and data.path share") as info:
                _ds(cfg, split="eval")
            assert str((tmp_path / "train" / "part_0.tsv").resolve()) in str(info.value), what
    # Held-out files next to the train data are accepted.
    _write_fixture(tmp_path / "held_out", sizes=(40,), seed=3)
    _ds(_cfg(tmp_path / "train", eval_path=tmp_path / "held_out"), split="eval").batch(0)


@pytest.mark.parametrize(
    ("column", "text", "message"),
    [
        *[
            (3, t, f"dense field I3 = '{re.escape(t)}' is not an integer: expected an optional '-'")
            for t in (" 5", "5 ", "+7", "1_000", "-", "--1", "1-2", "0x10", "\u0663")
        ],
        *[
            (15, t, f"categorical field C2 = '{re.escape(t)}' is not hexadecimal: expected the "
             "characters 0-9a-fA-F only")
            for t in ("-1f", "+1f", "0x1f", "0X1F", "1_f", " 1f", "1f ", "1g", "\u0663")
        ],
    ],
)
def test_lenient_spellings_are_refused(tmp_path: Path, column: int, text: str, message: str) -> None:
    """int() would accept most of these, several as the same value/id as a plain spelling."""
    rng = random.Random(4)
    lines = [_random_line(rng) for _ in range(4)]
    fields = lines[2].split("\t")
    fields[column] = text
    lines[2] = "\t".join(fields)
    path = tmp_path / "lenient.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = _ds(_cfg(path), batch_size=4)
    with pytest.raises(ValueError, match=f"lenient.tsv:3: {message}"):
        ds.batch(0)


def test_strict_parsing_keeps_the_valid_spellings(tmp_path: Path) -> None:
    dense = ["-0", "0007", "-12", "", "0", *(["1"] * (NUM_DENSE - 5))]
    cats = ["AbC", "00ff", "FFFFFFFFFFFFFFFFFFFF", *([""] * (NUM_SPARSE - 3))]
    (tmp_path / "ok.tsv").write_text("\t".join(["1", *dense, *cats]) + "\n")
    batch = _ds(_cfg(tmp_path / "ok.tsv"), batch_size=1).batch(0)
    want = [0.0, math.log1p(7), 0.0, 0.0, 0.0, *([math.log1p(1)] * (NUM_DENSE - 5))]
    torch.testing.assert_close(batch.dense_features[0], torch.tensor(want))
    d = batch.sparse_features.to_dict()
    assert [d[f"cat_{f}"].values().tolist() for f in range(3)] == [
        [0xABC % ROWS], [0xFF % ROWS], [0xFFFFFFFFFFFFFFFFFFFF % ROWS]
    ]
