"""Data configuration (the `data:` group of the hydra config)."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("synthetic", "criteo_tsv", "criteo_npy")


@dataclass(kw_only=True)
class DataConfig:
    """Where training and evaluation batches come from.

    Example:
        >>> DataConfig(kind="synthetic", num_embeddings=100_000, seed=1)
        >>> DataConfig(kind="criteo_tsv", path="/data/criteo/train", eval_path="/data/criteo/day_23.tsv")
        >>> DataConfig(kind="criteo_npy", path="/data/criteo/npy", train_days=[0, 1], eval_day=23)
    """

    kind: str = "synthetic"
    """"synthetic" (Criteo-like samples labelled by a hidden fixed teacher model),
    "criteo_tsv" (Criteo Terabyte / Kaggle text lines: label, 13 ints, 26 hex categories) or
    "criteo_npy" (the preprocessed Criteo 1TB day files of TorchRec and the MLPerf DLRM-DCN
    reference: day_{i}_dense.npy, day_{i}_sparse.npy, day_{i}_labels.npy)."""

    path: str | None = None
    """criteo_tsv: the training split, a .tsv file or a directory whose *.tsv files are read
    in sorted name order as one concatenated stream. criteo_npy: the directory that holds the
    day_{i}_{dense,sparse,labels}.npy files of every day in train_days and of eval_day.
    Unused by synthetic."""

    train_days: list[int] | None = None
    """criteo_npy: the days read, in this order, as one training stream (MLPerf trains on
    days 0-22); None means days 0-22. Unused by the other kinds."""

    eval_day: int = 23
    """criteo_npy: the held-out day evaluated on (MLPerf holds out day 23); it must not be one of
    train_days. Unused by the other kinds."""

    multi_hot: bool = False
    """criteo_npy: read each day's categorical ids from day_{i}_sparse_multi_hot.npz (the MLPerf
    DLRM-DCN v2 multi-hot data: arrays "0" .. "{num_sparse-1}", one N x pooling array per
    feature) instead of day_{i}_sparse.npy. Unused by the other kinds."""

    eval_path: str | None = None
    """criteo_tsv: the held-out split (file or directory, like path); required to evaluate
    with criteo_tsv. Unused by synthetic (its eval split is a separate seed-derived stream)."""

    num_dense: int = 13
    """Dense (integer-count) features per sample; 13 for Criteo."""

    num_sparse: int = 26
    """Categorical features per sample (named cat_0 .. cat_{num_sparse-1}); 26 for Criteo."""

    num_embeddings: int = 10_000
    """Rows of every embedding table; criteo_tsv and criteo_npy hash each id modulo this."""

    num_embeddings_per_feature: list[int] | None = None
    """Rows per table, one entry per categorical feature; overrides num_embeddings when set."""

    seed: int = 0
    """Seed of the synthetic data: the feature schema, the hidden teacher (identical on every
    rank) and the train/eval sample streams. Unused by the Criteo readers."""

    chunk_size: int = 64
    """Synthetic: the unit of the determinism contract; it must divide the per-rank batch size.
    Every sample is a pure function of (seed, split, global sample index), so chunk c (samples
    [c*chunk_size, (c+1)*chunk_size)) depends only on (seed, split, c)."""

    zipf_exponent: float = 1.2
    """Synthetic: exponent s of the Zipf law of the categorical ids (P(rank k) ~ k^-s); larger
    is more skewed (hot ids take a bigger share)."""

    max_pooling: int = 8
    """Synthetic: the longest bag (ids per sample per feature). Features are one-hot, one-hot
    or empty, or multi-hot with lengths up to max_pooling (1 makes every feature one-hot)."""

    teacher_scale: float = 1.0
    """Synthetic: multiplier of the hidden teacher's signal (0 makes labels independent of the
    features; the bias is re-calibrated so the click rate stays about 25%)."""

    cache_batches: int = 0
    """Synthetic, for benchmarks: when > 0, only the first ``cache_batches`` train batches are
    generated (once, then kept in memory) and step s trains on batch ``s % cache_batches``.
    This takes the CPU input pipeline out of GPU step timings; eval batches are unaffected.
    0 (default) generates a fresh batch every step."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"data.kind={self.kind!r} is unknown: use one of {KINDS}")
        if self.kind == "criteo_tsv" and not self.path:
            raise ValueError(
                "data.path is required with data.kind='criteo_tsv': set it to a .tsv file "
                "or a directory of *.tsv files"
            )
        if self.kind == "criteo_npy":
            self._check_npy_days()
        for name in ("num_dense", "num_sparse", "num_embeddings", "chunk_size", "max_pooling"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r} must be a positive integer")
        if self.num_embeddings_per_feature is not None:
            rows = list(self.num_embeddings_per_feature)
            if len(rows) != self.num_sparse:
                raise ValueError(
                    f"data.num_embeddings_per_feature has {len(rows)} entries but "
                    f"data.num_sparse={self.num_sparse}: give one row count per feature "
                    "or leave it unset to use data.num_embeddings"
                )
            bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int) or r < 1]
            if bad:
                raise ValueError(
                    f"data.num_embeddings_per_feature has invalid entries {bad}: "
                    "every entry must be a positive integer"
                )
            self.num_embeddings_per_feature = rows
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not (0 <= self.seed < 2**63)
        ):
            raise ValueError(f"data.seed={self.seed!r} must be an integer in [0, 2**63)")
        if not self.zipf_exponent > 0:
            raise ValueError(
                f"data.zipf_exponent={self.zipf_exponent!r} must be > 0 (1.2 is Criteo-like)"
            )
        if isinstance(self.cache_batches, bool) or not isinstance(self.cache_batches, int) or self.cache_batches < 0:
            raise ValueError(
                f"data.cache_batches={self.cache_batches!r} must be an integer >= 0 (0 = no cache)"
            )
        if not self.teacher_scale >= 0:
            raise ValueError(
                f"data.teacher_scale={self.teacher_scale!r} must be >= 0 (0 = labels carry no "
                "signal, 1 = default strength)"
            )

    def _check_npy_days(self) -> None:
        if not self.path:
            raise ValueError(
                "data.path is required with data.kind='criteo_npy': set it to the directory of "
                "the day_{i}_dense.npy / day_{i}_sparse.npy / day_{i}_labels.npy files"
            )
        days = list(range(23)) if self.train_days is None else list(self.train_days)
        bad = [d for d in days if isinstance(d, bool) or not isinstance(d, int) or d < 0]
        if not days or bad:
            raise ValueError(
                f"data.train_days={self.train_days!r} must be a non-empty list of day numbers "
                "(integers >= 0), e.g. data.train_days=[0,1,2]; leave it unset for days 0-22"
            )
        if len(set(days)) != len(days):
            raise ValueError(
                f"data.train_days={days} names a day twice: list each training day once"
            )
        if isinstance(self.eval_day, bool) or not isinstance(self.eval_day, int) or self.eval_day < 0:
            raise ValueError(f"data.eval_day={self.eval_day!r} must be a day number (integer >= 0)")
        if self.eval_day in days:
            raise ValueError(
                f"data.eval_day={self.eval_day} is also in data.train_days: evaluate on a held-out "
                "day (remove it from data.train_days or pick another data.eval_day)"
            )
        self.train_days = days

    @property
    def rows_per_feature(self) -> list[int]:
        """Table rows per categorical feature (num_embeddings_per_feature or num_embeddings)."""
        if self.num_embeddings_per_feature is not None:
            return list(self.num_embeddings_per_feature)
        return [self.num_embeddings] * self.num_sparse
