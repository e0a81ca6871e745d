"""Synthetic Criteo-like data: determinism contract, distributions, and a learnable teacher.

Shape legend: B batch, D dense features, F categorical features.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec.datasets.utils import Batch

from loka_train.data import DataConfig, RecDataset, auc, make_dataset, normalized_entropy
from loka_train.data.synthetic import _mix32


def _ds(
    cfg: DataConfig,
    *,
    split: str = "train",
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 64,
):
    return make_dataset(cfg, split=split, rank=rank, world_size=world_size, batch_size=batch_size)


def _assert_batches_equal(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())


def _concat(
    batches: list[Batch],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Concatenate local batches along the batch dim, feature by feature."""
    dense_BD = torch.cat([b.dense_features for b in batches])
    labels_B = torch.cat([b.labels for b in batches])
    sparse = {}
    for key in batches[0].sparse_features.keys():
        jts = [b.sparse_features[key] for b in batches]
        sparse[key] = (
            torch.cat([jt.lengths() for jt in jts]),
            torch.cat([jt.values() for jt in jts]),
        )
    return dense_BD, labels_B, sparse


def test_batch_format() -> None:
    cfg = DataConfig(num_dense=5, num_sparse=4, num_embeddings=50)
    ds = _ds(cfg, batch_size=64)
    assert isinstance(ds, RecDataset)
    assert ds.feature_names == ["cat_0", "cat_1", "cat_2", "cat_3"]
    assert ds.num_embeddings_per_feature == [50] * 4 and ds.num_dense == 5
    b = ds.batch(0)
    assert isinstance(b, Batch)
    assert b.dense_features.shape == (64, 5) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (64,) and b.labels.dtype == torch.float32
    kjt = b.sparse_features
    assert kjt.keys() == ds.feature_names
    assert kjt.lengths().dtype == torch.int32 and kjt.values().dtype == torch.int64
    assert kjt.lengths().numel() == 4 * 64
    assert int(kjt.lengths().sum()) == kjt.values().numel()
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}


def test_cache_batches_cycles_the_first_batches_and_leaves_eval_alone() -> None:
    cfg = DataConfig(num_sparse=3, num_embeddings=100)
    fresh, cached = _ds(cfg), _ds(DataConfig(num_sparse=3, num_embeddings=100, cache_batches=2))
    for step in range(5):
        _assert_batches_equal(cached.batch(step), fresh.batch(step % 2))
    assert not torch.equal(fresh.batch(2).labels, fresh.batch(0).labels)
    assert cached.batch(4) is cached.batch(0)  # served from memory, not regenerated
    ev = _ds(DataConfig(num_sparse=3, num_embeddings=100, cache_batches=2), split="eval")
    _assert_batches_equal(ev.batch(3), _ds(cfg, split="eval").batch(3))
    with pytest.raises(ValueError, match="step=-1"):
        cached.batch(-1)


def test_pin_cache_swaps_the_kept_batches_for_their_pinned_copies() -> None:
    from loka_train.data.pinning import batch_bytes
    from loka_train.data.protocol import CachedBatches

    cached = _ds(DataConfig(num_sparse=3, num_embeddings=100, cache_batches=3))
    assert isinstance(cached, CachedBatches)
    assert cached.pin_cache(lambda b: b) == (0, 0)  # nothing generated yet: nothing to pin
    originals = [cached.batch(step) for step in range(2)]
    copies: list[Batch] = []

    def pin(batch: Batch) -> Batch:  # a stand-in for Batch.pin_memory (no CUDA here)
        copies.append(Batch(batch.dense_features.clone(), batch.sparse_features, batch.labels.clone()))
        return copies[-1]

    assert cached.pin_cache(pin) == (2, sum(batch_bytes(b) for b in originals))
    for step in range(2):
        assert cached.batch(step) is copies[step] and cached.batch(step + 3) is copies[step]
        _assert_batches_equal(cached.batch(step), originals[step])
    assert all(cached.batch(2) is not c for c in copies)  # generated after: left to the step loop's pinning


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_concatenate_to_the_single_process_batch(world_size: int) -> None:
    cfg = DataConfig(seed=3, num_embeddings=500)
    B = 64
    ranks = [_ds(cfg, rank=r, world_size=world_size, batch_size=B) for r in range(world_size)]
    single = _ds(cfg, world_size=1, batch_size=world_size * B)
    for step in (0, 1, 5):
        want_dense, want_labels, want_sparse = _concat([single.batch(step)])
        dense, labels, sparse = _concat([ds.batch(step) for ds in ranks])
        assert torch.equal(dense, want_dense) and torch.equal(labels, want_labels)
        for key, (lengths, values) in want_sparse.items():
            assert torch.equal(sparse[key][0], lengths) and torch.equal(sparse[key][1], values)
        teacher = torch.cat([ds.teacher_logits(step) for ds in ranks])
        torch.testing.assert_close(teacher, single.teacher_logits(step), rtol=1e-12, atol=1e-12)


def test_batch_does_not_depend_on_the_thread_count() -> None:
    """Kernels split work differently with more threads (vector body vs scalar tail)."""
    ds = _ds(DataConfig(seed=6, num_embeddings=1_000_000), batch_size=4096)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ds.batch(2)
        torch.set_num_threads(2)
        two = ds.batch(2)
    finally:
        torch.set_num_threads(threads)
    _assert_batches_equal(one, two)


def test_chunk_depends_only_on_its_index() -> None:
    """Chunk c of 64 samples is the same whether read as step c of batch 64 or inside a bigger batch."""
    cfg = DataConfig(seed=5, chunk_size=64, num_embeddings=500)
    small = _ds(cfg, batch_size=64)
    big = _ds(cfg, batch_size=256)
    for c in range(4):
        _assert_batches_equal(small.batch(4 + c), _slice(big.batch(1), c * 64, (c + 1) * 64))


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = b.sparse_features.keys()
    lengths, values = [], []
    for key in keys:
        jt = b.sparse_features[key]
        offsets = jt.offsets()
        lengths.append(jt.lengths()[lo:hi])
        values.append(jt.values()[offsets[lo] : offsets[hi]])
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(
        dense_features=b.dense_features[lo:hi], sparse_features=kjt, labels=b.labels[lo:hi]
    )


def test_same_inputs_same_batch_and_differences() -> None:
    cfg = DataConfig(seed=7, num_embeddings=1000)
    a = _ds(cfg, rank=1, world_size=2)
    b = _ds(DataConfig(seed=7, num_embeddings=1000), rank=1, world_size=2)
    _assert_batches_equal(a.batch(3), b.batch(3))
    assert not torch.equal(a.batch(3).dense_features, a.batch(4).dense_features)
    assert not torch.equal(
        a.batch(3).dense_features, _ds(cfg, rank=0, world_size=2).batch(3).dense_features
    )
    other_seed = _ds(DataConfig(seed=8, num_embeddings=1000), rank=1, world_size=2)
    assert not torch.equal(a.batch(3).dense_features, other_seed.batch(3).dense_features)
    ev = _ds(cfg, split="eval", rank=1, world_size=2)
    assert not torch.equal(a.batch(3).dense_features, ev.batch(3).dense_features)
    # batches() yields the same as batch().
    for step, got in enumerate(a.batches(start_step=2, num_steps=3), start=2):
        _assert_batches_equal(got, a.batch(step))
    assert len(list(a.batches(0, 0))) == 0


def test_eval_split_uses_the_same_teacher() -> None:
    cfg = DataConfig(seed=11, num_embeddings=1000)
    tr, ev = _ds(cfg, split="train"), _ds(cfg, split="eval", rank=1, world_size=2)
    assert torch.equal(tr._w_R, ev._w_R) and torch.equal(tr._v_RK, ev._v_RK)
    assert torch.equal(tr._u_D, ev._u_D) and tr._bias == ev._bias


def test_sample_index_beyond_32_bits() -> None:
    ds = _ds(DataConfig(num_embeddings=1000), batch_size=64)
    far = ds.batch(2**33 // 64)  # sample index 2**33
    assert not torch.equal(far.dense_features, ds.batch(0).dense_features)
    _assert_batches_equal(far, ds.batch(2**33 // 64))


def test_hash_matches_on_ints_and_tensors_and_is_a_bijection() -> None:
    x = torch.arange(0, 1 << 16, dtype=torch.long) * 65521 + 12345
    h = _mix32(x)
    assert h.unique().numel() == x.numel()
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    for i in (0, 17, 65535):
        assert int(h[i]) == _mix32(int(x[i]))


def test_dense_features_are_heavy_tailed_counts() -> None:
    ds = _ds(DataConfig(seed=0), batch_size=4096)
    dense_BD = ds.batch(0).dense_features.double()
    assert bool((dense_BD >= 0).all()) and bool(torch.isfinite(dense_BD).all())
    counts_BD = torch.expm1(dense_BD).round()
    median_D = counts_BD.median(0).values
    max_D = counts_BD.max(0).values
    # Every feature: the largest count dwarfs the typical one (max >> median before log1p).
    assert bool((max_D >= 10 * (median_D + 1)).all()), (median_D, max_D)
    assert float(max_D.max()) > 1e4
    # Some features are often zero (missing), like Criteo's.
    assert float((counts_BD == 0).double().mean(0).max()) > 0.2


def test_ids_in_range_and_zipf_skewed() -> None:
    rows = [7, 100, 1000, 10_000, 1_000_000]
    cfg = DataConfig(seed=1, num_sparse=5, num_embeddings_per_feature=rows, max_pooling=4)
    ds = _ds(cfg, batch_size=4096)
    kjt = ds.batch(0).sparse_features
    for f, key in enumerate(ds.feature_names):
        ids = kjt[key].values()
        assert ids.numel() > 0
        assert int(ids.min()) >= 0 and int(ids.max()) < rows[f]
    for f in (2, 3):
        ids = kjt[ds.feature_names[f]].values()
        counts = torch.bincount(ids, minlength=rows[f]).sort(descending=True).values
        top1pct = rows[f] // 100
        share = float(counts[:top1pct].sum()) / ids.numel()
        assert share > 0.5, share
        # The hot ids are spread over the table, not packed at its start.
        hot = torch.bincount(ids, minlength=rows[f]).argsort(descending=True)[:10]
        assert int(hot.max() - hot.min()) > rows[f] // 4


def test_pooling_lengths_vary_per_feature() -> None:
    cfg = DataConfig(seed=2, max_pooling=6)
    ds = _ds(cfg, batch_size=2048)
    lengths_FB = ds.batch(0).sparse_features.lengths().view(cfg.num_sparse, -1)
    assert int(lengths_FB.min()) >= 0 and int(lengths_FB.max()) <= 6
    always_one = (lengths_FB == 1).all(1)
    sometimes_empty = (lengths_FB == 0).any(1)
    multi_hot = lengths_FB.max(1).values > 1
    assert always_one.any() and sometimes_empty.any() and multi_hot.any()
    assert int(lengths_FB.max()) == 6
    mean_F = lengths_FB.float().mean(1)
    assert mean_F.unique().numel() > cfg.num_sparse // 2
    # max_pooling=1 makes every feature one-hot (possibly empty).
    one_hot = _ds(DataConfig(seed=2, max_pooling=1), batch_size=512).batch(0).sparse_features
    assert int(one_hot.lengths().max()) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_click_rate(seed: int) -> None:
    labels_B = _ds(DataConfig(seed=seed), batch_size=4096).batch(0).labels
    assert 0.15 <= float(labels_B.mean()) <= 0.35


def test_teacher_scale_zero_carries_no_signal() -> None:
    ds = _ds(DataConfig(seed=0, teacher_scale=0.0), batch_size=4096)
    logits_B = ds.teacher_logits(0)
    assert float(logits_B.std()) < 1e-5
    assert 0.2 <= float(ds.batch(0).labels.mean()) <= 0.3


def test_teacher_is_informative() -> None:
    ds = _ds(DataConfig(seed=0), split="eval", batch_size=4096)
    labels_B = ds.batch(0).labels
    assert normalized_entropy(ds.teacher_logits(0), labels_B) < 0.75


def test_logistic_regression_learns_the_teacher() -> None:
    """A hashed one-hot logistic model trained 250 steps at batch 256 gets NE clearly below 1."""
    torch.manual_seed(0)
    rows, num_sparse = 2000, 26
    cfg = DataConfig(seed=4, num_embeddings=rows)
    train = _ds(cfg, batch_size=256)
    held_out = _ds(cfg, split="eval", batch_size=4096).batch(0)
    w = torch.zeros(num_sparse * rows, 1, requires_grad=True)
    u_D = torch.zeros(cfg.num_dense, requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adagrad([w, u_D, bias], lr=0.1)

    def logits(b: Batch) -> torch.Tensor:
        kjt, B = b.sparse_features, b.labels.numel()
        lengths = kjt.lengths().long()
        feature = torch.arange(num_sparse).repeat_interleave(B).repeat_interleave(lengths)
        pooled_FB = F.embedding_bag(
            kjt.values() + feature * rows, w, torch.cumsum(lengths, 0) - lengths, mode="sum"
        ).view(num_sparse, B)
        return pooled_FB.sum(0) + (b.dense_features / 4) @ u_D + bias

    with torch.no_grad():
        ne_before = normalized_entropy(logits(held_out), held_out.labels)
    for b in train.batches(0, 250):
        loss = F.binary_cross_entropy_with_logits(logits(b), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = logits(held_out)
    ne = normalized_entropy(out, held_out.labels)
    assert ne_before > 1.0
    assert ne < 0.9, ne
    assert auc(out, held_out.labels) > 0.7


def test_chunk_size_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="data.chunk_size"):
        _ds(DataConfig(chunk_size=64), batch_size=96)
    assert (
        _ds(DataConfig(chunk_size=32, num_embeddings=100), batch_size=96).batch(0).labels.numel()
        == 96
    )


def test_negative_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="step"):
        _ds(DataConfig(num_embeddings=100)).batch(-1)
