"""The loader's batch memory: batches the consumer keeps stay intact (memory
is reused only once nothing refers to a batch), a consumer that drops its
batches reuses a small ring, and ``break`` out of ``async for`` stops the
read-ahead and gives everything back (every async test runs on asyncio and
uvloop)."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings

import numpy as np
import pytest
import torch

from aionvme.data import BudgetWarning, Dataset, Loader, sync_write_dataset


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    """640 samples: x is 1024 float32 all equal to the sample's index."""
    d = tmp_path_factory.mktemp("mem") / "ds"
    sync_write_dataset(d, ({"x": np.full(1024, i, np.float32), "id": np.int64(i)} for i in range(640)))
    return d


def _intact(batch, want=None) -> bool:
    """Every row holds its own sample (and, in order, the samples it should)."""
    ids = batch["id"].tolist()
    if want is not None and ids != want:
        return False
    return all(bool((batch["x"][r] == i).all()) for r, i in enumerate(ids))


def _in_order(kept) -> bool:
    return all(_intact(b, list(range(16 * k, 16 * k + 16))) for k, b in enumerate(kept))


TWO_BATCHES = 2 * (16 * 4096 + 4096)  # the smallest budget: two batches of 16


def test_kept_batches_stay_intact(ds_path):
    """list(loader) with a budget of two batches: every batch keeps its own
    samples (on main, batch 0 held a later batch's), the loader goes beyond
    the budget with one BudgetWarning, and gives that memory back once the
    batches are dropped."""
    loader = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES)
    with pytest.warns(BudgetWarning, match="beyond") as rec:
        kept = list(loader)
    assert len([w for w in rec if issubclass(w.category, BudgetWarning)]) == 1
    assert len(kept) == 40 and _in_order(kept)
    st = loader.stats()
    assert st["slabs_beyond_budget"] >= 38 and st["slabs"] >= 40
    del kept, rec
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        n = sum(len(b["id"]) for b in loader)  # the next epoch, batches dropped as they come
    assert n == 640 and loader.stats()["slabs"] <= 2  # memory beyond the budget was freed
    loader.close()


def test_views_slices_and_numpy_keep_their_batch(ds_path):
    """Whatever still refers to a batch's memory keeps it: a row sliced off,
    a .numpy() of a field, a numpy batch's view; the batch dict itself dropped."""
    loader = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES)
    rows, arrays = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)
        for b in loader:
            rows.append((b["id"][0].item(), b["x"][0]))  # a view of one row
            arrays.append((b["id"][1].item(), b["x"].numpy()[1]))
    assert all(bool((x == i).all()) for i, x in rows)
    assert all(bool((x == i).all()) for i, x in arrays)
    loader.close()
    npl = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES, tensors="numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)
        views = [(b["id"][2], b["x"][2, :8]) for b in npl]
    assert all((x == i).all() for i, x in views)
    npl.close()


def test_dropped_batches_reuse_a_ring(ds_path):
    """A loop that drops each batch when it takes the next stays within the
    budget, reuses the same buffers and never warns."""
    loader = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES)
    ptrs = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        for b in loader:
            assert _intact(b)
            ptrs.add(b["x"].data_ptr())
    assert len(ptrs) == 2 and loader.stats()["slabs"] == 2
    assert loader.stats()["slabs_beyond_budget"] == 0
    loader.close()


def test_counted_keep_is_a_hard_bound(ds_path):
    """keep=k is the counted ring: never beyond the budget, whatever is kept
    (a kept batch is overwritten after k + 1 later ones)."""
    loader = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES, keep=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        kept = list(loader)
    loader.close()
    assert loader.stats()["slabs"] == 2 and loader.stats()["slabs_beyond_budget"] == 0
    assert not _in_order(kept)  # documented: memory reused under kept batches
    assert kept[-1]["id"].tolist() == list(range(624, 640))


async def test_kept_batches_stay_intact_async(ds_path):
    loader = Loader(ds_path, batch_size=16, prefetch=TWO_BATCHES)
    with pytest.warns(BudgetWarning):
        kept = [b async for b in loader]
    assert len(kept) == 40 and _in_order(kept)
    await loader.aclose()


def test_cuda_style_memory_is_tracked_by_storage_users():
    """Batch memory that is a torch tensor (CUDA slabs) is in use while any
    tensor shares its storage (torch's count), here with a CPU tensor."""
    from aionvme.data._memory import Slab, _storage_users

    slab = Slab.__new__(Slab)
    slab.owner = slab.buf = torch.zeros(8192, dtype=torch.uint8)
    slab.users = _storage_users(slab.owner)
    mem, lent = slab.lend(4096)
    assert not lent.in_use()
    view = mem[4096:].view(torch.int32).reshape(16, 64)
    assert lent.in_use()
    row = view[3].detach()
    del view
    assert lent.in_use()
    del row
    assert not lent.in_use()


@pytest.mark.parametrize("fresh", [True, False], ids=["new-loader-each-time", "one-loader"])
async def test_early_breaks_leave_nothing_running(ds_path, fresh, caplog):
    """200 ``async for ... break`` without aclose (on main: 41-57 tasks pending,
    "Task was destroyed but it is pending!", RSS +200 MiB with a new loader
    each time): nothing pending, no such log, memory bounded."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    ds = Dataset(ds_path)
    loader = Loader(ds, batch_size=16, shuffle=True, prefetch="1M")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    base = 0
    for i in range(200):
        if fresh:
            loader = Loader(ds, batch_size=16, shuffle=True, prefetch="1M")
        async for _b in loader:
            break
        if i == 20:
            gc.collect()
            base = rss()
    for _ in range(10):
        await asyncio.sleep(0.01)
    gc.collect()
    await asyncio.sleep(0.01)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert pending == []
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
    # each abandoned loader held up to 1 MiB of batch memory: 180 of them would be 180 MiB
    assert rss() - base < 48 << 20
    st = loader.stats()
    await loader.aclose()
    ds.close()
    if not fresh:  # 40 batches an epoch: 196 batches and 4 ends of an epoch
        assert st["batches"] == 196 and st["slabs"] <= (1 << 20) // loader.slab_nbytes
