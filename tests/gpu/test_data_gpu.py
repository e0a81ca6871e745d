"""Pinned train batches on a CUDA machine (``trainer.pin_memory``; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from loka_train.data import DataConfig
from loka_train.data.pinning import PinnedBatches
from loka_train.data.synthetic import SyntheticDataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_batches_come_out_pinned_and_reach_the_gpu_unchanged() -> None:
    cfg = DataConfig(num_sparse=4, num_embeddings=200, chunk_size=16, max_pooling=3, cache_batches=2)
    ds = SyntheticDataset(cfg, split="train", rank=0, world_size=1, batch_size=64)
    it = PinnedBatches(ds.batches(0, 4))
    got = list(it)
    for b in got:
        kjt = b.sparse_features
        assert b.dense_features.is_pinned() and b.labels.is_pinned()
        assert kjt.values().is_pinned() and kjt.lengths().is_pinned()
    assert (it.pinned, it.reused) == (2, 2) and got[0] is got[2]
    on_gpu = got[1].to(torch.device("cuda"), non_blocking=True)
    ref = ds.batch(1)
    torch.testing.assert_close(on_gpu.dense_features.cpu(), ref.dense_features, rtol=0, atol=0)
    torch.testing.assert_close(on_gpu.sparse_features.values().cpu(), ref.sparse_features.values(), rtol=0, atol=0)
    torch.testing.assert_close(on_gpu.labels.cpu(), ref.labels, rtol=0, atol=0)


def test_pin_cache_pins_the_kept_batches_once() -> None:
    from loka_train.data.pinning import pin_batch

    cfg = DataConfig(num_sparse=4, num_embeddings=200, chunk_size=16, max_pooling=3, cache_batches=3)
    ds = SyntheticDataset(cfg, split="train", rank=0, world_size=1, batch_size=64)
    for step in range(3):
        ds.batch(step)
    num, nbytes = ds.pin_cache(pin_batch)
    assert num == 3 and nbytes > 0
    kept = [ds.batch(step) for step in range(3)]
    assert all(b.dense_features.is_pinned() and b.sparse_features.values().is_pinned() for b in kept)
    # The step loop's pinning finds them pinned: the same memory, no second copy.
    again = next(PinnedBatches(iter(kept[:1])))
    assert again.dense_features.data_ptr() == kept[0].dense_features.data_ptr()
    assert again.sparse_features.values().data_ptr() == kept[0].sparse_features.values().data_ptr()
