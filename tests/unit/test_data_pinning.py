"""PinnedBatches: every train batch reaches the step pinned, and a cached batch is pinned once.

Real page-locked memory needs CUDA (``tests/gpu`` checks it); here ``pin`` is a recording copy,
so the memo's bookkeeping (reuse, budget, dead items) is checked on the CPU.
"""

from __future__ import annotations

import gc

import pytest

from loka_train.data import DataConfig
from loka_train.data.pinning import PinnedBatches, batch_bytes
from loka_train.data.synthetic import SyntheticDataset
from loka_train.runtime.config import TrainerConfig


class Item:
    """A batch stand-in of a given size (weak-referenceable, like TorchRec's Batch)."""

    def __init__(self, name: str, size: int = 10) -> None:
        self.name, self.size = name, size


class Pinned:
    def __init__(self, item: Item) -> None:
        self.of = item.name


def pinner(calls: list[str]):  # type: ignore[no-untyped-def]
    def pin(item: Item) -> Pinned:
        calls.append(item.name)
        return Pinned(item)

    return pin


def test_every_item_is_pinned_and_a_repeated_one_only_once() -> None:
    a, b = Item("a"), Item("b")
    calls: list[str] = []
    it = PinnedBatches(iter([a, b, a, b, a]), pin=pinner(calls), nbytes=lambda i: i.size)
    out = list(it)
    assert [p.of for p in out] == ["a", "b", "a", "b", "a"]
    assert calls == ["a", "b"]
    assert out[0] is out[2] is out[4] and out[1] is out[3]
    assert (it.pinned, it.reused, it.held_bytes) == (2, 3, 20)


def test_the_budget_evicts_the_least_recently_used() -> None:
    a, b, c = Item("a"), Item("b"), Item("c")
    calls: list[str] = []
    # Room for two: a, b, a (a is now the most recent), c evicts b, b is pinned again.
    it = PinnedBatches(iter([a, b, a, c, b, a]), pin=pinner(calls), nbytes=lambda i: i.size, memo_bytes=20)
    list(it)
    assert calls == ["a", "b", "c", "b", "a"]
    assert it.held_bytes <= 20


def test_no_memo_pins_every_item() -> None:
    a = Item("a")
    calls: list[str] = []
    list(PinnedBatches(iter([a, a, a]), pin=pinner(calls), nbytes=lambda i: i.size, memo_bytes=0))
    assert calls == ["a", "a", "a"]


def test_an_item_larger_than_the_budget_is_not_kept() -> None:
    big = Item("big", size=100)
    calls: list[str] = []
    it = PinnedBatches(iter([big, big]), pin=pinner(calls), nbytes=lambda i: i.size, memo_bytes=50)
    list(it)
    assert calls == ["big", "big"] and it.held_bytes == 0


def test_dead_items_leave_the_memo() -> None:
    def fresh():  # type: ignore[no-untyped-def]
        for n in range(5):
            yield Item(f"x{n}")  # dropped by the source after use

    calls: list[str] = []
    it = PinnedBatches(fresh(), pin=pinner(calls), nbytes=lambda i: i.size)
    for _ in it:
        gc.collect()
    assert calls == [f"x{n}" for n in range(5)]
    # Each new item purges the dead ones: at most the last item is still held.
    assert it.held_bytes <= 10


def test_batch_bytes_counts_a_synthetic_batch() -> None:
    ds = SyntheticDataset(DataConfig(num_sparse=4, num_embeddings=200, chunk_size=16, max_pooling=3),
                          split="train", rank=0, world_size=1, batch_size=32)
    batch = ds.batch(0)
    kjt = batch.sparse_features
    expected = (32 * ds.num_dense * 4 + 32 * 4 + kjt.values().numel() * 8 + kjt.lengths().numel() * 4
                + (kjt.offsets().numel() * kjt.offsets().element_size()))
    assert batch_bytes(batch) == expected


def test_negative_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match="memo_bytes"):
        PinnedBatches(iter([]), memo_bytes=-1)


@pytest.mark.parametrize(("fields", "message"), [
    ({"pin_memory": True, "device": "cpu"}, "trainer.pin_memory=true needs trainer.device=cuda"),
    ({"pin_memory": "yes"}, "trainer.pin_memory must be"),
])
def test_pin_memory_config_errors_name_the_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**fields)
