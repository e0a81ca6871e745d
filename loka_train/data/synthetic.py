"""Synthetic Criteo-like data labelled by a hidden, fixed teacher model.

Every sample is a pure function of (seed, split, global sample index): its random numbers
come from a counter-based integer hash of that triple, not from a stateful generator. So
any chunk of samples depends only on (seed, split, chunk index), generation is vectorized
over the whole batch, and rank r at step s (per-rank batch B, W ranks) simply takes the
global samples [(s*W + r)*B, (s*W + r + 1)*B).

What a sample looks like:
- dense: heavy-tailed integer counts (a Pareto law per feature, with a share of zeros, like
  Criteo's I1..I13), given to the model as log1p(count);
- sparse: per feature a bag of ids; features cycle through three pooling patterns (f % 3:
  always one id; one id or empty; multi-hot with 1..max_pooling ids or empty). Ids follow a
  Zipf law over ranks, and rank -> id is a fixed affine permutation of the table, so hot
  ids are spread over the table (and over row-wise shards);
- label: Bernoulli(sigmoid(teacher logit)). The teacher is fixed by the seed alone (same on
  every rank and both splits): a per-feature per-id scalar weight summed over the bag, a
  rank-K pairwise interaction of P features, a linear term on the standardized log1p dense
  features, and a bias calibrated to a click rate of about 25%.

Shape legend:
  B  samples in the batch             D  dense features
  F  categorical features             N  ids in the batch (all bags, feature-major)
  L  max_pooling (id slots per bag)   R  teacher table rows (features concatenated)
  P  features of the teacher's pairwise interaction, K  rank of that interaction
  M  points of a quantile grid
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_train.data.config import DataConfig
from loka_train.data.pinning import batch_bytes

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
# Tags that keep the hash streams of different purposes apart.
_SPLIT_TAGS = {"train": 0x7261696E, "eval": 0x6576616C, "calib": 0x63616C69}
_TAG_DENSE, _TAG_LENGTH, _TAG_ID, _TAG_LABEL = 0x44454E53, 0x4C454E47, 0x49445321, 0x4C41424C
_TAG_SCHEMA, _TAG_TEACHER = 0x53434845, 0x54454143

TARGET_CTR = 0.25
"""Click rate the teacher's bias is calibrated to (on a seed-derived calibration stream)."""
_TEACHER_MAX_ROWS = 1 << 17
"""Teacher tables hold min(rows, this) entries per feature (ids are folded modulo it), so a
10M-row table does not need a 10M-entry teacher."""
_NUM_INTERACTING = 4
_INTERACTION_RANK = 4
# Teacher term strengths at teacher_scale = 1, tuned on eval NE (4096 held-out samples, seeds
# 0 / 1 / 2): the teacher itself (Bayes-optimal) 0.54 / 0.57 / 0.60; torchrec's DLRM (dim 16,
# MLPs 64-16 and 64-32-1, Adagrad 0.05, batch 256) 0.77 / 0.80 / 0.80 after 300 steps (0.83 /
# 0.85 / 0.86 after 100); a hashed one-hot logistic regression 0.77 / - / 0.79 after 300 steps.
_SIGMA_ID = 0.6
_SIGMA_INTERACTION = 0.35
_SIGMA_DENSE = 0.7
_CALIBRATION_SAMPLES = 8192
_QUANTILE_POINTS = 4096


def _mul32(x, c: int):
    """x * c mod 2**32 for x in [0, 2**32), without int64 overflow (c split in 16-bit halves).

    Works on Python ints and int64 tensors alike, with identical results.
    """
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """lowbias32 (C. Wellons): a bijective 32-bit hash with full avalanche, on ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _key(*parts: int) -> int:
    """A 32-bit key from any number of non-negative integers (each folded in 32 bits at a time)."""
    h = 0x9E3779B9
    for part in parts:
        h = _mix32(h ^ (part & _M32))
        h = _mix32(h ^ ((part >> 32) & _M32))
    return h


def _uniform(h_X: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float64 uniforms strictly inside (0, 1) (24 bits of the hash, exact)."""
    return ((h_X >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))


def _take(table_X: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """table_X[index_N] for 1-D tensors."""
    return torch.gather(table_X, 0, index_N)


def _generator(seed: int, tag: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((_key(seed, tag) | (_key(seed, tag, 1) << 32)) & (2**63 - 1))
    return g


class SyntheticDataset:
    """Criteo-like batches with labels from a hidden teacher; see the module docstring.

    Args:
        cfg: the data config (kind "synthetic").
        split: "train" or "eval" (a different sample stream, the same teacher).
        rank: this process's rank in [0, world_size).
        world_size: number of ranks sharing the global batch.
        batch_size: samples per rank per step; a multiple of cfg.chunk_size.

    Example:
        >>> ds = SyntheticDataset(DataConfig(), split="train", rank=0, world_size=2, batch_size=256)
        >>> b = ds.batch(3)  # global samples [(3*2 + 0)*256, (3*2 + 1)*256)
        >>> b.dense_features.shape, b.sparse_features.keys()[:2], b.labels.mean()
    """

    def __init__(
        self, cfg: DataConfig, *, split: str, rank: int, world_size: int, batch_size: int
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} must be 'train' or 'eval'")
        if batch_size % cfg.chunk_size:
            raise ValueError(
                f"data.chunk_size={cfg.chunk_size} does not divide the per-rank batch size "
                f"{batch_size}: set data.chunk_size to a divisor of it (e.g. "
                f"{math.gcd(cfg.chunk_size, batch_size)})"
            )
        self.cfg = cfg
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.feature_names = [f"cat_{f}" for f in range(cfg.num_sparse)]
        self.num_embeddings_per_feature = cfg.rows_per_feature
        self.num_dense = cfg.num_dense
        self._build_schema()
        self._build_teacher()
        self._bias = 0.0
        self._bias = self._calibrate_bias()
        self._cache: dict[int, Batch] = {}
        logger.debug(
            "synthetic %s data: seed=%d teacher bias %.3f (target CTR %.2f)",
            split,
            cfg.seed,
            self._bias,
            TARGET_CTR,
        )

    # ---------------------------------------------------------------- public API
    def batch(self, step: int) -> Batch:
        """The local batch of `step` (global samples [(step*W + rank)*B, (step*W + rank + 1)*B)).

        With ``cfg.cache_batches = K > 0`` (train split) it is the batch of step ``step % K``,
        generated once and then served from memory.
        """
        k = self.cfg.cache_batches
        if k and self.split == "train":
            self._start(step)  # raises on a negative step
            step %= k
            cached = self._cache.get(step)
            if cached is None:
                cached = self._cache[step] = self._batch_uncached(step)
            return cached
        return self._batch_uncached(step)

    def pin_cache(self, pin: Callable[[Batch], Batch]) -> tuple[int, int]:
        """Replace every batch already in the cache (``cfg.cache_batches``) by ``pin(batch)``,
        its page-locked copy; returns (batches pinned, their bytes).

        The trainer calls it before the first step when it pins its batches
        (``trainer.pin_memory``). Pinning a batch the first time allocates page-locked memory,
        a driver call that stalls the step's own launches while it runs: on an H100 at batch
        32768, steps took 16-24 ms instead of 14 until about 1 GiB of copies were held. The
        kept batches move to page-locked memory (their pageable originals are dropped, so the
        host holds about as much as before). Batches generated later are still pinned by the
        step loop as they come.
        """
        total = 0
        for step, batch in self._cache.items():
            pinned = pin(batch)
            self._cache[step] = pinned
            total += batch_bytes(pinned)
        return len(self._cache), total

    def _batch_uncached(self, step: int) -> Batch:
        dense_BD, lengths_FB, ids_N, labels_B, _ = self._generate(
            self._start(step), self.batch_size
        )
        return self._to_batch(dense_BD, lengths_FB, ids_N, labels_B)

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Local batches of steps start_step, start_step+1, ...; endless when num_steps is None."""
        if start_step < 0 or (num_steps is not None and num_steps < 0):
            raise ValueError(f"start_step={start_step} and num_steps={num_steps} must be >= 0")
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch(step)
            step += 1

    def teacher_logits(self, step: int) -> torch.Tensor:
        """The hidden teacher's logits for the samples of batch(step) (float64, (B,)).

        The normalized entropy of these logits is the best any model can reach on this data.
        """
        return self._generate(self._start(step), self.batch_size)[4]

    # ---------------------------------------------------------------- internals
    def _start(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        return (step * self.world_size + self.rank) * self.batch_size

    def _to_batch(
        self,
        dense_BD: torch.Tensor,
        lengths_FB: torch.Tensor,
        ids_N: torch.Tensor,
        labels_B: torch.Tensor,
    ) -> Batch:
        kjt = KeyedJaggedTensor(
            keys=self.feature_names, values=ids_N, lengths=lengths_FB.reshape(-1)
        )
        return Batch(dense_features=dense_BD, sparse_features=kjt, labels=labels_B)

    def _build_schema(self) -> None:
        """Per-feature distributions (dense tails, bag lengths, id permutation): seed only."""
        cfg = self.cfg
        g = _generator(cfg.seed, _TAG_SCHEMA)
        D, F, L = cfg.num_dense, cfg.num_sparse, cfg.max_pooling
        # Dense: count = 0 with prob zero_D, else floor(scale * (v^(-1/alpha) - 1)), v ~ U(0,1):
        # a Pareto tail of index alpha (alpha < 1: infinite mean, like Criteo's largest counts).
        self._dense_alpha_D = 0.6 + 1.4 * torch.rand(D, generator=g, dtype=torch.float64)
        self._dense_scale_D = torch.exp(
            math.log(1000.0) * torch.rand(D, generator=g, dtype=torch.float64)
        )
        self._dense_zero_D = 0.4 * torch.rand(D, generator=g, dtype=torch.float64)
        # Bags: length 0 with prob empty_F, else 1 + floor(v^gamma_F * max_len_F).
        pattern_F = torch.arange(F) % 3 if L > 1 else torch.arange(F) % 2
        u_F3 = torch.rand(F, 3, generator=g, dtype=torch.float64)
        self._empty_F = torch.where(
            pattern_F == 0,
            torch.zeros(F, dtype=torch.float64),
            torch.where(pattern_F == 1, 0.05 + 0.45 * u_F3[:, 0], 0.2 * u_F3[:, 0]),
        )
        self._max_len_F = torch.where(
            pattern_F == 2,
            2 + (u_F3[:, 1] * (L - 1)).long().clamp(max=L - 2),
            torch.ones(F, dtype=torch.long),
        )
        self._gamma_F = 1.0 + 2.0 * u_F3[:, 2]
        # Ids: Zipf rank -> id = (a*rank + b) mod rows, a coprime with rows (a bijection).
        rows = self.num_embeddings_per_feature
        a_list, b_list = [], []
        for r in rows:
            a = 1 + int(torch.randint(0, max(r - 1, 1), (1,), generator=g))
            while math.gcd(a, r) != 1:
                a += 1
            a_list.append(a % r if r > 1 else 0)
            b_list.append(int(torch.randint(0, r, (1,), generator=g)))
        self._rows_F = torch.tensor(rows, dtype=torch.long)
        self._perm_a_F = torch.tensor(a_list, dtype=torch.long)
        self._perm_b_F = torch.tensor(b_list, dtype=torch.long)
        # Hash-stream codes.
        self._code_D = torch.tensor([_key(_TAG_DENSE, j) for j in range(D)], dtype=torch.long)
        self._code_F = torch.tensor([_key(_TAG_LENGTH, f) for f in range(F)], dtype=torch.long)
        self._code_FL = torch.tensor(
            [[_key(_TAG_ID, f, k) for k in range(L)] for f in range(F)], dtype=torch.long
        )
        self._code_label = _key(_TAG_LABEL)
        # Moments from a quantile grid (deterministic, no sampling): standardize the dense
        # features for the teacher, and normalize bag sums by the expected length.
        u_M = (torch.arange(_QUANTILE_POINTS, dtype=torch.float64) + 0.5) / _QUANTILE_POINTS
        x_MD = self._dense_from_uniform(u_M[:, None].expand(-1, D))
        self._dense_mean_D = x_MD.mean(0)
        self._dense_std_D = x_MD.std(0).clamp(min=1e-3)
        self._mean_len_F = self._lengths_from_uniform(u_M[:, None].expand(-1, F)).double().mean(0)

    def _build_teacher(self) -> None:
        """The hidden teacher's tables: seed only, so identical on every rank and split."""
        cfg = self.cfg
        g = _generator(cfg.seed, _TAG_TEACHER)
        F, D = cfg.num_sparse, cfg.num_dense
        scale = cfg.teacher_scale
        self._trows_F = self._rows_F.clamp(max=_TEACHER_MAX_ROWS)
        self._toff_F = torch.cumsum(self._trows_F, 0) - self._trows_F
        importance_F = 0.3 + 1.0 * torch.rand(F, generator=g)
        # Sum pooling is what a DLRM computes, so the per-id term is exactly learnable; the
        # 1/sqrt(E[len]) keeps multi-hot features from dominating.
        feature_scale_F = (
            scale * _SIGMA_ID * importance_F.double() / self._mean_len_F.clamp(min=1e-3).sqrt()
        )
        w_R = torch.randn(int(self._trows_F.sum()), generator=g).double()
        self._w_R = w_R * torch.repeat_interleave(feature_scale_F, self._trows_F)
        # Pairwise rank-K interaction of P features: sum_{i<j} <pooled_i, pooled_j>.
        P = min(_NUM_INTERACTING, F)
        inter_P = torch.randperm(F, generator=g)[:P]
        self._pslot_F = torch.full((F,), -1, dtype=torch.long)
        self._pslot_F[inter_P] = torch.arange(P)
        vrows_P = self._trows_F[inter_P]
        self._voff_F = torch.zeros(F, dtype=torch.long)
        self._voff_F[inter_P] = torch.cumsum(vrows_P, 0) - vrows_P
        v_scale_P = (
            math.sqrt(scale) * _SIGMA_INTERACTION / self._mean_len_F[inter_P].clamp(min=1e-3).sqrt()
        )
        v_RK = torch.randn(int(vrows_P.sum()), _INTERACTION_RANK, generator=g).double()
        self._v_RK = v_RK * torch.repeat_interleave(v_scale_P, vrows_P)[:, None]
        self._num_interacting = P
        # Everything the per-id path needs to know about its feature.
        self._per_feature = (
            self._rows_F,
            self._perm_a_F,
            self._perm_b_F,
            self._trows_F,
            self._toff_F,
            self._pslot_F,
            self._voff_F,
        )
        s = cfg.zipf_exponent
        rows_f_F = self._rows_F.double()
        self._zipf_c_F = (
            torch.log(rows_f_F + 1.0) if s == 1.0 else torch.pow(rows_f_F + 1.0, 1.0 - s) - 1.0
        )
        self._u_D = scale * _SIGMA_DENSE * torch.randn(D, generator=g).double() / math.sqrt(D)

    def _calibrate_bias(self) -> float:
        """The bias giving mean sigmoid(logit) = TARGET_CTR on a seed-derived calibration stream."""
        z_B = self._generate(0, _CALIBRATION_SAMPLES, split="calib")[4].double()
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if torch.sigmoid(z_B + mid).mean().item() < TARGET_CTR:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def _dense_from_uniform(self, u_XD: torch.Tensor) -> torch.Tensor:
        """Uniforms -> log1p(count) of each dense feature (float64)."""
        zero_D = self._dense_zero_D
        v_XD = ((u_XD - zero_D) / (1.0 - zero_D)).clamp(min=1e-12)
        count_XD = torch.floor(self._dense_scale_D * (v_XD.pow(-1.0 / self._dense_alpha_D) - 1.0))
        count_XD = torch.where(u_XD < zero_D, 0.0, count_XD.clamp(0.0, 2**31 - 1))
        return torch.log1p(count_XD)

    def _lengths_from_uniform(self, u_XF: torch.Tensor) -> torch.Tensor:
        """Uniforms -> bag lengths (int64)."""
        empty_F = self._empty_F
        v_XF = ((u_XF - empty_F) / (1.0 - empty_F)).clamp(0.0, 1.0)
        len_XF = 1 + torch.floor(v_XF.pow(self._gamma_F) * self._max_len_F).long()
        len_XF = torch.minimum(len_XF, self._max_len_F)
        return torch.where(u_XF < empty_F, 0, len_XF)

    def _generate(
        self, start: int, count: int, split: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global samples [start, start + count) of `split`.

        Returns dense_BD (float32 log1p counts), lengths_FB (int32), ids_N (int64, feature-major
        like a KeyedJaggedTensor), labels_B (float32) and teacher logits_B (float64).

        Everything past the integer hash is float64 on purpose: a float op may round its last
        bit differently in the vectorized body and the scalar tail of a CPU kernel, i.e.
        depending on where a sample sits in the batch. In float64 such a 1-ulp difference
        changes a floor(), a float32 rounding or a label comparison with probability ~1e-12,
        so the rank-concatenation contract holds in practice, not only in the tests.
        """
        cfg = self.cfg
        tag = _SPLIT_TAGS[split or self.split]
        B, F, L = count, cfg.num_sparse, cfg.max_pooling
        # Per-sample key: a bijection of the sample index (no two samples share a key for
        # 2**32 samples), keyed by (seed, split).
        n_B = torch.arange(start, start + count, dtype=torch.long)
        key_lo, key_hi = _key(cfg.seed, tag, 0), _key(cfg.seed, tag, 1)
        base_B = _mix32(_mix32((n_B & _M32) ^ key_lo) ^ _mix32((n_B >> 32) ^ key_hi))

        u_BD = _uniform(_mix32(base_B[:, None] ^ self._code_D))
        dense_BD = self._dense_from_uniform(u_BD)
        u_BF = _uniform(_mix32(base_B[:, None] ^ self._code_F))
        lengths_FB = self._lengths_from_uniform(u_BF).t().contiguous()

        # One entry per id: its segment (f*B + b), feature, sample and slot in the bag.
        # (_take, a 1-D gather, is several times faster on CPU than advanced indexing.)
        lengths_S = lengths_FB.reshape(-1)
        num_ids = int(lengths_S.sum())
        seg_N = torch.repeat_interleave(torch.arange(F * B), lengths_S, output_size=num_ids)
        starts_S = torch.cumsum(lengths_S, 0) - lengths_S
        slot_N = torch.arange(num_ids) - _take(starts_S, seg_N)
        f_N = torch.div(seg_N, B, rounding_mode="floor")
        b_N = seg_N - f_N * B
        code_N = _take(self._code_FL.view(-1), f_N * L + slot_N)
        u_N = _uniform(_mix32(_take(base_B, b_N) ^ code_N))
        rows_N, perm_a_N, perm_b_N, trows_N, toff_N, pslot_N, voff_N = (
            _take(t_F, f_N) for t_F in self._per_feature
        )
        # Zipf rank by the inverse CDF of a continuous power law on [1, rows + 1).
        c_N = _take(self._zipf_c_F, f_N)
        s = cfg.zipf_exponent
        if s == 1.0:
            x_N = torch.exp(u_N * c_N)
        else:
            x_N = torch.pow(u_N * c_N + 1.0, 1.0 / (1.0 - s))
        rank_N = torch.minimum((x_N.long() - 1).clamp_(min=0), rows_N - 1)
        ids_N = torch.remainder(perm_a_N * rank_N + perm_b_N, rows_N)

        # Teacher.
        trow_N = torch.remainder(ids_N, trows_N)
        logit_B = torch.full((B,), self._bias, dtype=torch.float64)
        logit_B.index_add_(0, b_N, _take(self._w_R, toff_N + trow_N))
        dense_std_BD = (dense_BD - self._dense_mean_D) / self._dense_std_D
        logit_B += (dense_std_BD * self._u_D).sum(1)
        keep_n = torch.nonzero(pslot_N >= 0).squeeze(1)
        P = self._num_interacting
        vrow_n = _take(voff_N + trow_N, keep_n)
        pooled_BPK = torch.zeros(B * P, _INTERACTION_RANK, dtype=torch.float64)
        pooled_BPK.index_add_(
            0,
            _take(b_N, keep_n) * P + _take(pslot_N, keep_n),
            self._v_RK.index_select(0, vrow_n),
        )
        pooled_BPK = pooled_BPK.view(B, P, _INTERACTION_RANK)
        logit_B += 0.5 * (pooled_BPK.sum(1).square().sum(-1) - pooled_BPK.square().sum((1, 2)))

        u_label_B = _uniform(_mix32(base_B ^ self._code_label))
        labels_B = (u_label_B < torch.sigmoid(logit_B)).to(torch.float32)
        return dense_BD.float(), lengths_FB.to(torch.int32), ids_N, labels_B, logit_B
