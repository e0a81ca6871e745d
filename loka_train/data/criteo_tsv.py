"""A reader of Criteo text data (Kaggle Display Advertising / Terabyte click logs).

Each line is `label \\t I1 .. I13 \\t C1 .. C26`: a 0/1 label, integer counts (empty or
negative -> 0, then log1p, as the model input) and hexadecimal category ids (empty -> an
empty bag; id = int(hex, 16) % rows of the feature's table). Parsing is strict, so that no
two spellings of a value can map to the same id unnoticed: a count is `-?[0-9]+` or empty, a
category `[0-9a-fA-F]+` or empty; anything else (signs '+', '0x', spaces, '_') is an error.

The files of a directory (*.tsv, sorted by name) form one stream of lines. Step s uses
lines [s*W*B, (s+1)*W*B) (W ranks, per-rank batch B) and rank r parses its B-line slice, so
a 1-process run with batch W*B sees the concatenation of the W ranks' batches. A trailing
partial global batch is dropped (every rank must agree on the number of steps).

Shape legend:
  B  samples in the batch      D  dense features      F  categorical features
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import NoReturn

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_train.data.config import DataConfig

logger = logging.getLogger(__name__)

_BLOCK_BYTES = 1 << 20

_HEX_DIGITS = b"0123456789abcdefABCDEF"

_Line = tuple[int, int, bytes]
"""(file index, 0-based line number in that file, line content without the line break)."""


def resolve_tsv_files(raw: str | None, key: str) -> list[Path]:
    """The files a path config names: the file itself, or the sorted *.tsv files of a directory.

    Raises:
        FileNotFoundError: naming the config key when nothing readable is there.
    """
    if not raw:
        raise FileNotFoundError(
            f"{key} is not set: set it to a Criteo .tsv file or a directory of *.tsv files"
        )
    path = Path(raw).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{key}={raw!r} does not exist: set {key} to a Criteo .tsv file or a directory "
            "of *.tsv files"
        )
    if path.is_dir():
        files = sorted(p for p in path.glob("*.tsv") if p.is_file())
        if not files:
            raise FileNotFoundError(
                f"{key}={raw!r} is a directory without *.tsv files: put the data there as "
                f"*.tsv or point {key} at the file itself"
            )
        return files
    return [path]


def _check_disjoint(train_files: list[Path], eval_files: list[Path]) -> None:
    """Refuse an eval split that shares a file with the train split (evaluating on training data).

    Files are compared by identity (device and inode), so another spelling of the same path,
    a symlink or a hard link is caught too; shared files are named by their real path (a hard
    link as `eval file = train file`).

    Raises:
        ValueError: naming data.path, data.eval_path and the shared files.
    """

    def identity(path: Path) -> tuple[int, int]:
        st = path.stat()
        return st.st_dev, st.st_ino

    train_real = {identity(p): os.path.realpath(p) for p in train_files}
    found: set[str] = set()
    for path in eval_files:
        same = train_real.get(identity(path))
        if same is not None:
            eval_real = os.path.realpath(path)
            found.add(same if eval_real == same else f"{eval_real} = {same}")
    shared = sorted(found)
    if shared:
        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
        raise ValueError(
            f"data.eval_path and data.path share {len(shared)} file(s) ({', '.join(shared[:3])}"
            f"{more}): the eval split must not overlap the training data; point "
            "data.eval_path at a held-out .tsv file or directory"
        )


def _show(field: bytes) -> str:
    return repr(field.decode("utf-8", errors="replace"))


class _LineIndex:
    """Finds line n of a list of files by counting line breaks, remembering where lines start.

    A mark (line number, byte offset) is kept after each scanned block, so seeking again near
    a place already visited reads little; per-file line counts are learned when a scan hits
    the end of a file. Nothing is scanned until a line is asked for.
    """

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._sizes = [p.stat().st_size for p in files]
        self._num_lines: list[int | None] = [None] * len(files)
        self._mark_lines: list[list[int]] = [[0] for _ in files]
        self._mark_offsets: list[list[int]] = [[0] for _ in files]

    def num_lines(self, file_idx: int) -> int:
        if self._num_lines[file_idx] is None:
            self._offset(file_idx, sys.maxsize)
        n = self._num_lines[file_idx]
        assert n is not None
        return n

    def total_lines(self) -> int:
        return sum(self.num_lines(i) for i in range(len(self.files)))

    def _add_mark(self, file_idx: int, line: int, offset: int) -> None:
        if line > self._mark_lines[file_idx][-1]:
            self._mark_lines[file_idx].append(line)
            self._mark_offsets[file_idx].append(offset)

    def _offset(self, file_idx: int, line: int) -> int | None:
        """Byte offset where `line` of the file starts, or None past its last line."""
        known = self._num_lines[file_idx]
        if known is not None and line >= known:
            return None
        size = self._sizes[file_idx]
        i = bisect.bisect_right(self._mark_lines[file_idx], line) - 1
        line_no, line_off = self._mark_lines[file_idx][i], self._mark_offsets[file_idx][i]
        with open(self.files[file_idx], "rb") as fh:
            fh.seek(line_off)
            pos = line_off
            while line_no < line:
                block = fh.read(_BLOCK_BYTES)
                if not block:
                    break
                num_breaks = block.count(b"\n")
                if line_no + num_breaks < line:
                    if num_breaks:
                        line_no += num_breaks
                        line_off = pos + block.rfind(b"\n") + 1
                        self._add_mark(file_idx, line_no, line_off)
                    pos += len(block)
                    continue
                k = 0
                for _ in range(line - line_no):
                    k = block.find(b"\n", k) + 1
                line_no, line_off = line, pos + k
        if line_no == line and line_off < size:
            return line_off
        # End of file: line_no starts at line_off; it exists only if it holds bytes.
        self._num_lines[file_idx] = line_no + (1 if line_off < size else 0)
        return None

    def locate(self, n: int) -> tuple[int, int, int] | None:
        """Global line n -> (file index, line in file, byte offset), or None past the end."""
        for file_idx in range(len(self.files)):
            offset = self._offset(file_idx, n)
            if offset is not None:
                return file_idx, n, offset
            n -= self.num_lines(file_idx)
        return None

    def iter_lines(self, start: int) -> Iterator[_Line]:
        """Lines from global line `start` to the end of the last file."""
        found = self.locate(start)
        if found is None:
            return
        file_idx, line_no, offset = found
        while file_idx < len(self.files):
            with open(self.files[file_idx], "rb") as fh:
                fh.seek(offset)
                for raw in fh:
                    yield file_idx, line_no, raw.rstrip(b"\r\n")
                    line_no += 1
            file_idx, line_no, offset = file_idx + 1, 0, 0


class CriteoTsvDataset:
    """Rank-sliced DLRM batches from Criteo TSV files; see the module docstring.

    Args:
        cfg: the data config (kind "criteo_tsv"); path is the train split, eval_path the eval one.
        split: "train" (reads cfg.path) or "eval" (reads cfg.eval_path).
        rank: this process's rank in [0, world_size).
        world_size: number of ranks sharing the global batch.
        batch_size: lines per rank per step.

    Raises:
        FileNotFoundError: when the split's path (named by its config key) does not exist.
        ValueError: for the eval split, when data.eval_path shares a file with data.path.

    Example:
        >>> cfg = DataConfig(kind="criteo_tsv", path="train.tsv", num_embeddings=1_000_000)
        >>> ds = CriteoTsvDataset(cfg, split="train", rank=1, world_size=2, batch_size=512)
        >>> for batch in ds.batches(start_step=100):  # resumes at line 100*2*512 + 512
        ...     pass
    """

    def __init__(
        self, cfg: DataConfig, *, split: str, rank: int, world_size: int, batch_size: int
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} must be 'train' or 'eval'")
        self.key = "data.path" if split == "train" else "data.eval_path"
        self.files = resolve_tsv_files(cfg.path if split == "train" else cfg.eval_path, self.key)
        if split == "eval":
            _check_disjoint(resolve_tsv_files(cfg.path, "data.path"), self.files)
        self.cfg = cfg
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.feature_names = [f"cat_{f}" for f in range(cfg.num_sparse)]
        self.num_embeddings_per_feature = cfg.rows_per_feature
        self.num_dense = cfg.num_dense
        self._index = _LineIndex(self.files)

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.batch_size

    def num_steps(self) -> int:
        """Full global batches in the data (scans every file once to count lines)."""
        return self._index.total_lines() // self.global_batch_size

    def batch(self, step: int) -> Batch:
        """The local batch of `step` (this rank's B lines of global lines [step*W*B, (step+1)*W*B)).

        Raises:
            IndexError: when the data holds no full global batch for `step`.
            ValueError: on a malformed line (with file:line and what is wrong).
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        first = step * self.global_batch_size
        if self._index.locate(first + self.global_batch_size - 1) is None:
            total = self._index.total_lines()
            raise IndexError(
                f"step {step} is past the end of {self.key} ({total} lines = "
                f"{total // self.global_batch_size} full global batches of {self.global_batch_size})"
            )
        lines = list(
            islice(self._index.iter_lines(first + self.rank * self.batch_size), self.batch_size)
        )
        return self._parse(lines)

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Local batches from start_step on (reading sequentially); stops at the end of the data
        or after num_steps batches. A trailing partial global batch is dropped (and logged)."""
        if start_step < 0 or (num_steps is not None and num_steps < 0):
            raise ValueError(f"start_step={start_step} and num_steps={num_steps} must be >= 0")
        G, B, r = self.global_batch_size, self.batch_size, self.rank
        lines_it = self._index.iter_lines(start_step * G)
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            lines = list(islice(lines_it, G))
            if len(lines) < G:
                if lines:
                    logger.info(
                        "%s: end of data at step %d; dropping the last %d lines (a partial "
                        "global batch of %d)",
                        self.key,
                        step,
                        len(lines),
                        G,
                    )
                return
            yield self._parse(lines[r * B : (r + 1) * B])
            step += 1

    def _where(self, line: _Line) -> str:
        return f"{self.files[line[0]]}:{line[1] + 1}"

    def _dense_value(self, line: _Line, j: int, text: bytes) -> int:
        """Dense field I{j+1}: empty or negative -> 0, else its value; strictly `-?[0-9]+`."""
        if not text:
            return 0
        if text.isdigit():
            return int(text)
        if text[:1] == b"-" and text[1:].isdigit():
            return 0
        raise ValueError(
            f"{self._where(line)}: dense field I{j + 1} = {_show(text)} is not an integer: "
            "expected an optional '-' then the digits 0-9 only (no sign '+', spaces, '_' or "
            "decimal point), or an empty field"
        )

    def _raise_bad_category(self, line: _Line, cat_fields: list[bytes]) -> NoReturn:
        for f, text in enumerate(cat_fields):
            if text.translate(None, _HEX_DIGITS):
                raise ValueError(
                    f"{self._where(line)}: categorical field C{f + 1} = {_show(text)} is not "
                    "hexadecimal: expected the characters 0-9a-fA-F only (no sign, '0x' prefix, "
                    "spaces or '_'), or an empty field"
                )
        raise AssertionError(f"{self._where(line)}: no bad categorical field found")

    def _parse(self, lines: list[_Line]) -> Batch:
        D, F = self.num_dense, len(self.feature_names)
        rows = self.num_embeddings_per_feature
        num_fields = 1 + D + F
        labels: list[int] = []
        dense: list[list[int]] = []
        ids_F: list[list[int]] = [[] for _ in range(F)]
        lengths_F: list[list[int]] = [[] for _ in range(F)]
        for line in lines:
            fields = line[2].split(b"\t")
            if len(fields) != num_fields:
                raise ValueError(
                    f"{self._where(line)}: expected {num_fields} tab-separated fields (label, "
                    f"{D} integers, {F} hex categories), found {len(fields)}; check "
                    "data.num_dense / data.num_sparse or the file"
                )
            if fields[0] not in (b"0", b"1"):
                raise ValueError(f"{self._where(line)}: label {_show(fields[0])} is not 0 or 1")
            labels.append(fields[0] == b"1")
            dense_fields = fields[1 : 1 + D]
            # Fast path: only digits and empty fields (join is "" when all are empty, and
            # isdigit() is then False). Anything else is checked field by field.
            if b"".join(dense_fields).isdigit():
                dense.append([int(text) if text else 0 for text in dense_fields])
            else:
                dense.append([self._dense_value(line, j, t) for j, t in enumerate(dense_fields)])
            cat_fields = fields[1 + D :]
            # One check per line: what is left after deleting hex digits must be nothing.
            if b"".join(cat_fields).translate(None, _HEX_DIGITS):
                self._raise_bad_category(line, cat_fields)
            for f, text in enumerate(cat_fields):
                if text:
                    ids_F[f].append(int(text, 16) % rows[f])
                    lengths_F[f].append(1)
                else:
                    lengths_F[f].append(0)
        dense_BD = torch.log1p(torch.tensor(dense, dtype=torch.float64).reshape(-1, D)).float()
        kjt = KeyedJaggedTensor(
            keys=self.feature_names,
            values=torch.tensor([i for ids in ids_F for i in ids], dtype=torch.long),
            lengths=torch.tensor([n for lens in lengths_F for n in lens], dtype=torch.int32),
        )
        labels_B = torch.tensor(labels, dtype=torch.float32)
        return Batch(dense_features=dense_BD, sparse_features=kjt, labels=labels_B)
